//! The generation lifecycle (SPEC section 5): one logical generation per (principal,
//! Idempotency-Key), its attempts, its message reservation and its concurrency slot.
//!
//! Every change to a generation record goes through [`apply`], a pure transition function;
//! the stores (SQLite, PostgreSQL, in memory) load the record under a lock, call it, and
//! write the record and the counters named by its [`Effect`]s back in the same transaction.
//! One rule set therefore decides for the actor, the HTTP handlers, the sweeper and every
//! backend, and the property tests exercise exactly the rules production runs.
//!
//! ```text
//!                 admit (reserve message, take slot)
//!                          │
//!        ┌──────────── queued ◀──────────────┐ readmit (same key, same fingerprint)
//!        │ reject          │ accept (node)    │
//!        ▼                 ▼                  │
//!    rejected ─────────────┼──────────────────┘
//!   (released,          running ── finish (node's done, this epoch) ──▶ completed
//!    retryable)            │                                           cancelled
//!                          │ lease expired / nothing running           failed
//!                          └── finish (server) ──────────────────────▶ cancelled / failed
//! ```
//!
//! Who may move a record: the node (through its frames, checked against the current attempt
//! epoch): accept, refuse, finish; the owning generation actor: dispatch, lease expiry,
//! reject, server-side finish when nothing can be running; the API: request cancel; the
//! sweeper: expire when the slot's bound passed.

pub mod admission;
pub mod memory;
#[cfg(test)]
mod tests;

use std::fmt::Debug;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use admission::{Bucket, Decision, MessagePolicy, NewGeneration, WindowCounters, window_start};

/// Where a generation is. `Completed`, `Cancelled` and `Failed` are terminal and never change
/// again; `Rejected` is a failed admission (nothing ran, the message was released) that the
/// same key may admit again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Admitted, waiting for a node to accept it.
    Queued,
    /// A node accepted it (or proved it by streaming).
    Running,
    /// The node finished it.
    Completed,
    /// Stopped on request, confirmed by the node or by fencing its attempt.
    Cancelled,
    /// Ended by a failure after it may have started.
    Failed,
    /// Refused before anything started; retryable with the same key.
    Rejected,
}

impl Status {
    /// The stored and rendered name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
            Self::Rejected => "rejected",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "completed" => Self::Completed,
            "cancelled" => Self::Cancelled,
            "failed" => Self::Failed,
            "rejected" => Self::Rejected,
            _ => return None,
        })
    }

    /// Completed, cancelled or failed: never changes again, never reruns.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Cancelled | Self::Failed)
    }

    /// Holds a concurrency slot (queued or running).
    pub fn is_active(self) -> bool {
        matches!(self, Self::Queued | Self::Running)
    }
}

/// The message reservation taken at admission: consumed once a node accepts, released only
/// on a proven pre-acceptance failure, never both, each at most once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    /// Counted in its window's `reserved`.
    Reserved,
    /// Moved to its window's `used`.
    Consumed,
    /// Given back.
    Released,
}

impl MessageState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Consumed => "consumed",
            Self::Released => "released",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "reserved" => Self::Reserved,
            "consumed" => Self::Consumed,
            "released" => Self::Released,
            _ => return None,
        })
    }
}

/// What is known of the current attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    /// No attempt was dispatched yet (attempt 0).
    None,
    /// Sent to a node; it may or may not have started.
    Dispatched,
    /// The node accepted it (its `accepted` frame, or output proving it).
    Accepted,
    /// The node refused it before starting (proven never started), or the server refused it
    /// before believing anything from it (its ledger row was refused after the work went
    /// out): never billed either way.
    Refused,
    /// Its lease expired: whatever it still computes is rejected and it stops on its own.
    Fenced,
}

impl AttemptState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Dispatched => "dispatched",
            Self::Accepted => "accepted",
            Self::Refused => "refused",
            Self::Fenced => "fenced",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Self::None,
            "dispatched" => Self::Dispatched,
            "accepted" => Self::Accepted,
            "refused" => Self::Refused,
            "fenced" => Self::Fenced,
            _ => return None,
        })
    }

    /// Whether the attempt may still be computing somewhere.
    pub fn may_run(self) -> bool {
        matches!(self, Self::Dispatched | Self::Accepted)
    }
}

