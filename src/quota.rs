//! Admission limits checked in the coordinator, cheapest first (SPEC section 4): concurrent
//! streams per key (`streams:{key_id}`, a bounded set whose members expire so a crashed
//! replica cannot hold places), then requests per minute (`rl:{key_id}:rpm`, an exact
//! sliding window), then tokens per UTC day. Every answer carries where the principal stands
//! ([`LimitState`], the HTTP layer's `x-ratelimit-*` headers); a coordinator that cannot be
//! reached fails admission closed.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use switchyard_actors::generation::EndHook;
pub use switchyard_actors::ports::admission::LimitState;
use switchyard_actors::ports::{Clock, Coordinator};

use crate::auth::Principal;

/// The rpm window.
const MINUTE: Duration = Duration::from_secs(60);

/// Why a principal's limits refused a request. Each variant carries what the client is
/// told with it; the HTTP layer renders it (`src/http/error/domain.rs`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// The principal already has its maximum of concurrent generations.
    #[error("This key already has {max} generations running.")]
    Streams {
        /// The principal's `max_streams`.
        max: u32,
    },
    /// The requests-per-minute window is full.
    #[error("Over {limit} requests per minute.")]
    Requests {
        /// The principal's rpm.
        limit: u32,
        /// Whole seconds until the window has room.
        retry_after_secs: u64,
        /// The limits as they stood, for the answer's headers.
        state: LimitState,
    },
    /// The principal's tokens for the UTC day are spent.
    #[error("The key's {limit} tokens for today are spent.")]
    TokensPerDay {
        /// The principal's tokens per day.
        limit: u64,
        /// Whole seconds until the next UTC day.
        retry_after_secs: u64,
        /// When the day's counter resets (the next UTC midnight).
        reset_at: Option<DateTime<Utc>>,
        /// The limits as they stood, for the answer's headers.
        state: LimitState,
    },
    /// The coordinator could not be reached: admission fails closed. The cause is logged
    /// where it happened, once, and never shown.
    #[error("Limits cannot be checked right now; nothing was admitted.")]
    Unavailable {
        /// Which check could not be made.
        check: &'static str,
    },
}

impl LimitError {
    /// The limits' state the refusal carries, for its headers.
    pub fn state(&self) -> Option<LimitState> {
        match self {
            Self::Requests { state, .. } | Self::TokensPerDay { state, .. } => Some(*state),
            Self::Streams { .. } | Self::Unavailable { .. } => None,
        }
    }
}

/// Checks and takes the per-key limits.
#[derive(Debug, Clone)]
pub struct Limits {
    coordinator: Arc<dyn Coordinator>,
    clock: Arc<dyn Clock>,
    /// How long a stream's place is held at most (the longest request plus slack).
    slot_ttl: Duration,
}

/// The fail-closed answer when the coordinator cannot be reached; the cause is logged here,
/// once, and never shown.
fn unavailable(check: &'static str, cause: &dyn std::fmt::Display) -> LimitError {
    tracing::error!(error = %cause, check, "coordinator unreachable at admission");
    LimitError::Unavailable { check }
}

impl Limits {
    /// Limits kept in `coordinator`; a stream's place expires after `slot_ttl`.
    pub fn new(
        coordinator: Arc<dyn Coordinator>,
        clock: Arc<dyn Clock>,
        slot_ttl: Duration,
    ) -> Self {
        Self {
            coordinator,
            clock,
            slot_ttl,
        }
    }

