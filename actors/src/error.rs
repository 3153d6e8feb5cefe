//! The closed set of error codes a client can see (SPEC section 4). Every failure in the
//! system is classified into one of these exactly once; the HTTP layer maps each to its
//! status and OpenAI error type in a single `match`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A client-visible error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Malformed JSON, bad fields, `n > 1`.
    InvalidRequest,
    /// The prompt alone fills the model's context (a 400, as `invalid_request`).
    ContextLengthExceeded,
    /// Missing, unknown, revoked or expired credential.
    Unauthorized,
    /// Balance minus open reservations cannot cover the estimate.
    InsufficientBalance,
    /// The model is outside the key's allowlist.
    ModelNotAllowed,
    /// Admin route without admin rights.
    Forbidden,
    /// Unknown model.
    ModelNotFound,
    /// Unknown route or generation.
    NotFound,
    /// Same idempotency key, different request.
    IdempotencyConflict,
    /// Same idempotency key while the first is running.
    GenerationInProgress,
    /// Known generation whose content expired.
    ResultUnavailable,
    /// Body over the byte limit.
    RequestTooLarge,
    /// Body references an internal URL.
    UnsafeReference,
    /// Requests-per-minute window or burst bucket.
    RateLimited,
    /// Too many concurrent streams.
    ConcurrencyLimited,
    /// Tokens per day or message window spent.
    QuotaExhausted,
    /// The model's queue is at its bound.
    QueueFull,
    /// The engine failed.
    ModelBackendError,
    /// The queue deadline passed.
    CapacityExhausted,
    /// No live node serves the model.
    NoHealthyNode,
    /// A cold start is under way.
    ModelLoading,
    /// Redis or the ledger is unreachable: admission fails closed.
    QuotaServiceUnavailable,
    /// No first token or no completion within the deadline.
    GenerationTimeout,
}

impl ErrorCode {
    /// The code as it appears in `error.code`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::ContextLengthExceeded => "context_length_exceeded",
            Self::Unauthorized => "unauthorized",
            Self::InsufficientBalance => "insufficient_balance",
            Self::ModelNotAllowed => "model_not_allowed",
            Self::Forbidden => "forbidden",
            Self::ModelNotFound => "model_not_found",
            Self::NotFound => "not_found",
            Self::IdempotencyConflict => "idempotency_conflict",
            Self::GenerationInProgress => "generation_in_progress",
            Self::ResultUnavailable => "result_unavailable",
            Self::RequestTooLarge => "request_too_large",
            Self::UnsafeReference => "unsafe_reference",
            Self::RateLimited => "rate_limited",
            Self::ConcurrencyLimited => "concurrency_limited",
            Self::QuotaExhausted => "quota_exhausted",
            Self::QueueFull => "queue_full",
            Self::ModelBackendError => "model_backend_error",
            Self::CapacityExhausted => "capacity_exhausted",
            Self::NoHealthyNode => "no_healthy_node",
            Self::ModelLoading => "model_loading",
            Self::QuotaServiceUnavailable => "quota_service_unavailable",
            Self::GenerationTimeout => "generation_timeout",
        }
    }

    /// Parses a code as [`Self::as_str`] writes it.
    pub fn parse(s: &str) -> Option<Self> {
        use ErrorCode::*;
        [
            InvalidRequest,
            ContextLengthExceeded,
            Unauthorized,
            InsufficientBalance,
            ModelNotAllowed,
            Forbidden,
            ModelNotFound,
            NotFound,
            IdempotencyConflict,
            GenerationInProgress,
            ResultUnavailable,
            RequestTooLarge,
            UnsafeReference,
            RateLimited,
            ConcurrencyLimited,
            QuotaExhausted,
            QueueFull,
            ModelBackendError,
            CapacityExhausted,
            NoHealthyNode,
            ModelLoading,
            QuotaServiceUnavailable,
            GenerationTimeout,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }

    /// Whether retrying the same request later can succeed.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Self::RateLimited
                | Self::ConcurrencyLimited
                | Self::QueueFull
                | Self::ModelBackendError
                | Self::CapacityExhausted
                | Self::NoHealthyNode
                | Self::ModelLoading
                | Self::QuotaServiceUnavailable
                | Self::GenerationTimeout
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A classified failure: the code, a message safe to show the client (never prompt text),
/// and an optional wait before a retry can succeed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The client-visible code.
    pub code: ErrorCode,
    /// Message for the client.
    pub message: String,
    /// When a retry may succeed (`Retry-After`).
    pub retry_after_secs: Option<u64>,
}

impl Failure {
    /// A failure with no retry hint.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// Adds a `Retry-After` hint.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn codes_serialize_as_the_spec_names() {
        for code in [
            ErrorCode::QueueFull,
            ErrorCode::NoHealthyNode,
            ErrorCode::ModelBackendError,
        ] {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
        }
    }
}
