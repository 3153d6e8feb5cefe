//! The Generations API (SPEC section 5): `POST /v1/generations` (Idempotency-Key required),
//! `GET /v1/generations/{id}`, `GET /v1/generations/{id}/events` (resume),
//! `POST /v1/generations/{id}/cancel`. It runs the same pipeline as `/v1/chat/completions`
//! (see `lifecycle.rs`) and renders it as named SSE events with a `sequence` from 0 (also
//! their `id:`, which a client sends back as `Last-Event-ID` to resume), or as one JSON
//! document.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::events::{Journal, JournalSpec, journal_key};
use switchyard_actors::generation::{
    GenEvent, GenerationMsg, GenerationStream, Generations, Usage,
};
use switchyard_actors::lifecycle::{Event, GenerationRecord, Refusal};
use switchyard_actors::output::{Assembled, Piece};
use tracing::instrument;

use super::error::{ApiError, Json, Path};
use super::lifecycle::{self, Plan, Started};
use super::sse::{JournalSource, KEEP_ALIVE, last_event_id};
use crate::server::AppState;

/// Fields `POST /v1/generations` accepts; anything else is refused.
const FIELDS: [&str; 10] = [
    "model",
    "messages",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "tools",
    "tool_choice",
];

/// Fields passed to the engine as sent.
const PASSED: [&str; 6] = [
    "temperature",
    "top_p",
    "seed",
    "stop",
    "tools",
    "tool_choice",
];

/// The pub/sub channel on which a cancel reaches the replica running the generation.
pub const CANCEL_CHANNEL: &str = "generations:cancel";

/// The pub/sub channel on which a reader's return reaches the replica running the
/// generation ([`GenerationMsg::ClientBack`]).
pub const CLIENT_BACK_CHANNEL: &str = "generations:client_back";

/// Encoded bytes of one generation's journal at most (four times the retained output's
/// bound: the engine's deltas as sent, with logprobs, take more than their text).
const JOURNAL_MAX_BYTES: usize = 4 << 20;

/// `POST /v1/generations`.
#[instrument(skip_all, fields(generation_id, team_id, model))]
pub async fn create(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let id = format!("gen_{:024x}", rand::random::<u128>() >> 32);
    tracing::Span::current().record("generation_id", id.as_str());
    match submit(&state, &headers, body, &id).await {
        Ok(response) => response,
        Err(e) => e.with_request_id(&id).into_response(),
    }
}

async fn submit(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
    id: &str,
) -> Result<Response, ApiError> {
    let (plan, stream) = prepare(state, headers, body)
        .await
        .inspect_err(lifecycle::count_refusal)?;
    let model = plan.model.name.clone();
    match lifecycle::start(state, plan, id).await? {
        Started::Running {
            generation,
            id,
            rate,
        } => {
            let mut response = if stream {
                stream_events(generation, id.clone())
            } else {
                collect(generation, &id, &model).await?
            };
            rate.apply(response.headers_mut());
            Ok(response)
        }
        // A retry while it runs resumes its stream, as `GET …/events` does.
        Started::Existing(rec) if stream && !rec.status.is_terminal() => {
            let last = last_event_id(headers)?;
            reader_back(state, &rec.id).await;
            lifecycle::counted_replay(Ok(journal_stream(state, &rec.id, last)))
        }
        Started::Existing(rec) => lifecycle::counted_replay(replay(state, &rec, stream)),
    }
}

/// The journal of a resumable generation `id` (one with a record): kept while it runs and
/// for the result retention after it ends.
pub(super) fn journal(state: &AppState, id: &str) -> Journal {
    let timeouts = state.config.generation_timeouts();
    let retention = Duration::from_millis(u64::try_from(state.config.retention_ms()).unwrap_or(0));
    let spec = JournalSpec {
        key: journal_key(id),
        running_ttl: timeouts.total + timeouts.settle_wait + retention,
        retention,
        max_bytes: JOURNAL_MAX_BYTES,
    };
    Journal::spawn(state.coordinator.clone(), spec)
}

/// Tells the live generation `id` on this replica that a reader came back; false when it
/// does not run here.
pub fn client_back(generations: &Generations, id: &str) -> bool {
    generations
        .directory()
        .get(id)
        .is_some_and(|g| g.cast(GenerationMsg::ClientBack).is_ok())
}

