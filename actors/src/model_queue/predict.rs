//! When a newcomer would start: the work its line puts before it ([`super::line::Line::
//! work_ahead`]) over the model's service rate, measured per node as the tokens of work
//! dispatched per second and node while work was waiting (a rate taken while the nodes had
//! room would say how much was asked, not how much they can do), times the nodes serving now
//! (a rate kept for the whole model would still count the nodes a fault took away, and refuse
//! too much once they are back). A request predicted to start past its tier's budget is
//! refused at once, with a `Retry-After` of when it would fit.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// How far back the rate looks.
const WINDOW: Duration = Duration::from_secs(30);
/// The longest a stretch counts for: ticks come every 100 ms, and a longer gap (a paused
/// process, a stalled actor) says nothing of how long work waited.
const LONGEST: Duration = Duration::from_secs(1);
/// Less time under backlog than this in the window: no rate, no prediction (a request is
/// then admitted and held to its budget while it waits).
const ENOUGH: Duration = Duration::from_secs(2);

/// One stretch between two ticks of the queue.
#[derive(Debug, Clone, Copy)]
struct Stretch {
    from: Instant,
    /// Work was waiting when it began.
    backlogged: bool,
    /// Nodes taking work when it began.
    nodes: usize,
    /// Tokens of work dispatched in it.
    tokens: u64,
}

/// The model's measured service rate.
#[derive(Debug, Default)]
pub(super) struct Throughput {
    stretches: VecDeque<Stretch>,
}

impl Throughput {
    /// A tick at `now`: a new stretch begins, backlogged or not, with `nodes` taking work.
    pub(super) fn tick(&mut self, now: Instant, backlogged: bool, nodes: usize) {
        self.stretches.push_back(Stretch {
            from: now,
            backlogged: backlogged && nodes > 0,
            nodes,
            tokens: 0,
        });
        while self
            .stretches
            .get(1)
            .is_some_and(|s| now.saturating_duration_since(s.from) > WINDOW)
        {
            self.stretches.pop_front();
        }
    }

    /// `tokens` of work went to a node.
    pub(super) fn dispatched(&mut self, tokens: u64) {
        if let Some(s) = self.stretches.back_mut() {
            s.tokens = s.tokens.saturating_add(tokens);
        }
    }

    /// Tokens of work per second and node dispatched while work waited, over the window;
    /// `None` until the window holds enough time under backlog.
    pub(super) fn rate_per_node(&self, now: Instant) -> Option<f64> {
        let mut busy = Duration::ZERO;
        let mut node_secs = 0.0;
        let mut tokens = 0u64;
        let ends = self
            .stretches
            .iter()
            .skip(1)
            .map(|s| s.from)
            .chain(std::iter::once(now));
        for (s, end) in self.stretches.iter().zip(ends) {
            if s.backlogged && now.saturating_duration_since(end) <= WINDOW {
                let lasted = end.saturating_duration_since(s.from).min(LONGEST);
                busy += lasted;
                node_secs += lasted.as_secs_f64() * s.nodes as f64;
                tokens = tokens.saturating_add(s.tokens);
            }
        }
        (busy >= ENOUGH && tokens > 0).then(|| tokens as f64 / node_secs)
    }
}

/// When `ahead` tokens of work at `rate` tokens a second are done.
pub(super) fn wait_for(ahead: f64, rate: f64) -> Duration {
    Duration::try_from_secs_f64(ahead / rate).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_rate_counts_only_time_when_work_waited() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut t = Throughput::default();
        // Idle for 10 s with a trickle of work: it says nothing of capacity.
        for i in 0..100 {
            t.tick(at(i * 100), false, 2);
            t.dispatched(10);
        }
        assert_eq!(t.rate_per_node(at(10_000)), None);
        // Then 4 s under backlog at 1,000 tokens a second on two nodes, 2 s on one at 500.
        for i in 100..140 {
            t.tick(at(i * 100), true, 2);
            t.dispatched(100);
        }
        for i in 140..160 {
            t.tick(at(i * 100), true, 1);
            t.dispatched(50);
        }
        let rate = t.rate_per_node(at(16_000)).unwrap();
        assert!((rate - 500.0).abs() < 1.0, "{rate}");
        // Long after, the window has moved past it.
        t.tick(at(60_000), false, 2);
        assert_eq!(t.rate_per_node(at(60_100)), None);
        assert_eq!(wait_for(2_000.0, 1_000.0), Duration::from_secs(2));
    }
}