    /// Checks the principal's limits, cheapest first, and takes a stream place. On success
    /// the returned hook gives the place back and counts the settled tokens when the
    /// generation ends.
    pub async fn admit(
        &self,
        who: &Principal,
        request_id: &str,
    ) -> Result<(LimitState, Option<EndHook>), LimitError> {
        let now = self.clock.wall();
        let now_ms = now.timestamp_millis();
        let subject = &who.subject;
        let mut state = LimitState::default();
        let slots = who.max_streams.map(|_| format!("streams:{subject}"));
        let day = who
            .tokens_per_day
            .map(|_| format!("tpd:{subject}:{}", now.format("%Y-%m-%d")));
        let hook = (slots.is_some() || day.is_some())
            .then(|| self.end_hook(slots.clone(), day.clone(), request_id));
        // Gives back what was taken when a later check refuses.
        let refuse = |hook: Option<EndHook>, err: LimitError| {
            if let Some(h) = hook {
                h.run(None);
            }
            Err(err)
        };
        if let (Some(max), Some(slots)) = (who.max_streams, &slots) {
            let v = match self
                .coordinator
                .acquire_slot(slots, request_id, max, now_ms, self.slot_ttl)
                .await
            {
                Ok(v) => v,
                Err(e) => return Err(unavailable("max_streams", &e)),
            };
            if !v.admitted {
                return Err(LimitError::Streams { max });
            }
        }
        if let Some(rpm) = who.rpm {
            let window = format!("rl:{subject}:rpm");
            let v = match self
                .coordinator
                .window_admit(&window, request_id, now_ms, MINUTE, rpm)
                .await
            {
                Ok(v) => v,
                Err(e) => return refuse(hook, unavailable("rpm", &e)),
            };
            state.requests = Some((rpm, rpm.saturating_sub(v.count), v.wait_ms));
            if !v.admitted {
                let err = LimitError::Requests {
                    limit: rpm,
                    retry_after_secs: v.wait_ms.div_ceil(1000).max(1),
                    state,
                };
                return refuse(hook, err);
            }
        }
        if let (Some(tpd), Some(day)) = (who.tokens_per_day, &day) {
            // Counted at settle; read here (adding 0 creates the day's counter if needed).
            let used = match self.coordinator.incr(day, 0, DAY_COUNTER_TTL).await {
                Ok(n) => u64::try_from(n).unwrap_or(0),
                Err(e) => return refuse(hook, unavailable("tokens_per_day", &e)),
            };
            let reset = (now.date_naive() + chrono::Days::new(1))
                .and_hms_opt(0, 0, 0)
                .map(|t| t.and_utc());
            let reset_ms = reset.map_or(3_600_000, |r| {
                (r - now).num_milliseconds().max(1).unsigned_abs()
            });
            state.tokens = Some((tpd, tpd.saturating_sub(used), reset_ms));
            if used >= tpd {
                let wait = reset.map_or(3600, |r| (r - now).num_seconds().max(1).unsigned_abs());
                let err = LimitError::TokensPerDay {
                    limit: tpd,
                    retry_after_secs: wait,
                    reset_at: reset,
                    state,
                };
                return refuse(hook, err);
            }
        }
        Ok((state, hook))
    }

    /// What runs when the generation ends: its stream place goes back, and the tokens it
    /// settled count against the day.
    fn end_hook(&self, slots: Option<String>, day: Option<String>, request_id: &str) -> EndHook {
        let coordinator = self.coordinator.clone();
        let member = request_id.to_owned();
        EndHook::new(move |settled: Option<u64>| {
            // Outside a runtime (a hook dropped at process exit) the places expire on their own.
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            runtime.spawn(async move {
                if let Some(slots) = slots
                    && let Err(e) = coordinator.release_slot(&slots, &member).await
                {
                    tracing::warn!(error = %e, "could not release a stream place; it expires on its own");
                }
                if let (Some(day), Some(tokens)) = (day, settled) {
                    let by = i64::try_from(tokens).unwrap_or(i64::MAX);
                    if let Err(e) = coordinator.incr(&day, by, DAY_COUNTER_TTL).await {
                        tracing::warn!(error = %e, "could not count tokens against the day");
                    }
                }
            });
        })
    }
}

/// `tpd:{principal}:{YYYY-MM-DD}` lives two days, past the UTC day it counts.
const DAY_COUNTER_TTL: Duration = Duration::from_secs(2 * 24 * 3600);
