//! `POST /v1/chat/completions` and `GET /v1/models`: authenticate, validate, start a
//! generation, render it as OpenAI's SSE chunks or one `chat.completion`. The legacy
//! completions and embeddings routes (`completions.rs`, `embeddings.rs`) share the pipeline
//! here.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};
use switchyard_actors::error::ErrorCode;
use switchyard_actors::generation::GenEvent;
use switchyard_actors::lifecycle::GenerationRecord;
use switchyard_actors::protocol::Api;
use tracing::instrument;

use super::error::{ApiError, Json};
use super::lifecycle::{self, Plan};
use super::sse::{self, Dialect, Render};
use crate::admission::{Prompt, Request};
use crate::config::ModelConfig;
use crate::server::AppState;
use switchyard_actors::generation::Launched;

/// A validated request of one of the OpenAI routes.
pub(super) struct Validated {
    pub resolved: ModelConfig,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<u64>,
    /// The body as the engine gets it: every field passed through, the model resolved.
    pub engine_body: Value,
    /// What the prompt is, to count it.
    pub prompt: Prompt,
}

/// A route's own checks of its body.
pub(super) type Validate = fn(&AppState, Value) -> Result<Validated, ApiError>;

#[instrument(skip_all, fields(generation_id, team_id, model))]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let request_id = new_request_id("chatcmpl-");
    tracing::Span::current().record("generation_id", request_id.as_str());
    match run(&state, &headers, body, &request_id, Dialect::Chat, validate).await {
        Ok(response) => response,
        Err(e) => e.with_request_id(&request_id).into_response(),
    }
}

/// The pipeline of a generating route: prepare, admit, render in `dialect`.
pub(super) async fn run(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Value,
    request_id: &str,
    dialect: Dialect,
    validate: Validate,
) -> Result<Response, ApiError> {
    let (plan, stream, include_usage) = prepare(state, headers, body, validate)
        .await
        .inspect_err(lifecycle::count_refusal)?;
    let model = plan.request.model.name.clone();
    let tier = plan.request.tier;
    let created = state.clock.wall().timestamp();
    // Only a key the client chose can be retried: its stream is numbered for resuming.
    let resumable = plan
        .request
        .idempotency
        .as_ref()
        .is_some_and(|(key, _)| !key.starts_with("auto:"));
    let (generation, id, rate) = match lifecycle::start(state, plan, request_id).await? {
        Launched::Running {
            generation,
            id,
            rate,
        } => (generation, id, rate),
        Launched::Existing(rec) => {
            let render =
                Render::with_dialect(dialect, &rec.id, &model, include_usage, created).tier(tier);
            // A retry while it runs resumes its stream from the journal.
            if stream && !rec.status.is_terminal() {
                return lifecycle::counted_replay(sse::resume(state, &rec, render, headers).await);
            }
            return lifecycle::counted_replay(replay(state, &rec, render, stream).await);
        }
    };
    let mut render = Render::with_dialect(dialect, &id, &model, include_usage, created).tier(tier);
    if resumable {
        render = render.resumable();
    }
    let mut response = if stream {
        sse::stream(generation, render)
    } else {
        sse::collect(generation, render).await?
    };
    super::error::rate_headers(&rate, response.headers_mut());
    Ok(response)
}

/// A repeated Idempotency-Key: the retained result in this dialect, never a rerun.
async fn replay(
    state: &AppState,
    rec: &GenerationRecord,
    render: Render,
    stream: bool,
) -> Result<Response, ApiError> {
    match lifecycle::replayable(state, rec)? {
        (_, GenEvent::Failed(failure)) => Err(ApiError::from(failure)),
        (out, end) => {
            sse::replay(vec![GenEvent::Delta(out.into_piece()), end], render, stream).await
        }
    }
}

/// Credential, SSRF guard, body, allowlist, Idempotency-Key: the request as a [`Plan`], and
/// its rendering options (stream, include_usage).
pub(super) async fn prepare(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
    validate: Validate,
) -> Result<(Plan, bool, bool), ApiError> {
    let principal = lifecycle::authenticate(state, headers).await?;
    tracing::Span::current().record("team_id", principal.team_id);
    super::ssrf::guard(&body)?;
    let idempotency = lifecycle::idempotency_key(headers)?;
    // The semantic inputs: the body as sent, without the response-mode fields.
    let fingerprint = idempotency.as_ref().map(|_| {
        let mut semantic = body.clone();
        if let Value::Object(o) = &mut semantic {
            o.remove("stream");
            o.remove("stream_options");
            // The tier decides when and where it runs, not what it says.
            o.remove("service_tier");
        }
        lifecycle::fingerprint(&semantic)
    });
    let mut body = body;
    let requested = match &mut body {
        Value::Object(obj) => lifecycle::requested_tier(obj)?,
        _ => None,
    };
    let tier = principal.service_tiers.resolve(requested);
    let req = validate(state, body)?;
    if req.resolved.embedding != (req.prompt.api() == Api::Embeddings) {
        let message = if req.resolved.embedding {
            "That model is an embedding model: use /v1/embeddings."
        } else {
            "That model is not an embedding model."
        };
        return Err(ApiError::new(ErrorCode::InvalidRequest, message).with_param("model"));
    }
    tracing::Span::current().record("model", req.resolved.name.as_str());
    if !allowed(state, &principal, &req.resolved) {
        return Err(ApiError::new(
            ErrorCode::ModelNotAllowed,
            "This key may not use that model.",
        ));
    }
    let max_tokens = match req.prompt.api() {
        Api::Embeddings => 0,
        _ => req
            .max_tokens
            .unwrap_or(u64::from(req.resolved.default_max_tokens)),
    };
    let session = lifecycle::session_hint(headers, principal.team_id);
    let plan = Plan {
        request: Request {
            principal,
            model: req.resolved,
            engine_body: req.engine_body,
            max_tokens,
            idempotency: idempotency.zip(fingerprint),
            prompt: req.prompt,
            tier,
        },
        x_request_id: lifecycle::client_request_id(),
        traceparent: lifecycle::traceparent(headers),
        session,
    };
    Ok((plan, req.stream, req.include_usage))
}

