//! How a generation is shown by the Generations API: named SSE events numbered from 0
//! (`generation.created`, typed deltas, one end event), one JSON document, and the record
//! as `GET /v1/generations/{id}` returns it.

use std::task::{Context, Poll, ready};

use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::{GenEvent, GenerationStream, Usage};
use switchyard_actors::lifecycle::GenerationRecord;
use switchyard_actors::output::{Assembled, Piece};

use super::super::error::ApiError;
use super::super::lifecycle;
use super::super::sse::{self, JournalRead, JournalSource, Source, SseEvents, SseText, Step};
use crate::server::AppState;

/// What to tell the client to do after a failure once the stream has begun: capacity
/// refusals happened before anything ran (the record is `rejected`), so the same key may be
/// sent again; anything after a node took the work is final, and a new answer needs a new key.
fn action(code: ErrorCode, partial: bool) -> &'static str {
    use ErrorCode::*;
    match code {
        _ if partial => "manual_regenerate",
        QueueFull | CapacityExhausted | NoHealthyNode | ModelLoading | QuotaServiceUnavailable => {
            "retry"
        }
        InvalidRequest | ContextLengthExceeded => "none",
        _ => "manual_regenerate",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens})
}

/// Numbers a generation's events from 0 and names them, writing them as SSE text.
struct Sequencer {
    /// The generation every event names.
    id: String,
    /// The next event's `sequence`: a client resumes and orders by it.
    next: u64,
    /// Output was sent: a failure after it cannot be retried under the same key.
    partial: bool,
    /// Events numbered up to this one are not written (a resuming client has them).
    skip_through: Option<u64>,
    /// The client's `Last-Event-ID` was beyond the stream's terminal event.
    past_end: bool,
}

impl Sequencer {
    fn new(id: String, skip_through: Option<u64>) -> Self {
        Self {
            id,
            next: 0,
            partial: false,
            skip_through,
            past_end: false,
        }
    }

    /// Before the terminal event: a client that says it has events past it (it has numbers
    /// the stream never had) gets the terminal event anyway, since a stream ending without
    /// one tells a client to resume again, forever.
    fn ending(&mut self) {
        if self.skip_through.is_some_and(|last| last > self.next) {
            self.past_end = true;
            self.skip_through = None;
        }
    }

    /// The event `name` with the next number, as `sequence` and as the SSE `id:` (what a
    /// client sends back as `Last-Event-ID`).
    fn event(&mut self, out: &mut SseText, name: &'static str, mut data: Map<String, Value>) {
        let number = self.next;
        self.next += 1;
        if self.skip_through.is_some_and(|last| number <= last) {
            return;
        }
        data.insert("generation_id".into(), Value::String(self.id.clone()));
        data.insert("sequence".into(), Value::from(number));
        out.field("event", name);
        out.id(number);
        out.data(|buf| {
            let _ = serde_json::to_writer(bytes::BufMut::writer(buf), &data);
        });
        out.end();
    }

    fn created(&mut self, out: &mut SseText, status: &str) {
        let mut data = Map::new();
        data.insert("status".into(), Value::String(status.into()));
        self.event(out, "generation.created", data);
    }

    /// Writes the SSE events for `event`; true when it ends the stream. A piece of output is
    /// a typed event per kind: `generation.reasoning.delta`, `generation.text.delta`, and a
    /// `generation.tool_call.delta` per tool call fragment.
    fn render(&mut self, out: &mut SseText, event: Option<GenEvent>) -> bool {
        let mut data = Map::new();
        if !matches!(event, Some(GenEvent::Delta(_))) {
            self.ending();
        }
        match event {
            Some(GenEvent::Delta(piece)) => {
                self.pieces(out, piece);
                false
            }
            Some(GenEvent::Finished(usage)) => {
                data.insert("usage".into(), usage_json(&usage));
                if usage.finish_reason != "stop" {
                    data.insert(
                        "finish_reason".into(),
                        Value::String(usage.finish_reason.clone()),
                    );
                }
                self.event(out, "generation.completed", data);
                true
            }
            Some(GenEvent::Cancelled(usage)) => {
                data.insert("usage".into(), usage_json(&usage));
                self.event(out, "generation.cancelled", data);
                true
            }
            Some(GenEvent::Failed(failure)) => {
                self.error(out, &failure);
                true
            }
            None => {
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                );
                self.error(out, &failure);
                true
            }
        }
    }

    fn pieces(&mut self, out: &mut SseText, piece: Piece) {
        self.partial = true;
        if !piece.reasoning.is_empty() {
            let mut data = Map::new();
            data.insert("delta".into(), Value::String(piece.reasoning));
            self.event(out, "generation.reasoning.delta", data);
        }
        if !piece.text.is_empty() {
            let mut data = Map::new();
            data.insert("index".into(), Value::from(0));
            data.insert("delta".into(), Value::String(piece.text));
            self.event(out, "generation.text.delta", data);
        }
        for call in piece.tool_calls {
            let mut data = Map::new();
            data.insert("tool_call_index".into(), Value::from(call.index));
            if let Some(id) = call.id {
                data.insert("id".into(), Value::String(id));
            }
            let function = call.function.unwrap_or_default();
            if let Some(name) = function.name {
                data.insert("name".into(), Value::String(name));
            }
            data.insert(
                "arguments_delta".into(),
                Value::String(function.arguments.unwrap_or_default()),
            );
            self.event(out, "generation.tool_call.delta", data);
        }
    }

    fn error(&mut self, out: &mut SseText, failure: &Failure) {
        let mut data = Map::new();
        data.insert("code".into(), Value::String(failure.code.as_str().into()));
        data.insert("message".into(), Value::String(failure.message.clone()));
        data.insert(
            "action".into(),
            Value::String(action(failure.code, self.partial).into()),
        );
        data.insert("partial".into(), Value::Bool(self.partial));
        self.event(out, "generation.error", data);
    }
}

