//! The HTTP side of the one generation pipeline behind every generating route: the
//! credential, the Idempotency-Key header and the request's fingerprint, the hand-over of a
//! request's [`crate::admission`] job to the replica's launcher (which runs it and starts the
//! generation it admitted), and the answer to a repeated key. `/v1/chat/completions` enters with an optional Idempotency-Key, `/v1/generations`
//! always with one; each renders the result in its own dialect.

use axum::http::HeaderMap;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::{GenEvent, LaunchError, Launched, Trace, Usage};
use switchyard_actors::lifecycle::{GenerationRecord, Status};
use switchyard_actors::metric_names::REQUESTS_TOTAL;
use switchyard_actors::output::Assembled;
use switchyard_actors::tier::{Tier, UnknownTier};

use super::error::ApiError;
use crate::admission::Request;
use crate::auth::{BearerError, Principal};
use crate::config::ModelConfig;
use crate::server::AppState;

/// Longest Idempotency-Key accepted.
const MAX_KEY_LEN: usize = 255;

/// A validated request, whichever dialect it came in: what admission decides on, and the
/// trace ids the engine gets.
#[derive(Debug)]
pub struct Plan {
    /// What admission decides on.
    pub request: Request,
    /// The client's request id, passed to the engine.
    pub x_request_id: Option<String>,
    /// The W3C trace context, passed to the engine.
    pub traceparent: Option<String>,
    /// The client's conversation ([`session_hint`]), a routing hint.
    pub session: Option<u64>,
}

/// The request's bearer credential: its `Authorization` headers, all of them, through
/// [`crate::auth::bearer`].
pub fn bearer(headers: &HeaderMap) -> Result<&str, BearerError> {
    let values = headers.get_all(axum::http::header::AUTHORIZATION);
    crate::auth::bearer(values.iter().map(axum::http::HeaderValue::as_bytes))
}

/// The principal behind the request's credential, named in the access log (a verified JWT
/// whose team failed is named too); never the credential itself.
pub async fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Principal, ApiError> {
    match state.auth.authenticate(bearer(headers)?).await {
        Ok(principal) => {
            super::access_log::record_principal(&principal.log_name());
            Ok(principal)
        }
        Err(e) => {
            if let Some(subject) = e.subject() {
                super::access_log::record_principal(subject);
            }
            Err(e.into())
        }
    }
}

/// The model a body's `model` names (a version or an alias), for both dialects.
pub fn resolve_model(
    state: &AppState,
    obj: &serde_json::Map<String, Value>,
) -> Result<ModelConfig, ApiError> {
    let name = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidRequest, "`model` is required."))?;
    state.config.resolve_model(name).cloned().ok_or_else(|| {
        ApiError::new(
            ErrorCode::ModelNotFound,
            format!("The model `{name}` does not exist."),
        )
    })
}

/// The most output tokens a request may ask for: the model's context.
pub fn check_max_tokens(model: &ModelConfig, field: &str, n: u64) -> Result<u64, ApiError> {
    let context = u64::from(model.max_context_tokens);
    if n == 0 || n > context {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!(
                "`{field}` must be an integer from 1 to the model's context length ({context})."
            ),
        )
        .with_param(field));
    }
    Ok(n)
}

/// The request's id (the client's `x-request-id`, or the one minted for it), for the engine.
pub fn client_request_id() -> Option<String> {
    super::request_id::current().map(|id| id.as_str().to_owned())
}

/// The W3C `traceparent` to continue at the engine: the access layer leaves only a
/// well-formed one on the request (the gateway's own span's when tracing is exported).
pub fn traceparent(headers: &HeaderMap) -> Option<String> {
    super::request_id::TraceContext::from_headers(headers)
        .traceparent()
        .map(str::to_owned)
}

/// The header naming a client's conversation: requests naming the same one prefer the node
/// that served the last (a hint; the prompt's own blocks weigh more).
pub const SESSION_HEADER: &str = "x-session-id";

/// The `x-session-id` of a request, hashed with its team (two teams' sessions never meet); a
/// hint, so a missing, repeated, empty or over-long (over 256 bytes) value is simply no
/// session. Never logged.
pub fn session_hint(headers: &HeaderMap, team_id: i64) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let mut values = headers.get_all(SESSION_HEADER).iter();
    let value = values.next()?;
    if values.next().is_some() || value.is_empty() || value.len() > 256 {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    team_id.hash(&mut h);
    value.as_bytes().hash(&mut h);
    Some(h.finish())
}

