//! The Generations API (SPEC section 5): `POST /v1/generations` (Idempotency-Key required),
//! `GET /v1/generations/{id}`, `GET /v1/generations/{id}/events` (resume),
//! `POST /v1/generations/{id}/cancel`. It runs the same pipeline as `/v1/chat/completions`
//! (see `lifecycle.rs`) and renders it as named SSE events with a `sequence` from 0 (also
//! their `id:`, which a client sends back as `Last-Event-ID` to resume), or as one JSON
//! document.

mod render;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use switchyard_actors::error::ErrorCode;
use switchyard_actors::generation::events::journal_key;
use switchyard_actors::generation::{GenerationMsg, Generations};
use switchyard_actors::lifecycle::{Event, GenerationRecord, Refusal};
use tracing::instrument;

use self::render::{collect, document, journal_stream, stream_events};
use super::error::{ApiError, Json, Path};
use super::lifecycle::{self, Plan};
use super::sse::last_event_id;
use crate::admission::{Prompt, Request};
use crate::server::AppState;
use switchyard_actors::generation::Launched;

/// Fields `POST /v1/generations` accepts; anything else is refused.
const FIELDS: [&str; 11] = [
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
    "service_tier",
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
    let model = plan.request.model.name.clone();
    match lifecycle::start(state, plan, id).await? {
        Launched::Running {
            generation,
            id,
            rate,
        } => {
            let mut response = if stream {
                stream_events(generation, id.clone())
            } else {
                collect(generation, &id, &model).await?
            };
            super::error::rate_headers(&rate, response.headers_mut());
            Ok(response)
        }
        // A retry while it runs resumes its stream, as `GET …/events` does.
        Launched::Existing(rec) if stream && !rec.status.is_terminal() => {
            let last = last_event_id(headers)?;
            reader_back(state, &rec.id).await;
            lifecycle::counted_replay(Ok(journal_stream(state, &rec.id, last)))
        }
        Launched::Existing(rec) => lifecycle::counted_replay(replay(state, &rec, stream)),
    }
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
    if !client_back(&state.launcher.generations, id)
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
            (false, Some(last)) => render::finished_journal_stream(&state, &rec.id, last).await,
            (false, None) => Ok(journal_stream(&state, &rec.id, None)),
            (true, None) => replay(&state, &rec, true),
            (true, Some(_)) => Err(lifecycle::expired(&rec)),
        }
    };
    match answer.await {
        Ok(response) => response,
        Err(e) => e.with_request_id(&id).into_response(),
    }
}

/// Credential, Idempotency-Key, SSRF guard, body and allowlist: the request as a [`Plan`].
async fn prepare(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
) -> Result<(Plan, bool), ApiError> {
    let principal = lifecycle::authenticate(state, headers).await?;
    tracing::Span::current().record("team_id", principal.team_id);
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let key = lifecycle::idempotency_key(headers)?
        .ok_or_else(|| bad("The `Idempotency-Key` header is required."))?;
    super::ssrf::guard(&body)?;
    let Value::Object(mut obj) = body else {
        return Err(bad("The body must be a JSON object."));
    };
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(bad(&format!("Unknown field `{unknown}`.")));
    }
    let tier = principal
        .service_tiers
        .resolve(lifecycle::requested_tier(&mut obj)?);
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
    let session = lifecycle::session_hint(headers, principal.team_id);
    let plan = Plan {
        request: Request {
            principal,
            model,
            engine_body: Value::Object(engine),
            max_tokens,
            idempotency: Some((key, fingerprint)),
            prompt: Prompt::Chat,
            tier,
        },
        x_request_id: lifecycle::client_request_id(),
        traceparent: lifecycle::traceparent(headers),
        session,
    };
    Ok((plan, stream))
}

/// A repeated key: the existing generation, never rerun.
fn replay(state: &AppState, rec: &GenerationRecord, stream: bool) -> Result<Response, ApiError> {
    let (out, end) = lifecycle::replayable(state, rec)?;
    if !stream {
        return Ok(axum::Json(document(rec, true)).into_response());
    }
    Ok(render::replayed(rec, out, end))
}

/// The caller's own generation `id`; anyone else's is `not_found`.
async fn owned(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
) -> Result<GenerationRecord, ApiError> {
    let principal = lifecycle::authenticate(state, headers).await?;
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
            if !state.launcher.generations.cancel(&rec.id)
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