/// A reader came back to `id`: its generation is told, here or through the replica that
/// runs it.
pub(super) async fn reader_back(state: &AppState, id: &str) {
    if !client_back(&state.generations, id)
        && let Err(e) = state
            .coordinator
            .publish(CLIENT_BACK_CHANNEL, id.as_bytes().to_vec())
            .await
    {
        tracing::warn!(generation_id = %id, error = %e, "could not publish a reader's return");
    }
}

/// `GET /v1/generations/{id}/events`: the generation's events after `Last-Event-ID` (from
/// the first without it), each once, in order, followed live to the end. A finished
/// generation whose journal expired is answered from its record as a retry is (without
/// `Last-Event-ID`), or 410 `result_unavailable` (with it: the numbers no longer mean
/// anything).
pub async fn events(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let answer = async {
        let rec = owned(&state, &headers, &id).await?;
        let last = last_event_id(&headers)?;
        if !rec.status.is_terminal() {
            reader_back(&state, &rec.id).await;
            return Ok(journal_stream(&state, &rec.id, last));
        }
        let journaled = state
            .coordinator
            .read_events(&journal_key(&rec.id), None, 1, Duration::ZERO)
            .await
            .map_err(|_| {
                ApiError::unavailable("The generation's events cannot be read right now.")
            })?;
        match (journaled.is_empty(), last) {
            (false, _) => Ok(journal_stream(&state, &rec.id, last)),
            (true, None) => replay(&state, &rec, true),
            (true, Some(_)) => Err(lifecycle::expired(&rec)),
        }
    };
    match answer.await {
        Ok(response) => response,
        Err(e) => e.with_request_id(&id).into_response(),
    }
}

/// The generation's stream rebuilt from its journal, numbered exactly as its first response
/// was (`generation.created` is 0), leaving out what the client has (through `last`).
fn journal_stream(state: &AppState, id: &str, last: Option<u64>) -> Response {
    let mut seq = Sequencer {
        id: id.to_owned(),
        next: 0,
        partial: false,
    };
    let pending = std::collections::VecDeque::from([(0, seq.created("queued"))]);
    let source = JournalSource::new(state, id);
    let state = (Some(source), seq, pending);
    let events = futures::stream::unfold(
        state,
        move |(mut source, mut seq, mut pending)| async move {
            loop {
                if let Some((number, event)) = pending.pop_front() {
                    if last.is_some_and(|l| number <= l) {
                        continue;
                    }
                    return Some((event, (source, seq, pending)));
                }
                let s = source.as_mut()?;
                let first = seq.next;
                let (events, end) = seq.render(s.next().await);
                pending.extend((first..).zip(events));
                if end {
                    source = None;
                }
            }
        },
    );
    sse(events)
}

/// Credential, Idempotency-Key, SSRF guard, body and allowlist: the request as a [`Plan`].
async fn prepare(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
) -> Result<(Plan, bool), ApiError> {
    let principal = state.auth.authenticate(headers).await?;
    tracing::Span::current().record("team_id", principal.team_id);
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let key = lifecycle::idempotency_key(headers)?
        .ok_or_else(|| bad("The `Idempotency-Key` header is required."))?;
    super::ssrf::guard(&body)?;
    let Value::Object(obj) = body else {
        return Err(bad("The body must be a JSON object."));
    };
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(&format!("Unknown field `{unknown}`.")));
    }
    let model = lifecycle::resolve_model(state, &obj)?;
    tracing::Span::current().record("model", model.name.as_str());
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty array."))?;
    for m in messages {
        let role = m.get("role").and_then(Value::as_str);
        let content = m.get("content").and_then(Value::as_str);
        // An assistant turn that called tools may carry no text.
        let calls = m.get("tool_calls").is_some_and(Value::is_array);
        if role.is_none() || (content.is_none() && !calls) {
            return Err(bad(
                "Every message needs a string `role` and a string `content` (or `tool_calls`).",
            )
            .with_param("messages"));
        }
    }
    for field in ["tools", "tool_choice"] {
        let ok = match (field, obj.get(field)) {
            (_, None | Some(Value::Null)) => true,
            ("tools", Some(v)) => v.is_array(),
            (_, Some(v)) => v.is_string() || v.is_object(),
        };
        if !ok {
            return Err(bad(&format!("`{field}` has the wrong type.")).with_param(field));
        }
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`stream` must be a boolean.").with_param("stream")),
    };
    let max_tokens = match obj.get("max_output_tokens") {
        None | Some(Value::Null) => u64::from(model.default_max_tokens),
        Some(v) => {
            let n = v.as_u64().unwrap_or(0);
            lifecycle::check_max_tokens(&model, "max_output_tokens", n)?
        }
    };
    if !super::openai::allowed(state, &principal, &model) {
        return Err(ApiError::new(
            ErrorCode::ModelNotAllowed,
            "This key may not use that model.",
        ));
    }
    // The fingerprint covers the semantic inputs as sent (the model as named), not the
    // response mode.
    let mut semantic = obj.clone();
    semantic.remove("stream");
    let fingerprint = lifecycle::fingerprint(&Value::Object(semantic));
    let mut engine = Map::new();
    engine.insert("model".into(), Value::String(model.name.clone()));
    engine.insert("messages".into(), Value::Array(messages.clone()));
    engine.insert("max_tokens".into(), Value::from(max_tokens));
    for field in PASSED {
        if let Some(v) = obj.get(field) {
            engine.insert(field.into(), v.clone());
        }
    }
    let plan = Plan {
        principal,
        model,
        engine_body: Value::Object(engine),
        max_tokens,
        idempotency: Some((key, fingerprint)),
        prompt: lifecycle::Prompt::Chat,
        x_request_id: lifecycle::client_request_id(),
        traceparent: lifecycle::traceparent(headers),
    };
    Ok((plan, stream))
}

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