/// A generation's events as named SSE events: `generation.created` (with `status`), then
/// every event of `source` until the end, all that are ready going out in one write.
struct NamedEvents {
    source: Source,
    seq: Sequencer,
    /// `generation.created`'s status, until it is written.
    created: Option<String>,
    ended: bool,
}

impl SseEvents for NamedEvents {
    fn poll_write(&mut self, cx: &mut Context<'_>, out: &mut SseText) -> Poll<Step> {
        if let Some(status) = self.created.take() {
            self.seq.created(out, &status);
            return Poll::Ready(Step::More);
        }
        if self.ended {
            return Poll::Ready(Step::End);
        }
        let event = ready!(self.source.poll_next(cx));
        self.ended = self.seq.render(out, event);
        Poll::Ready(if self.ended { Step::End } else { Step::More })
    }
}

fn sse(source: Source, seq: Sequencer, created: &str) -> Response {
    no_store(sse::response(NamedEvents {
        source,
        seq,
        created: Some(created.to_owned()),
        ended: false,
    }))
}

fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-store"));
    response
}

/// A running generation as named SSE events.
pub(super) fn stream_events(generation: GenerationStream, id: String) -> Response {
    sse(Source::Live(generation), Sequencer::new(id, None), "queued")
}

/// A running generation collected into one document, or its error.
pub(super) async fn collect(
    mut generation: GenerationStream,
    id: &str,
    model: &str,
) -> Result<Response, ApiError> {
    let mut out = Assembled::default();
    loop {
        let (status, usage) = match generation.next().await {
            Some(GenEvent::Delta(piece)) => {
                out.push(&piece);
                continue;
            }
            Some(GenEvent::Finished(u)) => ("completed", u),
            Some(GenEvent::Cancelled(u)) => ("cancelled", u),
            Some(GenEvent::Failed(failure)) => {
                let mut err = ApiError::from(failure);
                err.details = Some(Box::new(
                    json!({"generation_id": id, "partial": out != Assembled::default()}),
                ));
                return Err(err);
            }
            None => {
                return Err(ApiError::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                ));
            }
        };
        let body = json!({
            "id": id,
            "status": status,
            "model": model,
            "output": output_items(&out),
            "usage": usage_json(&usage),
        });
        return Ok(axum::Json(body).into_response());
    }
}

/// The output as the API lists it: the reasoning, the text, then each tool call.
fn output_items(out: &Assembled) -> Value {
    let mut items = Vec::new();
    if !out.reasoning.is_empty() {
        items.push(json!({"type": "reasoning", "text": out.reasoning}));
    }
    if !out.content.is_empty() || out.tool_calls.is_empty() {
        items.push(json!({"type": "text", "text": out.content}));
    }
    for call in out.tool_calls() {
        items.push(json!({
            "type": "tool_call",
            "id": call.id,
            "name": call.function.name,
            "arguments": call.function.arguments,
        }));
    }
    Value::Array(items)
}

/// The record as the API shows it.
pub(super) fn document(rec: &GenerationRecord, with_output: bool) -> Value {
    let mut doc = json!({
        "id": rec.id,
        "status": rec.api_status(),
        "model": rec.model,
    });
    if let Some(obj) = doc.as_object_mut() {
        if rec.status.is_terminal() {
            obj.insert(
                "usage".into(),
                json!({"input_tokens": rec.input_tokens, "output_tokens": rec.output_tokens}),
            );
        }
        if with_output && rec.status.is_terminal() {
            let out = lifecycle::retained_output(rec);
            obj.insert("output".into(), output_items(&out));
        }
        if let Some(code) = &rec.error_code {
            obj.insert("error".into(), json!({ "code": code }));
        }
    }
    doc
}

/// A repeated key's answer as events: `generation.created` with the record's status, its
/// retained output, and its end.
pub(super) fn replayed(rec: &GenerationRecord, out: Assembled, end: GenEvent) -> Response {
    let mut events = Vec::new();
    if out != Assembled::default() {
        events.push(GenEvent::Delta(out.into_piece()));
    }
    events.push(end);
    sse(
        Source::Replay(events.into_iter()),
        Sequencer::new(rec.id.clone(), None),
        rec.status.as_str(),
    )
}

/// The generation's stream rebuilt from its journal, numbered exactly as its first response
/// was (`generation.created` is 0), leaving out what the client has (through `last`).
pub(super) fn journal_stream(state: &AppState, id: &str, last: Option<u64>) -> Response {
    let source = Source::Journal(JournalRead::new(JournalSource::new(state, id)));
    sse(source, Sequencer::new(id.to_owned(), last), "queued")
}

/// A finished generation's stream from its journal after `last`, or 400 `invalid_request`
/// when `last` is past its terminal event: its whole journal is there (it ended), so what is
/// left is known before the response starts.
pub(super) async fn finished_journal_stream(
    state: &AppState,
    id: &str,
    last: u64,
) -> Result<Response, ApiError> {
    let source = Source::Journal(JournalRead::new(JournalSource::new(state, id)));
    let primed = sse::Primed::new(NamedEvents {
        source,
        seq: Sequencer::new(id.to_owned(), Some(last)),
        created: Some("queued".to_owned()),
        ended: false,
    })
    .await;
    if primed.events.seq.past_end {
        let end = primed.events.seq.next.saturating_sub(1);
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "`Last-Event-ID` {last} is past the end of this generation's events: its last event is {end}, and the stream is complete."
            ),
        )
        .with_param("Last-Event-ID"));
    }
    Ok(no_store(primed.response()))
}
