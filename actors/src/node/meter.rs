//! What one connection's heartbeats say about the node's uptime and its engine's work: the
//! seconds and counter growth between consecutive heartbeats, which the socket's replica adds
//! to the node's row of the day (`node_days`, read by the cost and drift reports).

use std::time::Duration;

use crate::metric_names::NODE_REPORT_ANOMALIES_TOTAL;
use crate::protocol::EngineCounters;

/// The heartbeat interval agents use (SPEC section 7).
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// The longest gap between two heartbeats counted as uptime: past it the node was silent,
/// and a silent node is not counted as serving.
pub const MAX_COUNTED_GAP: Duration = HEARTBEAT_INTERVAL.saturating_mul(3);

/// Tokens per second one engine's counter can grow by at most, prompt or generation: far
/// above any node (an 8B replica on an L40S decodes about 1,500 tokens/s and prefills tens
/// of thousands). A step larger than this over the time since the previous heartbeat is not
/// work but a broken or hostile report (a counter jumping 0 ↔ 2^64−1): it is left out of the
/// node's day and counted in `switchyard_node_report_anomalies_total`.
pub const MAX_ENGINE_TOKENS_PER_SECOND: u64 = 1_000_000;

/// What one heartbeat adds to the node's day.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    /// Whole seconds connected since the previous heartbeat (capped, remainder carried).
    pub connected_seconds: u64,
    /// Growth of the engine's prompt-token counter.
    pub prompt_tokens: u64,
    /// Growth of the engine's generation-token counter.
    pub generation_tokens: u64,
    /// Whether this heartbeat carried counters.
    pub counters: bool,
}

/// One connection's meter. The first heartbeat only sets the baseline.
#[derive(Debug, Clone, Default)]
pub struct UptimeMeter {
    /// When the previous heartbeat came (monotonic).
    last: Option<tokio::time::Instant>,
    /// The last counters the engine reported on this connection.
    counters: Option<EngineCounters>,
    /// Time counted but not yet reported (under a second).
    carry: Duration,
    /// When [`Self::counters`] were read.
    counted_at: Option<tokio::time::Instant>,
}

/// `delta`, unless it is more than `most`: then nothing, counted as an anomaly of `kind`.
fn plausible(delta: u64, most: u64, kind: &'static str) -> u64 {
    if delta <= most {
        return delta;
    }
    tracing::warn!(
        kind,
        delta,
        most,
        "an engine counter grew faster than any engine can; left out of the reports"
    );
    metrics::counter!(NODE_REPORT_ANOMALIES_TOTAL, "kind" => kind).increment(1);
    0
}

/// Growth of a cumulative counter: a value below the previous one means the engine restarted
/// (its counters began again at 0), so all of the new value is growth.
pub fn counter_delta(previous: u64, now: u64) -> u64 {
    if now >= previous { now - previous } else { now }
}

