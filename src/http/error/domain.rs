//! The domain's refusals as HTTP answers, each in one `match`: authentication
//! ([`AuthError`]), the per-principal limits ([`LimitError`]) and admission
//! ([`AdmissionError`]) get their code from the closed set, their public message, their
//! details and their headers (`Retry-After`, `x-ratelimit-*`) here and nowhere else.

use axum::http::{HeaderMap, HeaderValue};
use chrono::{TimeZone, Utc};
use serde_json::json;
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::ports::admission::LimitState;

use super::ApiError;
use crate::admission::{AdmissionError, MeasureError};
use crate::auth::{AuthError, BearerError};
use crate::quota::LimitError;

impl From<BearerError> for ApiError {
    fn from(e: BearerError) -> Self {
        ApiError::new(ErrorCode::Unauthorized, e.to_string())
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        let message = e.to_string();
        match e {
            AuthError::UnknownKey
            | AuthError::KeyUnusable
            | AuthError::JwtNotAccepted
            | AuthError::Token(_)
            | AuthError::NoTeam { .. }
            | AuthError::UnknownTeam { .. } => ApiError::new(ErrorCode::Unauthorized, message),
            // The store's outage is the platform's problem, but a credential check gives no
            // wait to announce.
            AuthError::StoreUnavailable { .. } => {
                ApiError::new(ErrorCode::QuotaServiceUnavailable, message)
            }
            AuthError::JwksUnavailable => ApiError::unavailable(message),
            AuthError::KeyNotFetchedYet { retry_after_secs } => ApiError::from(
                Failure::new(ErrorCode::QuotaServiceUnavailable, message)
                    .retry_after(retry_after_secs),
            ),
        }
    }
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> Self {
        let message = e.to_string();
        match e {
            LimitError::Streams { .. } => {
                ApiError::from(Failure::new(ErrorCode::ConcurrencyLimited, message).retry_after(1))
            }
            LimitError::Requests {
                limit,
                retry_after_secs,
                state,
            } => ApiError::from(
                Failure::new(ErrorCode::RateLimited, message).retry_after(retry_after_secs),
            )
            .with_details(json!({"limit": limit, "remaining": 0}))
            .with_rate_headers(state),
            LimitError::TokensPerDay {
                limit,
                retry_after_secs,
                reset_at,
                state,
            } => ApiError::from(
                Failure::new(ErrorCode::QuotaExhausted, message).retry_after(retry_after_secs),
            )
            .with_details(json!({
                "limit": limit, "remaining": 0, "reset_at": reset_at.map(|r| r.to_rfc3339()),
            }))
            .with_rate_headers(state),
            LimitError::Unavailable { .. } => ApiError::unavailable(message),
        }
    }
}

impl From<MeasureError> for ApiError {
    fn from(e: MeasureError) -> Self {
        let (message, param) = (e.to_string(), e.param());
        let err = match e {
            MeasureError::NotAnObject | MeasureError::Template => {
                ApiError::new(ErrorCode::InvalidRequest, message)
            }
            MeasureError::Uncounted => ApiError::unavailable(message),
            MeasureError::ContextLength { .. } => {
                ApiError::new(ErrorCode::ContextLengthExceeded, message)
            }
        };
        match param {
            Some(param) => err.with_param(param),
            None => err,
        }
    }
}

impl From<AdmissionError> for ApiError {
    fn from(e: AdmissionError) -> Self {
        let message = e.to_string();
        let limits = e.limits();
        let err = match e {
            AdmissionError::StoreUnavailable => ApiError::unavailable(message),
            AdmissionError::Conflict { generation_id, .. } => {
                ApiError::new(ErrorCode::IdempotencyConflict, message)
                    .with_details(json!({ "generation_id": generation_id }))
            }
            AdmissionError::ModelNotServed | AdmissionError::StoredModelGone => {
                ApiError::new(ErrorCode::ModelNotFound, message)
            }
            // Its own headers, exactly as the limits set them.
            AdmissionError::Limit(e) => return ApiError::from(e),
            AdmissionError::Measure { error, .. } => ApiError::from(error),
            AdmissionError::Burst {
                retry_after_secs, ..
            } => ApiError::from(
                Failure::new(ErrorCode::RateLimited, message).retry_after(retry_after_secs),
            ),
            AdmissionError::Active { limit, .. } => {
                ApiError::from(Failure::new(ErrorCode::ConcurrencyLimited, message).retry_after(1))
                    .with_details(json!({ "limit": limit }))
            }
            AdmissionError::Messages {
                limit,
                remaining,
                reset_at_ms,
                retry_after_secs,
                ..
            } => ApiError::from(
                Failure::new(ErrorCode::QuotaExhausted, message).retry_after(retry_after_secs),
            )
            .with_details(json!({
                "limit": limit, "remaining": remaining, "reset_at": rfc3339(reset_at_ms),
            })),
        };
        match limits {
            Some(limits) => err.with_rate_headers(limits),
            None => err,
        }
    }
}

/// A refusal as a generation reports it: the same code, message and wait as its HTTP answer
/// (one classification), without what only HTTP carries (details, headers).
impl From<AdmissionError> for Failure {
    fn from(e: AdmissionError) -> Self {
        ApiError::from(e).failure
    }
}

fn rfc3339(ms: i64) -> Option<String> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// Writes where the principal stands against its limits as OpenAI's `x-ratelimit-*` headers.
pub fn rate_headers(limits: &LimitState, headers: &mut HeaderMap) {
    let mut put = |name: &'static str, value: String| {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    };
    if let Some((limit, remaining, reset_ms)) = limits.requests {
        put("x-ratelimit-limit-requests", limit.to_string());
        put("x-ratelimit-remaining-requests", remaining.to_string());
        put("x-ratelimit-reset-requests", reset_duration(reset_ms));
    }
    if let Some((limit, remaining, reset_ms)) = limits.tokens {
        put("x-ratelimit-limit-tokens", limit.to_string());
        put("x-ratelimit-remaining-tokens", remaining.to_string());
        put("x-ratelimit-reset-tokens", reset_duration(reset_ms));
    }
}

/// A duration as OpenAI writes its `x-ratelimit-reset-*` headers: `20ms` under a second,
/// otherwise whole seconds rounded up, with minutes and hours when there are any (`54s`,
/// `6m0s`, `13h2m5s`).
pub fn reset_duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms.div_ceil(1000);
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, m) => format!("{m}m{s}s"),
        (h, m) => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests;
