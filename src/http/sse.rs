//! Renders a generation's events in OpenAI's shapes: `chat.completion.chunk` SSE events
//! (role chunk, content chunks, finish chunk, the usage chunk when asked, `[DONE]`), or one
//! `chat.completion`. `: keep-alive` comments flow while the request waits for a node. A
//! failure after the headers becomes `data: {"error": …}` and the stream ends without
//! `[DONE]`. The response stream owns the [`GenerationStream`]: when the client leaves, it
//! is dropped and the generation is told. A resumable generation's stream numbers its
//! events (`id:`), and [`resume`] replays it from its journal after the client's
//! `Last-Event-ID`, following it live.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::events::{journal_key, read_journal};
use switchyard_actors::generation::{GenEvent, GenerationStream, Usage};
use switchyard_actors::lifecycle::{GenerationRecord, Status};
use switchyard_actors::output::{Assembled, Piece};
use switchyard_actors::ports::Coordinator;

use super::error::ApiError;
use crate::server::AppState;
use crate::store::Store;

/// How often a comment is sent while nothing else is.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// `finish_reason` of a generation cancelled through the Generations API (OpenAI has none).
const CANCELLED: &str = "cancelled";
/// `system_fingerprint` of every response.
const FINGERPRINT: &str = "fp_switchyard";

/// Which OpenAI response shape a generation is rendered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `chat.completion` / `chat.completion.chunk`.
    Chat,
    /// The legacy `text_completion`.
    Completions,
}

/// What every chunk of one response repeats.
#[derive(Debug, Clone)]
pub struct Render {
    id: String,
    model: String,
    include_usage: bool,
    created: i64,
    dialect: Dialect,
    /// `{"id":…,"object":…,"created":…,"model":…,` (and the fingerprint for chat): every
    /// chunk starts with it, so a relayed delta is copied between fixed bytes.
    head: String,
    /// Each SSE event carries `id: <n>` (n from 0): the stream can be resumed after it.
    ids: bool,
}

impl Render {
    /// Rendering for one chat response.
    pub fn new(id: &str, model: &str, include_usage: bool, created: i64) -> Self {
        Self::with_dialect(Dialect::Chat, id, model, include_usage, created)
    }

    /// Rendering for one response in `dialect`.
    pub fn with_dialect(
        dialect: Dialect,
        id: &str,
        model: &str,
        include_usage: bool,
        created: i64,
    ) -> Self {
        let head = match dialect {
            Dialect::Chat => format!(
                r#"{{"id":{},"object":"chat.completion.chunk","created":{created},"model":{},"system_fingerprint":"{FINGERPRINT}","#,
                json_string(id),
                json_string(model)
            ),
            Dialect::Completions => format!(
                r#"{{"id":{},"object":"text_completion","created":{created},"model":{},"#,
                json_string(id),
                json_string(model)
            ),
        };
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            include_usage,
            created,
            dialect,
            head,
            ids: false,
        }
    }

    /// Numbers each SSE event (`id:`), so the client can resume after the last it saw.
    pub fn resumable(mut self) -> Self {
        self.ids = true;
        self
    }

    /// One chunk around `choice` (a JSON object's text).
    fn chunk(&self, choice: &str) -> String {
        let usage = if self.include_usage {
            r#","usage":null"#
        } else {
            ""
        };
        format!(r#"{}"choices":[{choice}]{usage}}}"#, self.head)
    }

    /// The chunk of one piece of output: the engine's delta and logprobs as it sent them.
    fn piece(&self, piece: &Piece) -> String {
        let logprobs = piece.logprobs.as_ref().map_or("null", |l| l.get());
        match (self.dialect, &piece.raw) {
            (Dialect::Chat, Some(raw)) => self.chunk(&format!(
                r#"{{"index":0,"delta":{},"logprobs":{logprobs},"finish_reason":null}}"#,
                raw.get()
            )),
            (Dialect::Chat, None) if piece.tool_calls.is_empty() && piece.reasoning.is_empty() => {
                self.chunk(&format!(
                    r#"{{"index":0,"delta":{{"content":{}}},"logprobs":{logprobs},"finish_reason":null}}"#,
                    json_string(&piece.text)
                ))
            }
            // A replayed answer: its text, reasoning and whole tool calls in one delta.
            (Dialect::Chat, None) => {
                let mut delta = serde_json::Map::new();
                if !piece.text.is_empty() {
                    delta.insert("content".into(), Value::String(piece.text.clone()));
                }
                if !piece.reasoning.is_empty() {
                    delta.insert(
                        "reasoning_content".into(),
                        Value::String(piece.reasoning.clone()),
                    );
                }
                if !piece.tool_calls.is_empty() {
                    delta.insert("tool_calls".into(), json!(piece.tool_calls));
                }
                self.chunk(&format!(
                    r#"{{"index":0,"delta":{},"logprobs":{logprobs},"finish_reason":null}}"#,
                    Value::Object(delta)
                ))
            }
            (Dialect::Completions, _) => self.chunk(&format!(
                r#"{{"index":0,"text":{},"logprobs":{logprobs},"finish_reason":null}}"#,
                json_string(&piece.text)
            )),
        }
    }

    fn role(&self) -> String {
        self.chunk(r#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#)
    }

    fn finish(&self, reason: &str) -> String {
        let reason = json_string(reason);
        match self.dialect {
            Dialect::Chat => self.chunk(&format!(
                r#"{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":{reason}}}"#
            )),
            Dialect::Completions => self.chunk(&format!(
                r#"{{"index":0,"text":"","logprobs":null,"finish_reason":{reason}}}"#
            )),
        }
    }

    fn usage_chunk(&self, usage: &Usage) -> String {
        format!(
            r#"{}"choices":[],"usage":{}}}"#,
            self.head,
            usage_json(usage)
        )
    }

    fn error(&self, failure: &Failure) -> String {
        let mut err = ApiError::from(failure.clone()).with_request_id(&self.id);
        err.failure.retry_after_secs = None;
        err.body().to_string()
    }

    /// The whole answer as one `chat.completion` or `text_completion`.
    fn document(&self, out: &Assembled, usage: &Usage, reason: &str) -> Value {
        let logprobs = out.logprobs().unwrap_or(Value::Null);
        match self.dialect {
            Dialect::Chat => {
                let calls = out.tool_calls();
                let mut message = json!({
                    "role": "assistant",
                    // OpenAI's shape: no text beside tool calls is `null`.
                    "content": if out.content.is_empty() && !calls.is_empty() {
                        Value::Null
                    } else {
                        Value::String(out.content.clone())
                    },
                    "refusal": null,
                });
                if let Some(m) = message.as_object_mut() {
                    if !calls.is_empty() {
                        m.insert("tool_calls".into(), json!(calls));
                    }
                    if !out.reasoning.is_empty() {
                        m.insert(
                            "reasoning_content".into(),
                            Value::String(out.reasoning.clone()),
                        );
                    }
                }
                json!({
                    "id": self.id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": FINGERPRINT,
                    "choices": [{
                        "index": 0,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    }],
                    "usage": usage_json(usage),
                })
            }
            Dialect::Completions => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": out.content,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }],
                "usage": usage_json(usage),
            }),
        }
    }
}

