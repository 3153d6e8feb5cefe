//! The one place a failure becomes an HTTP answer: every [`ErrorCode`] maps to its status and
//! OpenAI error type in a single `match`, rendered as the OpenAI envelope extended with
//! `retryable`, `request_id` and `details`. The body, query and path extractors ([`Json`],
//! [`Query`], [`Path`]) reject through here too, naming the field, so a malformed request
//! gets the same shape as every other error.

mod domain;
mod extract;

pub use domain::{rate_headers, reset_duration};
pub(crate) use extract::printable;
pub use extract::{Json, Path, Query};

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::ports::admission::LimitState;

/// How the Generations API's ids begin.
const GENERATION_ID_PREFIX: &str = "gen_";

/// A client-visible failure of a request.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// What went wrong, classified.
    pub failure: Failure,
    /// An id the handler attached: shown as `request_id` only outside a request's scope
    /// (inside one, the request's `RequestId` is); a generation's id is kept in the details.
    pub request_id: Option<String>,
    /// Extra machine-readable facts (limits, ids); boxed to keep results small.
    pub details: Option<Box<serde_json::Value>>,
    /// Where the principal stands against its limits, sent as `x-ratelimit-*` headers.
    pub rate: Option<Box<LimitState>>,
    /// The field the error is about (`error.param`), when there is one.
    pub param: Option<String>,
    /// A status other than the code's own, for refusals HTTP names more precisely (408 for a
    /// body that never arrived, 414 and 431 for oversized heads, 405): the code stays one of
    /// SPEC section 4's.
    pub status: Option<StatusCode>,
}

impl ApiError {
    /// An error with a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            failure: Failure::new(code, message),
            request_id: None,
            details: None,
            rate: None,
            param: None,
            status: None,
        }
    }

    /// Names the offending field in `error.param`.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Answers with `status` instead of the code's own status.
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }

    /// 503 `quota_service_unavailable` with `Retry-After: 1`: a backend admission or
    /// bookkeeping needs cannot be reached, so nothing was done (fail closed).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::from(Failure::new(ErrorCode::QuotaServiceUnavailable, message).retry_after(1))
    }

    /// Attaches the request id.
    pub fn with_request_id(mut self, id: &str) -> Self {
        self.request_id = Some(id.to_owned());
        self
    }

    /// Attaches the rate-limit headers.
    pub fn with_rate_headers(mut self, rate: LimitState) -> Self {
        self.rate = Some(Box::new(rate));
        self
    }

    /// Attaches machine-readable details (limits, ids).
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = Some(Box::new(details));
        self
    }

    /// Status and OpenAI `type` of a code.
    pub fn status_and_type(code: ErrorCode) -> (StatusCode, &'static str) {
        use ErrorCode::*;
        match code {
            InvalidRequest | ContextLengthExceeded => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            Unauthorized => (StatusCode::UNAUTHORIZED, "authentication_error"),
            InsufficientBalance => (StatusCode::PAYMENT_REQUIRED, "insufficient_quota"),
            ModelNotAllowed | Forbidden => (StatusCode::FORBIDDEN, "permission_error"),
            ModelNotFound | NotFound => (StatusCode::NOT_FOUND, "not_found_error"),
            IdempotencyConflict | GenerationInProgress => (StatusCode::CONFLICT, "conflict_error"),
            ResultUnavailable => (StatusCode::GONE, "not_found_error"),
            RequestTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error"),
            UnsafeReference => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_request_error"),
            RateLimited | ConcurrencyLimited | QuotaExhausted | QueueFull => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error")
            }
            ModelBackendError => (StatusCode::BAD_GATEWAY, "api_error"),
            CapacityExhausted | NoHealthyNode | ModelLoading | QuotaServiceUnavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error")
            }
            GenerationTimeout => (StatusCode::GATEWAY_TIMEOUT, "timeout_error"),
        }
    }

    /// The `{"error": {...}}` body. `request_id` is the request's [`RequestId`] (the
    /// `x-request-id` header) whenever one is in scope, whatever the handler attached; an
    /// attached generation id (`gen_…`) is kept as `details.generation_id`.
    ///
    /// [`RequestId`]: crate::http::request_id::RequestId
    pub fn body(&self) -> serde_json::Value {
        let code = self.failure.code;
        let (_, kind) = Self::status_and_type(code);
        let scoped = crate::http::request_id::current();
        let request_id = scoped
            .as_ref()
            .map(|id| id.as_str())
            .or(self.request_id.as_deref());
        let mut details = self.details.as_deref().cloned();
        // A generation's id (`POST /v1/generations` names its record before admission) stays
        // readable, so a client can look the generation up after a refusal.
        if let Some(own) = self.request_id.as_deref()
            && Some(own) != request_id
            && own.starts_with(GENERATION_ID_PREFIX)
        {
            let d = details.get_or_insert_with(|| json!({}));
            if let Some(obj) = d.as_object_mut()
                && !obj.contains_key("generation_id")
            {
                obj.insert("generation_id".into(), own.into());
            }
        }
        let mut error = json!({
            "message": self.failure.message,
            "type": kind,
            "param": self.param,
            "code": code.as_str(),
            "retryable": code.retryable(),
            "request_id": request_id,
        });
        if let (Some(details), Some(obj)) = (details, error.as_object_mut()) {
            obj.insert("details".into(), details);
        }
        json!({ "error": error })
    }
}

impl From<Failure> for ApiError {
    fn from(failure: Failure) -> Self {
        Self {
            failure,
            request_id: None,
            details: None,
            rate: None,
            param: None,
            status: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self
            .status
            .unwrap_or_else(|| Self::status_and_type(self.failure.code).0);
        let mut response = (status, axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        if let Some(secs) = self.failure.retry_after_secs
            && let Ok(v) = HeaderValue::from_str(&secs.to_string())
        {
            headers.insert("retry-after", v);
        }
        // The SDKs retry 429 and 5xx by default; tell them when waiting cannot help.
        if !self.failure.code.retryable() || status == StatusCode::PAYMENT_REQUIRED {
            headers.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        // Outside a request scope (unit tests); inside one the request layer sets it.
        if let Some(id) = self
            .request_id
            .as_deref()
            .and_then(|id| HeaderValue::from_str(id).ok())
        {
            headers.insert(crate::http::request_id::HEADER, id);
        }
        if let Some(rate) = &self.rate {
            rate_headers(rate, headers);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_a_client_error_or_server_error_status() {
        use ErrorCode::*;
        for code in [
            InvalidRequest,
            QueueFull,
            NoHealthyNode,
            ModelBackendError,
            GenerationTimeout,
        ] {
            let (status, _) = ApiError::status_and_type(code);
            assert!(status.is_client_error() || status.is_server_error());
        }
        assert_eq!(
            ApiError::status_and_type(QueueFull).0,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            ApiError::status_and_type(NoHealthyNode).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