/// One logical generation as the store keeps it. It holds no prompt: only a fingerprint of
/// the request's semantic inputs, and the output while it is retained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationRecord {
    /// `gen_…` (Generations API) or `chatcmpl-…` (chat completions); also the key of its
    /// first ledger row.
    pub id: String,
    /// The principal (key or JWT subject) that owns it.
    pub subject: String,
    /// The client's Idempotency-Key.
    pub idempotency_key: String,
    /// SHA-256 of the normalized request.
    pub fingerprint: String,
    /// The model version the request resolved to at admission (never an alias).
    pub model: String,
    /// The key of the current admission's ledger row: the id itself, or `{id}#{n}` after a
    /// readmission (the first admission's row is final by then). A `done` that arrives after
    /// the generation's actor is gone settles this row.
    pub ledger_id: String,
    /// Where it is.
    pub status: Status,
    /// A cancel was requested and not yet confirmed.
    pub cancel_requested: bool,
    /// The current attempt epoch (0 before the first dispatch).
    pub attempt: u64,
    /// What is known of the current attempt.
    pub attempt_state: AttemptState,
    /// The message reservation.
    pub message: MessageState,
    /// Start of the quota window the reservation belongs to, forever.
    pub window_start_ms: i64,
    /// Holds one of the principal's concurrency slots.
    pub slot_held: bool,
    /// The slot's bound: after this the sweeper expires the generation.
    pub slot_expires_ms: i64,
    /// Prompt tokens the engine counted (when finished).
    pub input_tokens: u64,
    /// Completion tokens the engine counted (when finished).
    pub output_tokens: u64,
    /// The output text while retained.
    pub output: Option<String>,
    /// Beside the text while retained: reasoning and tool calls, as JSON (see
    /// `crate::output::Assembled::extra_json`); `None` when the answer had neither.
    pub output_extra: Option<String>,
    /// Why it failed or was rejected.
    pub error_code: Option<String>,
    /// The engine's finish reason (`stop`, `length`, `abort`, …) when the node reported one.
    pub finish_reason: Option<String>,
    /// Admission time.
    pub created_ms: i64,
    /// When it reached a terminal state (or was rejected).
    pub terminal_ms: Option<i64>,
}

impl GenerationRecord {
    /// The status as the API shows it: a pending cancel reads `cancel_requested`.
    pub fn api_status(&self) -> &'static str {
        if self.cancel_requested && self.status.is_active() {
            "cancel_requested"
        } else {
            self.status.as_str()
        }
    }
}

/// How a generation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The model finished (`stop` or `length`).
    Completed,
    /// Stopped on request.
    Cancelled,
    /// Failed with this API error code.
    Failed(String),
}

/// A change requested of a generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The owner sends attempt `attempt` to a node. Allowed only when no earlier attempt may
    /// still run (never dispatched, refused, or fenced) and no cancel is pending.
    Dispatch {
        /// The new epoch, greater than every earlier one.
        attempt: u64,
    },
    /// The node accepted the attempt (`accepted`, or a chunk or `done` proving it).
    Accept {
        /// The frame's epoch.
        attempt: u64,
    },
    /// The node refused the attempt before starting it, or the server did before believing
    /// any frame of it.
    Refuse {
        /// The frame's epoch.
        attempt: u64,
    },
    /// The client asked to stop.
    RequestCancel,
    /// The attempt's lease expired without its node confirming anything: fenced.
    LeaseExpired {
        /// The fenced epoch.
        attempt: u64,
    },
    /// The end. From the node (`from_node`), only for the current, running attempt; from the
    /// server, only when nothing can be running.
    Finish {
        /// The epoch the end belongs to.
        attempt: u64,
        /// Whether the node reported it (its `done`).
        from_node: bool,
        /// How it ended.
        outcome: Outcome,
        /// Prompt tokens.
        input_tokens: u64,
        /// Completion tokens.
        output_tokens: u64,
        /// The output, when retained.
        output: Option<String>,
        /// Reasoning and tool calls of the output, when retained and present.
        output_extra: Option<String>,
        /// The engine's finish reason, when the node reported one.
        finish_reason: Option<String>,
    },
    /// Admission failed before anything started (queue full, no node, balance, queue
    /// deadline, every attempt refused): the message is released and the key may retry.
    Reject {
        /// The API error code.
        code: String,
    },
    /// The sweeper found it active past its slot's bound.
    Expire,
}