pub(super) fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// OpenAI's usage object; the prompt's cached tokens as the engine reported them.
pub(super) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens.unwrap_or(0), "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
        }
    })
}

/// The engine's finish reason as OpenAI clients know it: `stop`, `length`, `tool_calls`,
/// `content_filter`, `function_call` pass through; anything else (an engine's own word) is
/// `stop`.
fn finish_reason(u: &Usage) -> &str {
    match u.finish_reason.as_str() {
        r @ ("stop" | "length" | "tool_calls" | "content_filter" | "function_call") => r,
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
            if self.render.dialect == Dialect::Chat {
                self.pending.push_back(self.render.role());
            }
        }
    }

    fn finish(&mut self, usage: &Usage, reason: &str) {
        self.push_role();
        self.pending.push_back(self.render.finish(reason));
        if self.render.include_usage {
            self.pending.push_back(self.render.usage_chunk(usage));
        }
        self.pending.push_back("[DONE]".to_owned());
        self.ended = true;
    }

    fn push(&mut self, event: Option<GenEvent>) {
        match event {
            Some(GenEvent::Delta(piece)) => {
                self.push_role();
                self.pending.push_back(self.render.piece(&piece));
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

/// The events of a stream: a running generation's, a retained result's, or a journal's.
enum Source {
    Live(GenerationStream),
    Replay(std::vec::IntoIter<GenEvent>),
    Journal(Box<JournalSource>),
}

impl Source {
    async fn next(&mut self) -> Option<GenEvent> {
        match self {
            Self::Live(g) => g.next().await,
            Self::Replay(events) => events.next(),
            Self::Journal(j) => j.next().await,
        }
    }
}

fn sse_response(source: Source, render: Render) -> Response {
    sse_response_after(source, render, None)
}

/// The stream of `source`, leaving out the events numbered up to `skip_through` (what a
/// resuming client already has).
fn sse_response_after(source: Source, render: Render, skip_through: Option<u64>) -> Response {
    let ids = render.ids;
    let state = (source, Renderer::new(render), 0u64);
    let events = futures::stream::unfold(state, move |(mut source, mut r, mut n)| async move {
        loop {
            if let Some(data) = r.pending.pop_front() {
                let number = n;
                n += 1;
                if skip_through.is_some_and(|last| number <= last) {
                    continue;
                }
                let mut event = Event::default().data(data);
                if ids {
                    event = event.id(number.to_string());
                }
                return Some((Ok::<Event, Infallible>(event), (source, r, n)));
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

/// A retry of a running generation's Idempotency-Key with `stream: true`: its stream from
/// the journal, after the client's `Last-Event-ID` (numbered as the first response was),
/// followed live to its end. Its generation is told a reader came back.
pub async fn resume(
    state: &AppState,
    rec: &GenerationRecord,
    render: Render,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let last = last_event_id(headers)?;
    super::generations::reader_back(state, &rec.id).await;
    let source = Source::Journal(Box::new(JournalSource::new(state, &rec.id)));
    Ok(sse_response_after(source, render.resumable(), last))
}

/// The `Last-Event-ID` header: the number of the last event the client saw.
pub(super) fn last_event_id(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(value) = headers.get("last-event-id") else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                "`Last-Event-ID` must be the number of an event of this stream.",
            )
        })
}

/// Events per journal read.
const JOURNAL_PAGE: usize = 256;
/// How long one journal read waits for the next event before the record is looked at.
const JOURNAL_WAIT: Duration = Duration::from_secs(2);
/// Failed journal reads in a row before the stream gives up (interrupted: the client may
/// resume again).
const JOURNAL_FAILURES: u32 = 3;

/// A generation's events read back from its journal, from the first, following appends
/// until the terminal event. A generation that ended without journaling its end (its
/// replica stopped, the sweeper ended it) ends with what its record says; a hole in the
/// numbers (events past the journal's byte bound, or lost) ends it with
/// `result_unavailable`.
pub(super) struct JournalSource {
    /// Where the journal is (any replica's view of it).
    coordinator: Arc<dyn Coordinator>,
    /// Where the record is, for an end the journal never got.
    store: Arc<dyn Store>,
    /// The generation.
    id: String,
    /// Its journal's key.
    key: String,
    /// The number of the last event returned.
    after: Option<u64>,
    /// Read and not yet returned.
    buffered: VecDeque<(u64, GenEvent)>,
    /// Reads that found nothing while the record said the generation was over: after one
    /// such read (the writer's last batch had time to land), the record's end is given.
    idle_after_end: u32,
    /// Failed reads in a row.
    failures: u32,
    /// The terminal event (or the stream's end) was returned.
    ended: bool,
}

impl JournalSource {
    pub(super) fn new(state: &AppState, id: &str) -> Self {
        Self {
            coordinator: state.coordinator.clone(),
            store: state.store.clone(),
            id: id.to_owned(),
            key: journal_key(id),
            after: None,
            buffered: VecDeque::new(),
            idle_after_end: 0,
            failures: 0,
            ended: false,
        }
    }

    /// The next event; `None` after the last, or when the journal cannot be read (the
    /// stream then ends without a terminal event: interrupted).
    pub(super) async fn next(&mut self) -> Option<GenEvent> {
        loop {
            if let Some((seq, event)) = self.buffered.pop_front() {
                let expected = self.after.map_or(0, |a| a + 1);
                self.after = Some(seq);
                if seq != expected {
                    self.ended = true;
                    return Some(GenEvent::Failed(Failure::new(
                        ErrorCode::ResultUnavailable,
                        "Part of this generation's stream is no longer available; its retained output is at GET /v1/generations/{id}.",
                    )));
                }
                if !matches!(event, GenEvent::Delta(_)) {
                    self.ended = true;
                }
                return Some(event);
            }
            if self.ended {
                return None;
            }
            let read = read_journal(
                self.coordinator.as_ref(),
                &self.key,
                self.after,
                JOURNAL_PAGE,
                JOURNAL_WAIT,
            )
            .await;
            match read {
                Ok(events) if !events.is_empty() => {
                    self.failures = 0;
                    self.buffered.extend(events);
                }
                Ok(_) => {
                    self.failures = 0;
                    if let Some(end) = self.recorded_end().await {
                        self.ended = true;
                        return Some(end);
                    }
                }
                Err(e) => {
                    self.failures += 1;
                    tracing::warn!(generation_id = %self.id, error = %e, "could not read a generation's journal");
                    if self.failures >= JOURNAL_FAILURES {
                        self.ended = true;
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// The end the record holds, once the journal had time to deliver its own.
    async fn recorded_end(&mut self) -> Option<GenEvent> {
        let rec = self.store.get_generation(&self.id).await.ok()??;
        if !rec.status.is_terminal() && rec.status != Status::Rejected {
            return None;
        }
        self.idle_after_end += 1;
        (self.idle_after_end > 1).then(|| end_of_record(&rec))
    }
}

/// A terminal record's end as an event (without its output).
fn end_of_record(rec: &GenerationRecord) -> GenEvent {
    let usage = Usage {
        prompt_tokens: rec.input_tokens,
        completion_tokens: rec.output_tokens,
        finish_reason: rec.finish_reason.clone().unwrap_or_else(|| "stop".into()),
        cached_tokens: None,
    };
    match rec.status {
        Status::Completed => GenEvent::Finished(usage),
        Status::Cancelled => GenEvent::Cancelled(usage),
        _ => {
            let code = rec
                .error_code
                .as_deref()
                .and_then(ErrorCode::parse)
                .unwrap_or(ErrorCode::ModelBackendError);
            GenEvent::Failed(Failure::new(code, "This generation failed."))
        }
    }
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
    let mut out = Assembled::default();
    loop {
        let (usage, reason) = match source.next().await {
            Some(GenEvent::Delta(piece)) => {
                out.push(&piece);
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
        return Ok(axum::Json(render.document(&out, &usage, &reason)).into_response());
    }
}
