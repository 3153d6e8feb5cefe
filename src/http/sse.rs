//! Renders a generation's events in OpenAI's shapes: `chat.completion.chunk` SSE events
//! (role chunk, content chunks, finish chunk, the usage chunk when asked, `[DONE]`), or one
//! `chat.completion`. Events are rendered straight into the response's buffer, and all those
//! ready when the socket can take more go out in one write ([`body`]): a reader that is
//! behind gets many tokens per write. `: keep-alive` comments flow while the request waits
//! for a node. A
//! failure after the headers becomes `data: {"error": …}` and the stream ends without
//! `[DONE]`. The response stream owns the [`GenerationStream`]: when the client leaves, it
//! is dropped and the generation is told. A resumable generation's stream numbers its
//! events (`id:`), and [`resume`] replays it from its journal after the client's
//! `Last-Event-ID`, following it live.

mod body;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, BytesMut};
use serde_json::{Value, json};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::events::{journal_key, read_journal};
use switchyard_actors::generation::{GenEvent, GenerationStream, Usage};
use switchyard_actors::lifecycle::{GenerationRecord, Status};
use switchyard_actors::output::{Assembled, Piece};
use switchyard_actors::ports::Coordinator;
use switchyard_actors::tier::Tier;

use super::error::ApiError;
use crate::server::AppState;
use crate::store::Store;
pub(super) use body::{Primed, SseEvents, SseText, Step, response};

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
    /// The `service_tier` it ran at, echoed in every chunk and document.
    tier: Option<Tier>,
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
            tier: None,
        }
    }

    /// Echoes `tier` as `service_tier` in every chunk and in the document, as OpenAI does.
    pub fn tier(mut self, tier: Tier) -> Self {
        self.tier = Some(tier);
        // Every chunk's head ends with `,`: the field goes right before the choices.
        self.head
            .push_str(&format!(r#""service_tier":"{}","#, tier.as_str()));
        self
    }

    /// Numbers each SSE event (`id:`), so the client can resume after the last it saw.
    pub fn resumable(mut self) -> Self {
        self.ids = true;
        self
    }

    /// One chunk around the choice that `choice` writes (a JSON object).
    fn chunk(&self, out: &mut BytesMut, choice: impl FnOnce(&mut BytesMut)) {
        out.put_slice(self.head.as_bytes());
        out.put_slice(br#""choices":["#);
        choice(out);
        out.put_slice(if self.include_usage {
            br#"],"usage":null}"#
        } else {
            b"]}"
        });
    }

    /// The chunk of one piece of output: the engine's delta and logprobs as it sent them,
    /// copied between fixed bytes.
    fn piece(&self, piece: &Piece, out: &mut BytesMut) {
        let logprobs = piece.logprobs.as_ref().map_or("null", |l| l.get());
        let tail = |out: &mut BytesMut| {
            out.put_slice(br#","logprobs":"#);
            out.put_slice(logprobs.as_bytes());
            out.put_slice(br#","finish_reason":null}"#);
        };
        match (self.dialect, &piece.raw) {
            (Dialect::Chat, Some(raw)) => self.chunk(out, |out| {
                out.put_slice(br#"{"index":0,"delta":"#);
                out.put_slice(raw.get().as_bytes());
                tail(out);
            }),
            (Dialect::Chat, None) if piece.tool_calls.is_empty() && piece.reasoning.is_empty() => {
                self.chunk(out, |out| {
                    out.put_slice(br#"{"index":0,"delta":{"content":"#);
                    write_json(out, &piece.text);
                    out.put_u8(b'}');
                    tail(out);
                })
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
                self.chunk(out, |out| {
                    out.put_slice(br#"{"index":0,"delta":"#);
                    write_json(out, &delta);
                    tail(out);
                })
            }
            (Dialect::Completions, _) => self.chunk(out, |out| {
                out.put_slice(br#"{"index":0,"text":"#);
                write_json(out, &piece.text);
                tail(out);
            }),
        }
    }

    fn role(&self, out: &mut BytesMut) {
        self.chunk(out, |out| out.put_slice(br#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#));
    }

    fn finish(&self, reason: &str, out: &mut BytesMut) {
        self.chunk(out, |out| {
            out.put_slice(match self.dialect {
                Dialect::Chat => br#"{"index":0,"delta":{},"logprobs":null,"finish_reason":"#,
                Dialect::Completions => br#"{"index":0,"text":"","logprobs":null,"finish_reason":"#,
            });
            write_json(out, reason);
            out.put_u8(b'}');
        });
    }

    fn usage_chunk(&self, usage: &Usage, out: &mut BytesMut) {
        out.put_slice(self.head.as_bytes());
        out.put_slice(br#""choices":[],"usage":"#);
        write_json(out, &usage_json(usage));
        out.put_u8(b'}');
    }

    fn error(&self, failure: &Failure, out: &mut BytesMut) {
        let mut err = ApiError::from(failure.clone()).with_request_id(&self.id);
        err.failure.retry_after_secs = None;
        write_json(out, &err.body());
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
                    "service_tier": self.tier,
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
                "service_tier": self.tier,
            }),
        }
    }
}

pub(super) fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `value` as JSON at the end of `out` (writing to memory cannot fail, and these values
/// have no maps with non-string keys).
fn write_json<T: serde::Serialize + ?Sized>(out: &mut BytesMut, value: &T) {
    let _ = serde_json::to_writer(out.writer(), value);
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

/// Writes a stream's events as SSE `data:` payloads, numbered from 0 (`id:` when the stream
/// is resumable), leaving out those a resuming client already has.
struct Renderer {
    render: Render,
    sent_role: bool,
    ended: bool,
    /// The next payload's number.
    next: u64,
    /// Payloads numbered up to this one are not written (the client has them).
    skip_through: Option<u64>,
}

impl Renderer {
    fn new(render: Render, skip_through: Option<u64>) -> Self {
        Self {
            render,
            sent_role: false,
            ended: false,
            next: 0,
            skip_through,
        }
    }

    /// One numbered payload, written by `write` unless the client has it.
    fn emit(&mut self, out: &mut SseText, write: impl FnOnce(&Render, &mut BytesMut)) {
        let number = self.next;
        self.next += 1;
        if self.skip_through.is_some_and(|last| number <= last) {
            return;
        }
        out.data(|buf| write(&self.render, buf));
        if self.render.ids {
            out.id(number);
        }
        out.end();
    }

    fn push_role(&mut self, out: &mut SseText) {
        if !self.sent_role {
            self.sent_role = true;
            if self.render.dialect == Dialect::Chat {
                self.emit(out, Render::role);
            }
        }
    }

    fn finish(&mut self, usage: &Usage, reason: &str, out: &mut SseText) {
        self.push_role(out);
        self.emit(out, |r, buf| r.finish(reason, buf));
        if self.render.include_usage {
            self.emit(out, |r, buf| r.usage_chunk(usage, buf));
        }
        self.ending();
        self.emit(out, |_, buf| buf.put_slice(b"[DONE]"));
        self.ended = true;
    }

    /// Before the last payload (`[DONE]` or the error): a resuming client that says it has
    /// payloads past it (numbers the stream never had) gets it anyway, since a stream ending
    /// without it tells the client to resume again, forever.
    fn ending(&mut self) {
        if self.skip_through.is_some_and(|last| last > self.next) {
            self.skip_through = None;
        }
    }

    fn fail(&mut self, failure: &Failure, out: &mut SseText) {
        self.ending();
        self.emit(out, |r, buf| r.error(failure, buf));
        self.ended = true;
    }

    fn push(&mut self, event: Option<GenEvent>, out: &mut SseText) {
        match event {
            Some(GenEvent::Delta(piece)) => {
                self.push_role(out);
                self.emit(out, |r, buf| r.piece(&piece, buf));
            }
            Some(GenEvent::Finished(usage)) => self.finish(&usage, finish_reason(&usage), out),
            Some(GenEvent::Cancelled(usage)) => self.finish(&usage, CANCELLED, out),
            Some(GenEvent::Failed(failure)) => self.fail(&failure, out),
            None => {
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                );
                self.fail(&failure, out);
            }
        }
    }
}

/// The events of a stream: a running generation's, a retained result's, or a journal's.
pub(super) enum Source {
    Live(GenerationStream),
    Replay(std::vec::IntoIter<GenEvent>),
    Journal(JournalRead),
}

impl Source {
    /// The next event if one is ready; otherwise the waker is registered.
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        match self {
            // A fresh receive per poll: dropping a pending one loses nothing (the channel's
            // receive is cancel-safe) and keeps the waker registered.
            Self::Live(g) => std::pin::pin!(g.next()).poll(cx),
            Self::Replay(events) => Poll::Ready(events.next()),
            Self::Journal(j) => j.poll_next(cx),
        }
    }

    async fn next(&mut self) -> Option<GenEvent> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }
}

/// A chat or legacy completion stream as SSE: every event ready when the socket can take
/// more is rendered into the same write.
struct ChatEvents {
    source: Source,
    renderer: Renderer,
}

impl SseEvents for ChatEvents {
    fn poll_write(&mut self, cx: &mut Context<'_>, out: &mut SseText) -> Poll<Step> {
        if self.renderer.ended {
            return Poll::Ready(Step::End);
        }
        let event = ready!(self.source.poll_next(cx));
        self.renderer.push(event, out);
        Poll::Ready(if self.renderer.ended {
            Step::End
        } else {
            Step::More
        })
    }
}

fn sse_response(source: Source, render: Render) -> Response {
    sse_response_after(source, render, None)
}

/// The stream of `source`, leaving out the events numbered up to `skip_through` (what a
/// resuming client already has).
fn sse_response_after(source: Source, render: Render, skip_through: Option<u64>) -> Response {
    body::response(ChatEvents {
        source,
        renderer: Renderer::new(render, skip_through),
    })
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
    let source = Source::Journal(JournalRead::new(JournalSource::new(state, &rec.id)));
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
            if let Some(known) = self.known() {
                return known;
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

    /// The next event when it is known without a read: one already read, or the end.
    fn known(&mut self) -> Option<Option<GenEvent>> {
        let Some((seq, event)) = self.buffered.pop_front() else {
            return self.ended.then_some(None);
        };
        let expected = self.after.map_or(0, |a| a + 1);
        self.after = Some(seq);
        if seq != expected {
            self.ended = true;
            return Some(Some(GenEvent::Failed(Failure::new(
                ErrorCode::ResultUnavailable,
                "Part of this generation's stream is no longer available; its retained output is at GET /v1/generations/{id}.",
            ))));
        }
        if !matches!(event, GenEvent::Delta(_)) {
            self.ended = true;
        }
        Some(Some(event))
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

/// A [`JournalSource`] read by polling: events already read come at once; a read that
/// waits on the coordinator is kept across polls (never dropped half way).
pub(super) struct JournalRead {
    /// The source, between reads.
    idle: Option<Box<JournalSource>>,
    /// The read under way, which hands the source back with its event.
    reading: Option<JournalNext>,
}

type JournalNext = Pin<Box<dyn Future<Output = (Box<JournalSource>, Option<GenEvent>)> + Send>>;

impl JournalRead {
    pub(super) fn new(source: JournalSource) -> Self {
        Self {
            idle: Some(Box::new(source)),
            reading: None,
        }
    }

    /// The next event if one is ready; otherwise the waker is registered.
    pub(super) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        if let Some(mut source) = self.idle.take() {
            if let Some(known) = source.known() {
                self.idle = Some(source);
                return Poll::Ready(known);
            }
            self.reading = Some(Box::pin(async move {
                let event = source.next().await;
                (source, event)
            }));
        }
        let Some(read) = &mut self.reading else {
            return Poll::Ready(None);
        };
        let (source, event) = ready!(read.as_mut().poll(cx));
        self.reading = None;
        self.idle = Some(source);
        Poll::Ready(event)
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

#[cfg(test)]
mod tests;
