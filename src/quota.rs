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
    /// `(limit, remaining, reset in ms)` of tokens per day (the reset: the next UTC midnight),
    /// when the key has one.
    pub tokens: Option<(u64, u64, u64)>,
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
            put("x-ratelimit-reset-requests", reset_duration(reset_ms));
        }
        if let Some((limit, remaining, reset_ms)) = self.tokens {
            put("x-ratelimit-limit-tokens", limit.to_string());
            put("x-ratelimit-remaining-tokens", remaining.to_string());
            put("x-ratelimit-reset-tokens", reset_duration(reset_ms));
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
fn unavailable(check: &'static str, cause: &dyn std::fmt::Display) -> ApiError {
    tracing::error!(error = %cause, check, "coordinator unreachable at admission");
    ApiError::unavailable("Limits cannot be checked right now; nothing was admitted.")
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
    ) -> Result<(RateHeaders, Option<EndHook>), ApiError> {
        let now = self.clock.wall();
        let now_ms = now.timestamp_millis();
        let subject = &who.subject;
        let mut headers = RateHeaders::default();
        let slots = who.max_streams.map(|_| format!("streams:{subject}"));
        let day = who
            .tokens_per_day
            .map(|_| format!("tpd:{subject}:{}", now.format("%Y-%m-%d")));
        let hook = (slots.is_some() || day.is_some())
            .then(|| self.end_hook(slots.clone(), day.clone(), request_id));
        // Gives back what was taken when a later check refuses.
        let refuse = |hook: Option<EndHook>, err: ApiError| {
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
                return Err(ApiError::from(
                    Failure::new(
                        ErrorCode::ConcurrencyLimited,
                        format!("This key already has {max} generations running."),
                    )
                    .retry_after(1),
                ));
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
            headers.requests = Some((rpm, rpm.saturating_sub(v.count), v.wait_ms));
            if !v.admitted {
                let mut err = ApiError::from(
                    Failure::new(
                        ErrorCode::RateLimited,
                        format!("Over {rpm} requests per minute."),
                    )
                    .retry_after(v.wait_ms.div_ceil(1000).max(1)),
                );
                err.details = Some(Box::new(serde_json::json!({"limit": rpm, "remaining": 0})));
                return refuse(hook, err.with_rate_headers(headers));
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
            headers.tokens = Some((tpd, tpd.saturating_sub(used), reset_ms));
            if used >= tpd {
                let wait = reset.map_or(3600, |r| (r - now).num_seconds().max(1).unsigned_abs());
                let mut err = ApiError::from(
                    Failure::new(
                        ErrorCode::QuotaExhausted,
                        format!("The key's {tpd} tokens for today are spent."),
                    )
                    .retry_after(wait),
                );
                err.details = Some(Box::new(serde_json::json!({
                    "limit": tpd, "remaining": 0, "reset_at": reset.map(|r| r.to_rfc3339()),
                })));
                return refuse(hook, err.with_rate_headers(headers));
            }
        }
        Ok((headers, hook))
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

#[cfg(test)]
mod tests {
    use super::reset_duration;

    #[test]
    fn reset_durations_are_written_as_openai_writes_them() {
        assert_eq!(reset_duration(0), "0ms");
        assert_eq!(reset_duration(20), "20ms");
        assert_eq!(reset_duration(999), "999ms");
        assert_eq!(reset_duration(1000), "1s");
        assert_eq!(reset_duration(1001), "2s");
        assert_eq!(reset_duration(54_000), "54s");
        assert_eq!(reset_duration(360_000), "6m0s");
        assert_eq!(reset_duration(47_025_000), "13h3m45s");
    }
}