/// Numbers a generation's events from 0 and names them.
struct Sequencer {
    id: String,
    next: u64,
    partial: bool,
}

impl Sequencer {
    /// The event `name` with the next number, as `sequence` and as the SSE `id:` (what a
    /// client sends back as `Last-Event-ID`).
    fn event(&mut self, name: &'static str, mut data: Map<String, Value>) -> SseEvent {
        let number = self.next;
        data.insert("generation_id".into(), Value::String(self.id.clone()));
        data.insert("sequence".into(), Value::from(number));
        self.next += 1;
        SseEvent::default()
            .event(name)
            .id(number.to_string())
            .data(Value::Object(data).to_string())
    }

    fn created(&mut self, status: &str) -> SseEvent {
        let mut data = Map::new();
        data.insert("status".into(), Value::String(status.into()));
        self.event("generation.created", data)
    }

    /// The SSE events for `event`, and whether it ends the stream. A piece of output is a
    /// typed event per kind: `generation.reasoning.delta`, `generation.text.delta`, and a
    /// `generation.tool_call.delta` per tool call fragment.
    fn render(&mut self, event: Option<GenEvent>) -> (Vec<SseEvent>, bool) {
        let mut data = Map::new();
        match event {
            Some(GenEvent::Delta(piece)) => (self.pieces(piece), false),
            Some(GenEvent::Finished(usage)) => {
                data.insert("usage".into(), usage_json(&usage));
                if usage.finish_reason != "stop" {
                    data.insert(
                        "finish_reason".into(),
                        Value::String(usage.finish_reason.clone()),
                    );
                }
                (vec![self.event("generation.completed", data)], true)
            }
            Some(GenEvent::Cancelled(usage)) => {
                data.insert("usage".into(), usage_json(&usage));
                (vec![self.event("generation.cancelled", data)], true)
            }
            Some(GenEvent::Failed(failure)) => (vec![self.error(&failure)], true),
            None => {
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation ended unexpectedly.",
                );
                (vec![self.error(&failure)], true)
            }
        }
    }

    fn pieces(&mut self, piece: Piece) -> Vec<SseEvent> {
        self.partial = true;
        let mut events = Vec::new();
        if !piece.reasoning.is_empty() {
            let mut data = Map::new();
            data.insert("delta".into(), Value::String(piece.reasoning));
            events.push(self.event("generation.reasoning.delta", data));
        }
        if !piece.text.is_empty() {
            let mut data = Map::new();
            data.insert("index".into(), Value::from(0));
            data.insert("delta".into(), Value::String(piece.text));
            events.push(self.event("generation.text.delta", data));
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
            events.push(self.event("generation.tool_call.delta", data));
        }
        events
    }

    fn error(&mut self, failure: &Failure) -> SseEvent {
        let mut data = Map::new();
        data.insert("code".into(), Value::String(failure.code.as_str().into()));
        data.insert("message".into(), Value::String(failure.message.clone()));
        data.insert(
            "action".into(),
            Value::String(action(failure.code, self.partial).into()),
        );
        data.insert("partial".into(), Value::Bool(self.partial));
        self.event("generation.error", data)
    }
}

