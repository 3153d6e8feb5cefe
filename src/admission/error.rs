//! Why admission refused a request: one domain enum whose variants carry what the client is
//! shown with each refusal (limits, ids, waits). It becomes an HTTP answer, and a
//! generation's [`Failure`](switchyard_actors::error::Failure), in `src/http/error/domain.rs`.

use switchyard_actors::ports::admission::LimitState;

use super::measure::MeasureError;
use crate::quota::LimitError;

/// A request admission refused; nothing was started, and whatever admission took (a stream
/// place) was given back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The lifecycle store could not be read or written (the cause is logged where it
    /// happened): admission fails closed.
    #[error("Generations cannot be admitted right now; nothing was started.")]
    StoreUnavailable,
    /// The Idempotency-Key names a generation of a different request.
    #[error("This Idempotency-Key was used with a different request.")]
    Conflict {
        /// The generation the key belongs to.
        generation_id: String,
        /// The limits' state, when the conflict showed only in the lifecycle admission
        /// (a concurrent request took the key after the limits were checked).
        limits: Option<LimitState>,
    },
    /// The resolved model has no queue on this replica.
    #[error("The model is not served.")]
    ModelNotServed,
    /// A readmitted request's stored model version is no longer configured; its record is
    /// rejected.
    #[error("The model version this request resolved to is no longer served.")]
    StoredModelGone,
    /// A per-principal limit refused, or could not be checked.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// The prompt could not be admitted by its measure.
    #[error("{error}")]
    Measure {
        /// Why.
        error: MeasureError,
        /// The limits' state, taken before measuring, for the answer's headers.
        limits: LimitState,
    },
    /// The principal's burst bucket is empty.
    #[error("Too many generations in a short burst.")]
    Burst {
        /// Whole seconds until the bucket has a token.
        retry_after_secs: u64,
        /// The limits' state, for the answer's headers.
        limits: LimitState,
    },
    /// The principal has its maximum of active generations (the lifecycle's count).
    #[error("{limit} generations are already active; wait for one to finish.")]
    Active {
        /// The principal's limit.
        limit: u32,
        /// The limits' state, for the answer's headers.
        limits: LimitState,
    },
    /// The principal's messages for the current window are used or reserved.
    #[error("Your current message allowance has been used.")]
    Messages {
        /// Messages per window.
        limit: u32,
        /// Left in this window.
        remaining: u32,
        /// When the next window starts, in ms since the epoch.
        reset_at_ms: i64,
        /// Whole seconds until then.
        retry_after_secs: u64,
        /// The limits' state, for the answer's headers.
        limits: LimitState,
    },
}

impl AdmissionError {
    /// The limits' state the refusal carries, for its headers.
    pub fn limits(&self) -> Option<LimitState> {
        match self {
            Self::Limit(e) => e.state(),
            Self::Measure { limits, .. }
            | Self::Burst { limits, .. }
            | Self::Active { limits, .. }
            | Self::Messages { limits, .. } => Some(*limits),
            Self::Conflict { limits, .. } => *limits,
            Self::StoreUnavailable | Self::ModelNotServed | Self::StoredModelGone => None,
        }
    }
}