/// The optional `Idempotency-Key` header: 1 to 255 visible ASCII characters, sent once.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "`Idempotency-Key` was sent more than once; send it once.",
        )
        .with_param("Idempotency-Key"));
    }
    let key = value
        .to_str()
        .ok()
        .filter(|k| {
            !k.is_empty() && k.len() <= MAX_KEY_LEN && k.bytes().all(|b| b.is_ascii_graphic())
        })
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                "`Idempotency-Key` must be 1 to 255 visible ASCII characters.",
            )
        })?;
    Ok(Some(key.to_owned()))
}

/// The `service_tier` a body asks for, taken out of it (the engine hears the tier as its own
/// `priority`, never this field): `None` for `auto`, null or nothing.
pub fn requested_tier(body: &mut serde_json::Map<String, Value>) -> Result<Option<Tier>, ApiError> {
    match body.remove("service_tier") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(name)) => Tier::parse(&name).map_err(|e| tier_refused(&e)),
        Some(_) => Err(tier_refused(&UnknownTier)),
    }
}

fn tier_refused(e: &UnknownTier) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, format!("`service_tier`: {e}."))
        .with_param("service_tier")
}

/// SHA-256 (hex) of `v` with object keys sorted at every level: the same request gives the
/// same fingerprint whatever the order of its fields. Only the digest is stored.
pub fn fingerprint(v: &Value) -> String {
    let mut text = String::new();
    canonical(v, &mut text);
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String((*k).clone()).to_string());
                out.push(':');
                if let Some(child) = map.get(*k) {
                    canonical(child, out);
                }
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Hands `plan`'s admission, under `id`, to the replica's [`Launcher`]: it runs the
/// admission, then starts the generation it admitted. Refusals before a generation exists are
/// counted here; a generation counts its own outcome.
///
/// [`Launcher`]: switchyard_actors::generation::Launcher
pub async fn start(state: &AppState, plan: Plan, id: &str) -> Result<Launched, ApiError> {
    let Plan {
        request,
        x_request_id,
        traceparent,
        session,
    } = plan;
    let api = request.prompt.api();
    let job = Box::new(state.admission.job(request, id));
    let trace = Trace {
        x_request_id,
        traceparent,
        session,
    };
    match state.launcher.launch(job, api, trace).await {
        Ok(started) => Ok(started),
        Err(LaunchError::Refused(refusal)) => {
            let e = ApiError::from(refusal);
            count_refusal(&e);
            Err(e)
        }
        Err(LaunchError::NotStarted { failure, rate }) => {
            Err(ApiError::from(failure).with_rate_headers(rate))
        }
    }
}

/// Counts the answer to a repeated key (`replayed`, or its 409/410 code).
pub fn counted_replay(
    answer: Result<axum::response::Response, ApiError>,
) -> Result<axum::response::Response, ApiError> {
    let code = match &answer {
        Ok(_) => "replayed",
        Err(e) => e.failure.code.as_str(),
    };
    metrics::counter!(REQUESTS_TOTAL, "model" => "", "code" => code).increment(1);
    answer
}

/// Counts a request refused before it became a generation.
pub fn count_refusal(e: &ApiError) {
    metrics::counter!(REQUESTS_TOTAL, "model" => "", "code" => e.failure.code.as_str())
        .increment(1);
}

/// 409 `generation_in_progress` with the running generation's id and status.
pub fn in_progress(rec: &GenerationRecord) -> ApiError {
    let mut err = ApiError::new(
        ErrorCode::GenerationInProgress,
        "A generation with this Idempotency-Key is still running.",
    );
    err.details = Some(Box::new(
        json!({ "generation_id": rec.id, "status": rec.api_status() }),
    ));
    err
}

/// 410 `result_unavailable`: the generation is known, its content expired.
pub fn expired(rec: &GenerationRecord) -> ApiError {
    let mut err = ApiError::new(
        ErrorCode::ResultUnavailable,
        "The generation's result is no longer retained.",
    );
    err.details = Some(Box::new(
        json!({ "generation_id": rec.id, "status": rec.api_status() }),
    ));
    err
}

