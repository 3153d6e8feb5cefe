//! Renders a generation's events in OpenAI's shapes: `chat.completion.chunk` SSE events
//! (role chunk, content chunks, finish chunk, the usage chunk when asked, `[DONE]`), or one
//! `chat.completion`. `: keep-alive` comments flow while the request waits for a node. A
//! failure after the headers becomes `data: {"error": …}` and the stream ends without
//! `[DONE]`. The response stream owns the [`GenerationStream`]: when the client leaves, it
//! is dropped and the generation is told.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::json;
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::{GenEvent, GenerationStream, Usage};

use super::error::ApiError;

/// How often a comment is sent while nothing else is.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// `finish_reason` of a generation cancelled through the Generations API (OpenAI has none).
const CANCELLED: &str = "cancelled";
/// `system_fingerprint` of every response.
const FINGERPRINT: &str = "fp_switchyard";

/// What every chunk of one response repeats.
#[derive(Debug, Clone)]
pub struct Render {
    id: String,
    model: String,
    include_usage: bool,
    created: i64,
}

impl Render {
    /// Rendering for one response.
    pub fn new(id: &str, model: &str, include_usage: bool, created: i64) -> Self {
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            include_usage,
            created,
        }
    }

    fn chunk(&self, delta: Delta<'_>, finish_reason: Option<&str>) -> String {
        let chunk = Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            system_fingerprint: FINGERPRINT,
            choices: vec![Choice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason,
            }],
            usage: self.include_usage.then_some(None),
        };
        serde_json::to_string(&chunk).unwrap_or_default()
    }

    fn usage_chunk(&self, usage: &Usage) -> String {
        let chunk = Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            system_fingerprint: FINGERPRINT,
            choices: Vec::new(),
            usage: Some(Some(usage_json(usage))),
        };
        serde_json::to_string(&chunk).unwrap_or_default()
    }

    fn error(&self, failure: &Failure) -> String {
        let mut err = ApiError::from(failure.clone()).with_request_id(&self.id);
        err.failure.retry_after_secs = None;
        err.body().to_string()
    }
}

#[derive(Debug, Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: i64,
    model: &'a str,
    system_fingerprint: &'static str,
    choices: Vec<Choice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<serde_json::Value>>,
}

#[derive(Debug, Serialize)]
struct Choice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
}

#[derive(Debug, Default, Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<Option<()>>,
}

fn usage_json(u: &Usage) -> serde_json::Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
        }
    })
}

/// Maps the engine's finish reasons to OpenAI's.
fn finish_reason(u: &Usage) -> &str {
    match u.finish_reason.as_str() {
        "length" => "length",
        _ => "stop",
    }
}

/// Turns events into SSE `data:` payloads, in order.
struct Renderer {
    render: Render,
    pending: std::collections::VecDeque<String>,
    sent_role: bool,
    ended: bool,
}

impl Renderer {
    fn new(render: Render) -> Self {
        Self {
            render,
            pending: Default::default(),
            sent_role: false,
            ended: false,
        }
    }

    fn push_role(&mut self) {
        if !self.sent_role {
            self.sent_role = true;
            let delta = Delta {
                role: Some("assistant"),
                content: Some(""),
                refusal: Some(None),
            };
            self.pending.push_back(self.render.chunk(delta, None));
        }
    }

    fn finish(&mut self, usage: &Usage, reason: &str) {
        self.push_role();
        self.pending
            .push_back(self.render.chunk(Delta::default(), Some(reason)));
        if self.render.include_usage {
            self.pending.push_back(self.render.usage_chunk(usage));
        }
        self.pending.push_back("[DONE]".to_owned());
        self.ended = true;
    }

    fn push(&mut self, event: Option<GenEvent>) {
        match event {
            Some(GenEvent::Delta(text)) => {
                self.push_role();
                let delta = Delta {
                    content: Some(&text),
                    ..Delta::default()
                };
                self.pending.push_back(self.render.chunk(delta, None));
            }
            Some(GenEvent::Finished(usage)) => self.finish(&usage, finish_reason(&usage)),
            Some(GenEvent::Cancelled(usage)) => self.finish(&usage, CANCELLED),
            Some(GenEvent::Failed(failure)) => {
                self.pending.push_back(self.render.error(&failure));
                self.ended = true;
            }
            None => {
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                );
                self.pending.push_back(self.render.error(&failure));
                self.ended = true;
            }
        }
    }
}

/// The events of a stream: a running generation's, or a retained result's.
enum Source {
    Live(GenerationStream),
    Replay(std::vec::IntoIter<GenEvent>),
}

impl Source {
    async fn next(&mut self) -> Option<GenEvent> {
        match self {
            Self::Live(g) => g.next().await,
            Self::Replay(events) => events.next(),
        }
    }
}

fn sse_response(source: Source, render: Render) -> Response {
    let state = (source, Renderer::new(render));
    let events = futures::stream::unfold(state, |(mut source, mut r)| async move {
        loop {
            if let Some(data) = r.pending.pop_front() {
                return Some((
                    Ok::<Event, Infallible>(Event::default().data(data)),
                    (source, r),
                ));
            }
            if r.ended {
                return None;
            }
            let event = source.next().await;
            r.push(event);
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response()
}

/// A streaming response. Headers go out at once (the request is admitted); keep-alive
/// comments cover the wait for a node.
pub fn stream(generation: GenerationStream, render: Render) -> Response {
    sse_response(Source::Live(generation), render)
}

/// A retained result replayed for a repeated Idempotency-Key: the whole text in one chunk,
/// then the end.
pub async fn replay(
    events: Vec<GenEvent>,
    render: Render,
    stream: bool,
) -> Result<Response, ApiError> {
    if stream {
        Ok(sse_response(Source::Replay(events.into_iter()), render))
    } else {
        collect_from(Source::Replay(events.into_iter()), render).await
    }
}

/// A non-streaming response: the whole text in one `chat.completion`, or the error.
pub async fn collect(generation: GenerationStream, render: Render) -> Result<Response, ApiError> {
    collect_from(Source::Live(generation), render).await
}

async fn collect_from(mut source: Source, render: Render) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        let (usage, reason) = match source.next().await {
            Some(GenEvent::Delta(d)) => {
                text.push_str(&d);
                continue;
            }
            Some(GenEvent::Finished(usage)) => {
                let reason = finish_reason(&usage).to_owned();
                (usage, reason)
            }
            Some(GenEvent::Cancelled(usage)) => (usage, CANCELLED.to_owned()),
            Some(GenEvent::Failed(failure)) => return Err(ApiError::from(failure)),
            None => {
                return Err(ApiError::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                ));
            }
        };
        {
            {
                let body = json!({
                    "id": render.id,
                    "object": "chat.completion",
                    "created": render.created,
                    "model": render.model,
                    "system_fingerprint": FINGERPRINT,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "refusal": null},
                        "logprobs": null,
                        "finish_reason": reason,
                    }],
                    "usage": usage_json(&usage),
                });
                return Ok(axum::Json(body).into_response());
            }
        }
    }
}
