//! The admission decision of the Generations API, as a pure function over what the store
//! read under the principal's lock: the existing record for the key, the principal's active
//! generations, its burst bucket and its message window.
//!
//! Message windows are fixed and UTC-aligned (3 hours by default: 00:00, 03:00, … UTC), so
//! a principal may spend its whole allowance just before a boundary and again just after
//! it. A reservation belongs to the window it was taken in, even when the generation ends
//! after the boundary.

use serde::{Deserialize, Serialize};

use super::{AttemptState, GenerationRecord, MessageState, Status};

/// A principal's message policy (the key's overrides, or the configured defaults). A limit
/// of [`MessagePolicy::UNLIMITED`] never refuses: a full bucket of that size never empties,
/// and no window or slot count reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessagePolicy {
    /// Messages per window.
    pub limit: u32,
    /// Window length; windows start at multiples of it since the Unix epoch (UTC-aligned
    /// when it divides a day).
    pub window_ms: i64,
    /// Burst bucket capacity.
    pub burst_capacity: u32,
    /// One bucket token per this many milliseconds.
    pub burst_refill_ms: i64,
    /// Active (queued or running) generations at once.
    pub max_active: u32,
    /// How long a slot is held at most before the sweeper expires its generation.
    pub slot_ttl_ms: i64,
}

impl MessagePolicy {
    /// No limit.
    pub const UNLIMITED: u32 = u32::MAX;

    /// Whether anything in it can refuse a request for a message reason (quota or burst),
    /// so that every request of the principal must go through a record.
    pub fn meters_messages(&self) -> bool {
        self.limit != Self::UNLIMITED || self.burst_capacity != Self::UNLIMITED
    }
}

impl Default for MessagePolicy {
    fn default() -> Self {
        Self {
            limit: 40,
            window_ms: 3 * 3600 * 1000,
            burst_capacity: 20,
            burst_refill_ms: 3000,
            max_active: 2,
            slot_ttl_ms: 15 * 60 * 1000,
        }
    }
}

/// A new generation's identity, as the handler computed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewGeneration {
    /// `gen_…`.
    pub id: String,
    /// The principal.
    pub subject: String,
    /// The client's Idempotency-Key.
    pub idempotency_key: String,
    /// SHA-256 of the normalized request.
    pub fingerprint: String,
    /// Resolved model version.
    pub model: String,
}

/// A principal's burst bucket: tokens in thousandths, as of `at_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Tokens × 1000.
    pub milli: i64,
    /// When `milli` was computed.
    pub at_ms: i64,
}

impl Bucket {
    /// A full bucket.
    pub fn full(policy: &MessagePolicy, now_ms: i64) -> Self {
        Self {
            milli: i64::from(policy.burst_capacity) * 1000,
            at_ms: now_ms,
        }
    }

    /// The bucket refilled up to `now_ms`.
    pub fn refilled(self, policy: &MessagePolicy, now_ms: i64) -> Self {
        let cap = i64::from(policy.burst_capacity) * 1000;
        let elapsed = now_ms.saturating_sub(self.at_ms).max(0);
        let gained = elapsed.saturating_mul(1000) / policy.burst_refill_ms.max(1);
        Self {
            milli: self.milli.saturating_add(gained).min(cap),
            at_ms: now_ms.max(self.at_ms),
        }
    }
}

/// A principal's counters in one window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WindowCounters {
    /// Messages consumed (accepted by a node).
    pub used: u32,
    /// Messages reserved and not yet consumed or released.
    pub reserved: u32,
}

/// The window `now_ms` falls in.
pub fn window_start(now_ms: i64, window_ms: i64) -> i64 {
    now_ms.div_euclid(window_ms.max(1)) * window_ms.max(1)
}

