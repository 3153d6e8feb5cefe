//! Faults the simulator can be told to show, by flag at start or at run time through
//! `POST /sim/faults` (merge) and `DELETE /sim/faults` (clear): the failure modes the
//! platform's drills need from a GPU node.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// A fault request, as JSON on `/sim/faults` (every field optional; POST merges).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// Every stream is cut (connection closed, no `[DONE]`) after this many tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash_after_tokens: Option<u32>,
    /// Every stream stops sending after this many tokens and keeps its socket (a hung GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_after_tokens: Option<u32>,
    /// The next K chat requests get HTTP 500.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_500: Option<u32>,
    /// Extra delay before a request's first token, in engine milliseconds (time-scaled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slow_first_token_ms: Option<u64>,
    /// The engine is "loading" for this long from now: `/health` and requests answer 503.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_delay_ms: Option<u64>,
    /// The whole process exits after this delay (a killed pod); 0 means at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_after_ms: Option<u64>,
}

/// The faults in force.
#[derive(Debug, Default)]
pub struct Faults {
    /// See [`FaultSpec::crash_after_tokens`].
    pub crash_after_tokens: Option<u32>,
    /// See [`FaultSpec::stall_after_tokens`].
    pub stall_after_tokens: Option<u32>,
    /// Requests still to fail with 500.
    pub http_500_remaining: u32,
    /// See [`FaultSpec::slow_first_token_ms`].
    pub slow_first_token_ms: Option<u64>,
    /// Until when the engine reports itself loading.
    pub loading_until: Option<Instant>,
}

impl Faults {
    /// Applies a spec on top of the current faults; `time_scale` converts engine time.
    pub fn merge(&mut self, spec: &FaultSpec, time_scale: f64) {
        if spec.crash_after_tokens.is_some() {
            self.crash_after_tokens = spec.crash_after_tokens;
        }
        if spec.stall_after_tokens.is_some() {
            self.stall_after_tokens = spec.stall_after_tokens;
        }
        if let Some(k) = spec.http_500 {
            self.http_500_remaining = k;
        }
        if spec.slow_first_token_ms.is_some() {
            self.slow_first_token_ms = spec.slow_first_token_ms;
        }
        if let Some(ms) = spec.load_delay_ms {
            self.loading_until = Instant::now().checked_add(scaled(ms, time_scale));
        }
    }

    /// Whether the engine is still loading.
    pub fn loading(&self) -> bool {
        self.loading_until.is_some_and(|t| Instant::now() < t)
    }

    /// Takes one HTTP 500 if any are pending.
    pub fn take_http_500(&mut self) -> bool {
        if self.http_500_remaining > 0 {
            self.http_500_remaining -= 1;
            true
        } else {
            false
        }
    }

    /// The faults in force, as the JSON `GET /sim/faults` returns (engine milliseconds).
    pub fn snapshot(&self, time_scale: f64) -> FaultSpec {
        FaultSpec {
            crash_after_tokens: self.crash_after_tokens,
            stall_after_tokens: self.stall_after_tokens,
            http_500: (self.http_500_remaining > 0).then_some(self.http_500_remaining),
            slow_first_token_ms: self.slow_first_token_ms,
            load_delay_ms: self
                .loading_until
                .and_then(|t| t.checked_duration_since(Instant::now()))
                .map(|d| (d.as_secs_f64() * 1000.0 * time_scale) as u64),
            exit_after_ms: None,
        }
    }
}

/// Longest delay a fault may ask for (a year); larger values are clamped.
const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

/// Engine milliseconds to wall-clock time under `--time-scale`, clamped to a year.
pub fn scaled(ms: u64, time_scale: f64) -> Duration {
    Duration::try_from_secs_f64(ms as f64 / 1000.0 / time_scale)
        .map_or(MAX_DELAY, |d| d.min(MAX_DELAY))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn merge_keeps_unmentioned_faults_and_counts_down_500s() {
        let mut f = Faults::default();
        f.merge(
            &FaultSpec {
                http_500: Some(2),
                ..Default::default()
            },
            1.0,
        );
        f.merge(
            &FaultSpec {
                crash_after_tokens: Some(3),
                ..Default::default()
            },
            1.0,
        );
        assert_eq!(f.crash_after_tokens, Some(3));
        assert!(f.take_http_500());
        assert!(f.take_http_500());
        assert!(!f.take_http_500());
    }

    #[test]
    fn unknown_fault_fields_are_rejected() {
        assert!(serde_json::from_str::<FaultSpec>(r#"{"crash_after":1}"#).is_err());
    }
}
