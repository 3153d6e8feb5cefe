//! Admission limits checked in the coordinator, cheapest first (SPEC section 4): concurrent
//! streams per key (`streams:{key_id}`, a bounded set whose members expire so a crashed
//! replica cannot hold places), then requests per minute (`rl:{key_id}:rpm`, an exact
//! sliding window). Every answer carries the `x-ratelimit-*` headers; a coordinator that
//! cannot be reached fails admission closed.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use switchyard_actors::error::{ErrorCode, Failure};
use switchyard_actors::generation::EndHook;
use switchyard_actors::ports::{Clock, Coordinator};

use crate::auth::Principal;
use crate::http::error::ApiError;

/// The rpm window.
const MINUTE: Duration = Duration::from_secs(60);

/// What the limits said about one request, for its response headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateHeaders {
    /// `(limit, remaining, reset in ms)` of the rpm window, when the key has one.
    pub requests: Option<(u32, u32, u64)>,
    /// `(limit, remaining)` of tokens per day, when the key has one.
    pub tokens: Option<(u64, u64)>,
}

impl RateHeaders {
    /// Writes the `x-ratelimit-*` headers.
    pub fn apply(&self, headers: &mut HeaderMap) {
        let mut put = |name: &'static str, value: String| {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        };
        if let Some((limit, remaining, reset_ms)) = self.requests {
            put("x-ratelimit-limit-requests", limit.to_string());
            put("x-ratelimit-remaining-requests", remaining.to_string());
            put(
                "x-ratelimit-reset-requests",
                format!("{}s", reset_ms.div_ceil(1000)),
            );
        }
        if let Some((limit, remaining)) = self.tokens {
            put("x-ratelimit-limit-tokens", limit.to_string());
            put("x-ratelimit-remaining-tokens", remaining.to_string());
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

fn unavailable() -> ApiError {
    ApiError::from(
        Failure::new(
            ErrorCode::QuotaServiceUnavailable,
            "Limits cannot be checked right now; nothing was admitted.",
        )
        .retry_after(1),
    )
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

    /// Takes a stream place and an rpm entry for `request_id`, or refuses. On success the
    /// returned hook gives the stream place back when the generation ends.
    pub async fn admit(
        &self,
        who: &Principal,
        request_id: &str,
    ) -> Result<(RateHeaders, Option<EndHook>), ApiError> {
        let now_ms = self.clock.wall().timestamp_millis();
        let key_id = &who.subject;
        let mut headers = RateHeaders::default();
        let mut hook = None;
        if let Some(max) = who.max_streams {
            let slots = format!("streams:{key_id}");
            let v = self
                .coordinator
                .acquire_slot(&slots, request_id, max, now_ms, self.slot_ttl)
                .await
                .map_err(|_| unavailable())?;
            if !v.admitted {
                return Err(ApiError::from(
                    Failure::new(
                        ErrorCode::ConcurrencyLimited,
                        format!("This key already has {max} generations running."),
                    )
                    .retry_after(1),
                ));
            }
            hook = Some(self.release_hook(slots, request_id));
        }
        if let Some(rpm) = who.rpm {
            let window = format!("rl:{key_id}:rpm");
            let verdict = self
                .coordinator
                .window_admit(&window, request_id, now_ms, MINUTE, rpm)
                .await;
            let v = match verdict {
                Ok(v) => v,
                Err(_) => {
                    if let Some(h) = hook {
                        (h.0)();
                    }
                    return Err(unavailable());
                }
            };
            headers.requests = Some((rpm, rpm.saturating_sub(v.count), v.wait_ms));
            if !v.admitted {
                if let Some(h) = hook {
                    (h.0)();
                }
                let mut err = ApiError::from(
                    Failure::new(
                        ErrorCode::RateLimited,
                        format!("Over {rpm} requests per minute."),
                    )
                    .retry_after(v.wait_ms.div_ceil(1000).max(1)),
                );
                err.details = Some(Box::new(serde_json::json!({"limit": rpm, "remaining": 0})));
                return Err(err.with_rate_headers(headers));
            }
        }
        if let Some(tpd) = who.tokens_per_day {
            headers.tokens = Some((tpd, tpd));
        }
        Ok((headers, hook))
    }

    fn release_hook(&self, slots: String, request_id: &str) -> EndHook {
        let coordinator = self.coordinator.clone();
        let member = request_id.to_owned();
        EndHook(Box::new(move || {
            tokio::spawn(async move {
                if let Err(e) = coordinator.release_slot(&slots, &member).await {
                    tracing::warn!(error = %e, "could not release a stream place; it expires on its own");
                }
            });
        }))
    }
}