/// Checks the fields Switchyard acts on; the rest pass through to the engine untouched.
fn validate(state: &AppState, body: Value) -> Result<Validated, ApiError> {
    let bad = |m: &str| ApiError::new(ErrorCode::InvalidRequest, m);
    let Value::Object(mut obj) = body else {
        return Err(bad("The body must be a JSON object."));
    };
    let resolved = lifecycle::resolve_model(state, &obj)?;
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty array.").with_param("messages"))?;
    for m in messages {
        if m.get("role").and_then(Value::as_str).is_none() {
            return Err(bad("Every message needs a string `role`.").with_param("messages"));
        }
    }
    one_choice(&obj, "n")?;
    let (stream, include_usage) = stream_options(&obj)?;
    let max_tokens = output_cap(
        &mut obj,
        &resolved,
        &["max_completion_tokens", "max_tokens"],
        u64::from(resolved.default_max_tokens),
    )?;
    obj.insert("model".into(), Value::String(resolved.name.clone()));
    obj.remove("stream_options");
    Ok(Validated {
        resolved,
        stream,
        include_usage,
        max_tokens,
        engine_body: Value::Object(obj),
        prompt: Prompt::Chat,
    })
}

/// `field` (`n`, `best_of`) absent or 1: one choice per request.
pub(super) fn one_choice(obj: &Map<String, Value>, field: &'static str) -> Result<(), ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(n) if n.as_u64() == Some(1) => Ok(()),
        Some(_) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("`{field}` must be 1: one choice per request."),
        )
        .with_param(field)),
    }
}

/// `stream` and `stream_options.include_usage`.
pub(super) fn stream_options(obj: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(
                ApiError::new(ErrorCode::InvalidRequest, "`stream` must be a boolean.")
                    .with_param("stream"),
            );
        }
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok((stream, include_usage))
}

/// The output cap the client set in the first of `fields` present, checked; when it set
/// none, `default` is written into the engine's body, so the reservation covers what the
/// engine may produce.
pub(super) fn output_cap(
    obj: &mut Map<String, Value>,
    model: &ModelConfig,
    fields: &[&str],
    default: u64,
) -> Result<Option<u64>, ApiError> {
    let mut max_tokens = None;
    for field in fields {
        match obj.get(*field) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let n = lifecycle::check_max_tokens(model, field, v.as_u64().unwrap_or(0))?;
                max_tokens = max_tokens.or(Some(n));
            }
        }
    }
    if max_tokens.is_none() {
        obj.insert("max_tokens".into(), Value::from(default));
    }
    Ok(max_tokens)
}

/// `prefix` and 24 random hex digits.
pub(super) fn new_request_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}

/// `GET /v1/models`: the models and aliases the key may use, in OpenAI's list shape.
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let principal = match lifecycle::authenticate(&state, &headers).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let created = state.clock.wall().timestamp();
    let mut data = Vec::new();
    for m in &state.config.models {
        for id in std::iter::once(&m.name).chain(&m.aliases) {
            if allowed(&state, &principal, m) {
                let mut entry = Map::new();
                entry.insert("id".into(), Value::String(id.clone()));
                entry.insert("object".into(), Value::String("model".into()));
                entry.insert("created".into(), Value::from(created));
                entry.insert("owned_by".into(), Value::String("switchyard".into()));
                data.push(Value::Object(entry));
            }
        }
    }
    axum::Json(serde_json::json!({ "object": "list", "data": data })).into_response()
}

/// Longest piece of a requested model id echoed in a 404.
const ECHO_MODEL_CHARS: usize = 64;

/// `GET /v1/models/{id}`: one model or alias the key may use, as OpenAI's model object (the
/// same entry `GET /v1/models` lists). Any other id is 404 `model_not_found`, whether or not
/// the model exists, so a key cannot probe for models outside its allowlist.
pub async fn model(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    super::error::Path(id): super::error::Path<String>,
) -> Result<axum::Json<Value>, ApiError> {
    let principal = lifecycle::authenticate(&state, &headers).await?;
    match state.config.resolve_model(&id) {
        Some(m) if allowed(&state, &principal, m) => Ok(axum::Json(serde_json::json!({
            "id": id,
            "object": "model",
            "created": state.clock.wall().timestamp(),
            "owned_by": "switchyard",
        }))),
        _ => Err(ApiError::new(
            ErrorCode::ModelNotFound,
            format!(
                "The model `{}` does not exist or this key may not use it.",
                super::error::printable(&id, ECHO_MODEL_CHARS)
            ),
        )
        .with_param("model")),
    }
}

/// Whether the principal's allowlist admits `model`: an entry may name the model or any of
/// its aliases, and admits the model under every name.
pub(super) fn allowed(
    state: &AppState,
    principal: &crate::auth::Principal,
    model: &ModelConfig,
) -> bool {
    principal.model_allowlist.as_ref().is_none_or(|list| {
        list.iter().any(|entry| {
            state
                .config
                .resolve_model(entry)
                .is_some_and(|m| m.name == model.name)
        })
    })
}