fn sse(events: impl futures::Stream<Item = SseEvent> + Send + 'static) -> Response {
    use futures::StreamExt;
    let mut response = Sse::new(events.map(Ok::<SseEvent, Infallible>))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"))
        .into_response();
    response
        .headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-store"));
    response
}

/// A running generation as named SSE events.
fn stream_events(generation: GenerationStream, id: String) -> Response {
    let mut seq = Sequencer {
        id,
        next: 0,
        partial: false,
    };
    let pending = std::collections::VecDeque::from([seq.created("queued")]);
    let state = (Some(generation), seq, pending);
    let events =
        futures::stream::unfold(state, |(mut generation, mut seq, mut pending)| async move {
            loop {
                if let Some(event) = pending.pop_front() {
                    return Some((event, (generation, seq, pending)));
                }
                let g = generation.as_mut()?;
                let (events, last) = seq.render(g.next().await);
                pending.extend(events);
                if last {
                    generation = None;
                }
            }
        });
    sse(events)
}

/// A running generation collected into one document, or its error.
async fn collect(
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
fn document(rec: &GenerationRecord, with_output: bool) -> Value {
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

/// A repeated key: the existing generation, never rerun.
fn replay(state: &AppState, rec: &GenerationRecord, stream: bool) -> Result<Response, ApiError> {
    let (out, end) = lifecycle::replayable(state, rec)?;
    if !stream {
        return Ok(axum::Json(document(rec, true)).into_response());
    }
    let mut seq = Sequencer {
        id: rec.id.clone(),
        next: 0,
        partial: false,
    };
    let mut events = vec![seq.created(rec.status.as_str())];
    if out != Assembled::default() {
        events.extend(seq.render(Some(GenEvent::Delta(out.into_piece()))).0);
    }
    events.extend(seq.render(Some(end)).0);
    Ok(sse(futures::stream::iter(events)))
}

/// The caller's own generation `id`; anyone else's is `not_found`.
async fn owned(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
) -> Result<GenerationRecord, ApiError> {
    let principal = state.auth.authenticate(headers).await?;
    let not_found = || ApiError::new(ErrorCode::NotFound, "No such generation.");
    let rec = state
        .store
        .get_generation(id)
        .await
        .map_err(|_| ApiError::unavailable("Generations cannot be read right now."))?
        .ok_or_else(not_found)?;
    if rec.subject != principal.subject {
        return Err(not_found());
    }
    Ok(rec)
}

/// `GET /v1/generations/{id}`.
pub async fn get(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let rec = match owned(&state, &headers, &id).await {
        Ok(rec) => rec,
        Err(e) => return e.into_response(),
    };
    let now = state.clock.wall().timestamp_millis();
    if rec.status.is_terminal() && !lifecycle::retained(&state, &rec, now) {
        return lifecycle::expired(&rec).into_response();
    }
    axum::Json(document(&rec, true)).into_response()
}

/// `POST /v1/generations/{id}/cancel`: 202 `cancel_requested` while it runs; the status
/// becomes `cancelled` once the node confirms or the attempt is fenced. A finished
/// generation keeps its state (200).
pub async fn cancel(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let rec = match owned(&state, &headers, &id).await {
        Ok(rec) => rec,
        Err(e) => return e.into_response(),
    };
    let now = state.clock.wall().timestamp_millis();
    let applied = match state
        .store
        .apply_generation(&rec.id, &Event::RequestCancel, now)
        .await
    {
        Ok(a) => a,
        Err(_) => {
            return ApiError::unavailable("The cancel could not be recorded; try again.")
                .into_response();
        }
    };
    match applied.result {
        Ok(_) => {
            // The replica running it stops it; another replica hears of it over pub/sub.
            if !state.generations.cancel(&rec.id)
                && let Err(e) = state
                    .coordinator
                    .publish(CANCEL_CHANNEL, rec.id.clone().into_bytes())
                    .await
            {
                tracing::warn!(generation_id = %rec.id, error = %e, "could not publish a cancel");
            }
            let body = json!({"id": rec.id, "status": "cancel_requested"});
            (StatusCode::ACCEPTED, axum::Json(body)).into_response()
        }
        Err(Refusal::Final) => axum::Json(document(&applied.record, false)).into_response(),
        Err(_) => (
            StatusCode::ACCEPTED,
            axum::Json(document(&applied.record, false)),
        )
            .into_response(),
    }
}