impl UptimeMeter {
    /// A heartbeat at `now` with the engine's `counters`: what it adds, or `None` for the
    /// first heartbeat of the connection. Without counters the previous ones stay the
    /// baseline, so a scrape that missed them loses nothing.
    pub fn beat(
        &mut self,
        now: tokio::time::Instant,
        counters: Option<EngineCounters>,
    ) -> Option<Interval> {
        let previous = self.last.replace(now);
        // The most either counter can have grown since the counters were last read (a whole
        // second at least: heartbeats arrive close together after a reconnect).
        let since = self
            .counted_at
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        let most = MAX_ENGINE_TOKENS_PER_SECOND.saturating_mul(since.as_secs().saturating_add(1));
        let (prompt_tokens, generation_tokens) = match (self.counters, counters) {
            (Some(before), Some(after)) => (
                plausible(
                    counter_delta(before.prompt_tokens, after.prompt_tokens),
                    most,
                    "prompt_counter",
                ),
                plausible(
                    counter_delta(before.generation_tokens, after.generation_tokens),
                    most,
                    "generation_counter",
                ),
            ),
            _ => (0, 0),
        };
        if counters.is_some() {
            self.counted_at = Some(now);
        }
        if counters.is_some() {
            self.counters = counters;
        }
        let previous = previous?;
        let counted = now
            .saturating_duration_since(previous)
            .min(MAX_COUNTED_GAP)
            .saturating_add(self.carry);
        self.carry = Duration::from_nanos(u64::from(counted.subsec_nanos()));
        Some(Interval {
            connected_seconds: counted.as_secs(),
            prompt_tokens,
            generation_tokens,
            counters: counters.is_some(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn c(prompt_tokens: u64, generation_tokens: u64) -> Option<EngineCounters> {
        Some(EngineCounters {
            prompt_tokens,
            generation_tokens,
        })
    }

    #[test]
    fn the_first_heartbeat_is_only_a_baseline() {
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        assert_eq!(m.beat(t, c(1000, 500)), None);
        let i = m.beat(t + Duration::from_secs(5), c(1010, 530)).unwrap();
        assert_eq!(
            i,
            Interval {
                connected_seconds: 5,
                prompt_tokens: 10,
                generation_tokens: 30,
                counters: true
            }
        );
    }

    #[test]
    fn a_lower_counter_is_an_engine_restart() {
        assert_eq!(counter_delta(100, 130), 30);
        assert_eq!(counter_delta(100, 100), 0);
        assert_eq!(counter_delta(100, 7), 7);
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        m.beat(t, c(900, 900));
        let i = m.beat(t + Duration::from_secs(5), c(4, 12)).unwrap();
        assert_eq!((i.prompt_tokens, i.generation_tokens), (4, 12));
    }

    #[test]
    fn counters_jumping_to_the_top_and_back_add_nothing() {
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        m.beat(t, c(0, 0));
        let mut added = (0, 0);
        for k in 1..=20u64 {
            let v = if k % 2 == 1 { u64::MAX } else { 0 };
            let i = m.beat(t + Duration::from_secs(5 * k), c(v, v)).unwrap();
            added.0 += i.prompt_tokens;
            added.1 += i.generation_tokens;
        }
        assert_eq!(added, (0, 0), "no step of 2^64-1 in 5 s is work");
        // Real work after it counts again, and a long silence allows more growth.
        let i = m.beat(t + Duration::from_secs(105), c(1500, 7500)).unwrap();
        assert_eq!((i.prompt_tokens, i.generation_tokens), (1500, 7500));
        let i = m
            .beat(t + Duration::from_secs(705), c(1500 + 500_000_000, 7500))
            .unwrap();
        assert_eq!(i.prompt_tokens, 500_000_000, "600 s allow 6 * 10^8");
        let i = m
            .beat(
                t + Duration::from_secs(710),
                c(1500 + 500_000_000 + 7_000_000, 7500),
            )
            .unwrap();
        assert_eq!(i.prompt_tokens, 0, "7 * 10^6 in 5 s is not");
    }

    #[test]
    fn a_silent_gap_counts_at_most_three_intervals() {
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        m.beat(t, None);
        let i = m.beat(t + Duration::from_secs(600), None).unwrap();
        assert_eq!(i.connected_seconds, 15);
        assert!(!i.counters);
        assert_eq!((i.prompt_tokens, i.generation_tokens), (0, 0));
    }

    #[test]
    fn fractions_of_a_second_are_carried_not_lost() {
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        m.beat(t, None);
        let mut total = 0;
        for k in 1..=4 {
            total += m
                .beat(t + Duration::from_millis(2500 * k), None)
                .unwrap()
                .connected_seconds;
        }
        assert_eq!(total, 10);
    }

    #[test]
    fn a_heartbeat_without_counters_keeps_the_baseline() {
        let t = tokio::time::Instant::now();
        let mut m = UptimeMeter::default();
        m.beat(t, c(10, 10));
        let i = m.beat(t + Duration::from_secs(5), None).unwrap();
        assert_eq!(
            (i.prompt_tokens, i.generation_tokens, i.counters),
            (0, 0, false)
        );
        let i = m.beat(t + Duration::from_secs(10), c(15, 20)).unwrap();
        assert_eq!((i.prompt_tokens, i.generation_tokens), (5, 10));
    }
}