/// What admission decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new record was created (or a rejected one readmitted): queue it.
    Admitted(GenerationRecord),
    /// The key names an existing generation with the same fingerprint.
    Existing(GenerationRecord),
    /// The key names an existing generation with a different fingerprint.
    Conflict(GenerationRecord),
    /// The burst bucket is empty.
    RateLimited {
        /// When a token will be there.
        retry_after_ms: i64,
    },
    /// The principal has its maximum of active generations.
    ConcurrencyLimited {
        /// The limit.
        limit: u32,
    },
    /// The window's messages are used or reserved.
    QuotaExhausted {
        /// Messages per window.
        limit: u32,
        /// Left in this window (0).
        remaining: u32,
        /// When the next window starts.
        reset_at_ms: i64,
    },
}

/// What the store writes when a request is admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admit {
    /// The record to insert (or to overwrite, for a readmission).
    pub record: GenerationRecord,
    /// The bucket after taking one token.
    pub bucket: Bucket,
    /// The window whose `reserved` grows by one.
    pub window_start_ms: i64,
    /// The existing rejected record is overwritten rather than a new one inserted.
    pub readmit: bool,
}

/// Decides admission. `Ok` means admit and write [`Admit`]; `Err` is the answer to give
/// (nothing is written).
// Both sides carry a record by value: the function runs once per admission, under a lock,
// and its caller returns the `Decision` as is; boxing it would only add an allocation.
#[allow(clippy::result_large_err)]
pub fn decide(
    new: &NewGeneration,
    existing: Option<&GenerationRecord>,
    policy: &MessagePolicy,
    bucket: Option<Bucket>,
    active: u32,
    window: WindowCounters,
    now_ms: i64,
) -> Result<Admit, Decision> {
    let readmit = match existing {
        Some(rec) if rec.fingerprint != new.fingerprint => {
            return Err(Decision::Conflict(rec.clone()));
        }
        Some(rec) if rec.status != Status::Rejected => return Err(Decision::Existing(rec.clone())),
        Some(_) => true,
        None => false,
    };
    if active >= policy.max_active {
        return Err(Decision::ConcurrencyLimited {
            limit: policy.max_active,
        });
    }
    let bucket = bucket
        .unwrap_or_else(|| Bucket::full(policy, now_ms))
        .refilled(policy, now_ms);
    if bucket.milli < 1000 {
        let missing = 1000 - bucket.milli;
        let retry_after_ms = (missing * policy.burst_refill_ms.max(1) + 999) / 1000;
        return Err(Decision::RateLimited { retry_after_ms });
    }
    let start = window_start(now_ms, policy.window_ms);
    let taken = window.used.saturating_add(window.reserved);
    if taken >= policy.limit {
        return Err(Decision::QuotaExhausted {
            limit: policy.limit,
            remaining: 0,
            reset_at_ms: start + policy.window_ms,
        });
    }
    // A readmission's ledger row needs a key of its own: the proposed id is fresh.
    let (id, ledger_id, created_ms) = match existing {
        Some(rec) => (
            rec.id.clone(),
            format!("{}#{}", rec.id, new.id),
            rec.created_ms,
        ),
        None => (new.id.clone(), new.id.clone(), now_ms),
    };
    let record = GenerationRecord {
        id,
        subject: new.subject.clone(),
        idempotency_key: new.idempotency_key.clone(),
        fingerprint: new.fingerprint.clone(),
        model: existing.map_or_else(|| new.model.clone(), |r| r.model.clone()),
        ledger_id,
        status: Status::Queued,
        cancel_requested: false,
        attempt: existing.map_or(0, |r| r.attempt),
        attempt_state: existing.map_or(AttemptState::None, |r| r.attempt_state),
        message: MessageState::Reserved,
        window_start_ms: start,
        slot_held: true,
        slot_expires_ms: now_ms.saturating_add(policy.slot_ttl_ms),
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        error_code: None,
        finish_reason: None,
        created_ms,
        terminal_ms: None,
    };
    Ok(Admit {
        record,
        bucket: Bucket {
            milli: bucket.milli - 1000,
            at_ms: bucket.at_ms,
        },
        window_start_ms: start,
        readmit,
    })
}