/// Counter changes the store applies with the record, in the same transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// `reserved - 1, used + 1` in the window the reservation belongs to.
    ConsumeMessage {
        /// That window.
        window_start_ms: i64,
    },
    /// `reserved - 1` in that window.
    ReleaseMessage {
        /// That window.
        window_start_ms: i64,
    },
}

/// Why an event changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// From an older (or unknown) attempt, or a fenced one: rejected.
    #[error("stale attempt")]
    Stale,
    /// The generation already ended (or was rejected); it never moves again.
    #[error("already final")]
    Final,
    /// Not allowed in the current state.
    #[error("not allowed: {0}")]
    NotAllowed(&'static str),
}

/// Applies `event` to `rec` at `now_ms`. On `Err` the record is unchanged.
pub fn apply(
    rec: &mut GenerationRecord,
    event: &Event,
    now_ms: i64,
) -> Result<Vec<Effect>, Refusal> {
    if rec.status.is_terminal() || rec.status == Status::Rejected {
        return Err(Refusal::Final);
    }
    let mut effects = Vec::new();
    match event {
        Event::Dispatch { attempt } => {
            if *attempt <= rec.attempt {
                return Err(Refusal::Stale);
            }
            if rec.attempt_state.may_run() {
                return Err(Refusal::NotAllowed("an earlier attempt may still run"));
            }
            if rec.cancel_requested {
                return Err(Refusal::NotAllowed("a cancel is pending"));
            }
            rec.attempt = *attempt;
            rec.attempt_state = AttemptState::Dispatched;
        }
        Event::Accept { attempt } => {
            current_running(rec, *attempt)?;
            accept(rec, &mut effects);
        }
        Event::Refuse { attempt } => {
            current_running(rec, *attempt)?;
            if rec.attempt_state == AttemptState::Accepted {
                return Err(Refusal::NotAllowed("the attempt was accepted"));
            }
            rec.attempt_state = AttemptState::Refused;
        }
        Event::RequestCancel => rec.cancel_requested = true,
        Event::LeaseExpired { attempt } => {
            current_running(rec, *attempt)?;
            // Nothing proved it started, but nothing proved it did not: a lost `accepted`
            // can hide a running prefill. The message is spent, and the generation can no
            // longer be rejected as never started.
            if rec.message == MessageState::Reserved {
                rec.message = MessageState::Consumed;
                effects.push(Effect::ConsumeMessage {
                    window_start_ms: rec.window_start_ms,
                });
            }
            rec.attempt_state = AttemptState::Fenced;
        }
        Event::Finish {
            attempt,
            from_node,
            outcome,
            input_tokens,
            output_tokens,
            output,
            output_extra,
            finish_reason,
        } => {
            if *from_node {
                current_running(rec, *attempt)?;
            } else if rec.attempt_state.may_run() {
                return Err(Refusal::NotAllowed("the node has not confirmed the stop"));
            } else if *attempt != rec.attempt {
                return Err(Refusal::Stale);
            }
            if *outcome == Outcome::Cancelled && !rec.cancel_requested {
                return Err(Refusal::NotAllowed("no cancel was requested"));
            }
            if *outcome == Outcome::Completed && !from_node {
                return Err(Refusal::NotAllowed("only the node completes"));
            }
            if *from_node {
                // A `done` proves the attempt ran.
                accept(rec, &mut effects);
            }
            release_if_reserved(rec, &mut effects);
            rec.status = match outcome {
                Outcome::Completed => Status::Completed,
                Outcome::Cancelled => Status::Cancelled,
                Outcome::Failed(code) => {
                    rec.error_code = Some(code.clone());
                    Status::Failed
                }
            };
            rec.input_tokens = *input_tokens;
            rec.output_tokens = *output_tokens;
            rec.output = output.clone();
            rec.output_extra = output_extra.clone();
            rec.finish_reason = finish_reason.clone();
            end(rec, now_ms);
        }
        Event::Reject { code } => {
            if rec.attempt_state.may_run() {
                return Err(Refusal::NotAllowed("an attempt may still run"));
            }
            if rec.message != MessageState::Reserved {
                return Err(Refusal::NotAllowed("the message was consumed"));
            }
            release_if_reserved(rec, &mut effects);
            rec.status = Status::Rejected;
            rec.error_code = Some(code.clone());
            end(rec, now_ms);
        }
        Event::Expire => {
            if now_ms < rec.slot_expires_ms {
                return Err(Refusal::NotAllowed("the slot's bound has not passed"));
            }
            if rec.message == MessageState::Reserved {
                // Dispatched work may have run: a timeout is no proof it did not.
                if rec.attempt_state == AttemptState::None {
                    release_if_reserved(rec, &mut effects);
                } else {
                    rec.message = MessageState::Consumed;
                    effects.push(Effect::ConsumeMessage {
                        window_start_ms: rec.window_start_ms,
                    });
                }
            }
            if rec.attempt_state.may_run() {
                rec.attempt_state = AttemptState::Fenced;
            }
            rec.status = Status::Failed;
            rec.error_code = Some("generation_timeout".into());
            end(rec, now_ms);
        }
    }
    Ok(effects)
}