/// A repeated key's answer, in either dialect: the retained output (text, reasoning, tool
/// calls) and the generation's end
/// (a failure as [`GenEvent::Failed`] with its recorded code); 409 while it still runs, 410
/// once its result is gone.
pub fn replayable(
    state: &AppState,
    rec: &GenerationRecord,
) -> Result<(Assembled, GenEvent), ApiError> {
    if !rec.status.is_terminal() {
        return Err(in_progress(rec));
    }
    if !retained(state, rec, state.clock.wall().timestamp_millis()) {
        return Err(expired(rec));
    }
    let usage = Usage {
        prompt_tokens: rec.input_tokens,
        completion_tokens: rec.output_tokens,
        finish_reason: rec.finish_reason.clone().unwrap_or_else(|| "stop".into()),
        cached_tokens: None,
    };
    let end = match rec.status {
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
    };
    Ok((retained_output(rec), end))
}

/// A record's retained output, assembled.
pub fn retained_output(rec: &GenerationRecord) -> Assembled {
    Assembled::retained(
        rec.output.as_deref().unwrap_or_default(),
        rec.output_extra.as_deref(),
    )
}

/// Whether a terminal record's result is still retained at `now_ms` (a record ended from a
/// `done` resent after a restart never had its text).
pub fn retained(state: &AppState, rec: &GenerationRecord, now_ms: i64) -> bool {
    rec.output.is_some()
        && rec
            .terminal_ms
            .is_some_and(|t| t.saturating_add(state.config.retention_ms()) > now_ms)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn fingerprints_ignore_field_order_and_see_every_value() {
        let a = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 5});
        let b = json!({"max_output_tokens": 5, "messages": [{"content": "hi", "role": "user"}], "model": "small"});
        let c = json!({"model": "small", "messages": [{"role": "user", "content": "hi!"}], "max_output_tokens": 5});
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_eq!(fingerprint(&a).len(), 64);
    }

    #[test]
    fn idempotency_keys_are_bounded_visible_ascii() {
        let mut h = HeaderMap::new();
        assert_eq!(idempotency_key(&h).unwrap(), None);
        h.insert("idempotency-key", "abc-123".parse().unwrap());
        assert_eq!(idempotency_key(&h).unwrap().as_deref(), Some("abc-123"));
        h.insert("idempotency-key", "has space".parse().unwrap());
        assert!(idempotency_key(&h).is_err());
        h.insert("idempotency-key", "x".repeat(256).parse().unwrap());
        assert!(idempotency_key(&h).is_err());
        let mut twice = HeaderMap::new();
        twice.append("idempotency-key", "a".parse().unwrap());
        twice.append("idempotency-key", "a".parse().unwrap());
        assert_eq!(
            idempotency_key(&twice).unwrap_err().param.as_deref(),
            Some("Idempotency-Key")
        );
    }

    #[test]
    fn a_session_is_one_value_of_1_to_256_bytes_and_never_meets_another_teams() {
        let with = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(SESSION_HEADER, HeaderValue::from_bytes(v).unwrap());
            }
            h
        };
        let trip = with(&[b"trip-17"]);
        assert_eq!(session_hint(&HeaderMap::new(), 1), None);
        let hint = session_hint(&trip, 1);
        assert!(hint.is_some());
        assert_eq!(session_hint(&trip, 1), hint, "stable");
        assert_ne!(session_hint(&trip, 2), hint, "another team's trip-17");
        assert_ne!(session_hint(&with(&[b"trip-18"]), 1), hint);
        // A hint, so anything doubtful is no session rather than an error.
        assert_eq!(session_hint(&with(&[b""]), 1), None);
        assert_eq!(session_hint(&with(&[b"trip-17", b"trip-17"]), 1), None);
        let longest = vec![b'x'; 256];
        assert!(session_hint(&with(&[&longest]), 1).is_some());
        let over = vec![b'x'; 257];
        assert_eq!(session_hint(&with(&[&over]), 1), None);
        // Any visible bytes, not only ASCII (a UUID, a base64 value, a name).
        assert!(session_hint(&with(&[b"r\xc3\xa9servation 4/2+="]), 1).is_some());
    }
}