/// The event's attempt is the current one and may be running.
fn current_running(rec: &GenerationRecord, attempt: u64) -> Result<(), Refusal> {
    if attempt != rec.attempt || !rec.attempt_state.may_run() {
        return Err(Refusal::Stale);
    }
    Ok(())
}

fn accept(rec: &mut GenerationRecord, effects: &mut Vec<Effect>) {
    rec.attempt_state = AttemptState::Accepted;
    rec.status = Status::Running;
    if rec.message == MessageState::Reserved {
        rec.message = MessageState::Consumed;
        effects.push(Effect::ConsumeMessage {
            window_start_ms: rec.window_start_ms,
        });
    }
}

/// A reservation still held at the end was never proven used: nothing was accepted.
fn release_if_reserved(rec: &mut GenerationRecord, effects: &mut Vec<Effect>) {
    if rec.message == MessageState::Reserved {
        rec.message = MessageState::Released;
        effects.push(Effect::ReleaseMessage {
            window_start_ms: rec.window_start_ms,
        });
    }
}

fn end(rec: &mut GenerationRecord, now_ms: i64) {
    rec.slot_held = false;
    rec.terminal_ms = Some(now_ms);
}

/// The result of [`GenerationStore::apply_generation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The record after the event (unchanged when refused).
    pub record: GenerationRecord,
    /// What the transition said.
    pub result: Result<Vec<Effect>, Refusal>,
}

/// The generation store failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LifecycleError {
    /// The database could not be reached or the transaction failed.
    #[error("generation store unavailable: {0}")]
    Unavailable(String),
    /// No such generation.
    #[error("unknown generation")]
    Unknown,
}

/// Where generation records, quota windows and burst buckets live (SPEC section 9).
#[async_trait]
pub trait GenerationStore: Send + Sync + Debug + 'static {
    /// The idempotency check and admission in one transaction: an existing record for the
    /// (subject, key) is returned as it is (or readmitted when it was rejected and the
    /// fingerprint matches); otherwise the concurrency slots, the burst bucket and the
    /// message window are checked and, when all pass, the record is created with its message
    /// reserved and its slot held.
    async fn admit_generation(
        &self,
        new: &NewGeneration,
        policy: &MessagePolicy,
        now_ms: i64,
    ) -> Result<Decision, LifecycleError>;

    /// The record of (subject, key), if any.
    async fn find_generation(
        &self,
        subject: &str,
        idempotency_key: &str,
    ) -> Result<Option<GenerationRecord>, LifecycleError>;

    /// The record `id`, if any.
    async fn get_generation(&self, id: &str) -> Result<Option<GenerationRecord>, LifecycleError>;

    /// Applies `event` to record `id` with [`apply`] and its effects, atomically.
    async fn apply_generation(
        &self,
        id: &str,
        event: &Event,
        now_ms: i64,
    ) -> Result<Applied, LifecycleError>;

    /// Expires active generations past their slot's bound ([`Event::Expire`]) and forgets the
    /// output of those terminal for longer than `retention_ms`. Returns how many expired.
    async fn sweep_generations(
        &self,
        now_ms: i64,
        retention_ms: i64,
    ) -> Result<u64, LifecycleError>;

    /// The principal's counters in one window (for the API's details and for tests).
    async fn message_window(
        &self,
        subject: &str,
        window_start_ms: i64,
    ) -> Result<WindowCounters, LifecycleError>;
}
