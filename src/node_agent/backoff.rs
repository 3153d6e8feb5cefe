//! Reconnect delays: exponential backoff with full jitter (AWS's "full jitter"), so a fleet of
//! nodes that lost the same server replica does not reconnect in lockstep.
//!
//! `delay = uniform(0, min(max, min_delay * 2^attempt))`; the attempt count resets after a
//! successful registration. Hand-rolled because backon's jitter adds `uniform(0, delay)` on top
//! of the delay instead of drawing the whole delay.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Attempts beyond this no longer double the ceiling (2^31 × any sane minimum is past any cap).
const MAX_DOUBLINGS: u32 = 31;

/// Full-jitter exponential backoff over a seeded RNG.
#[derive(Debug)]
pub(crate) struct FullJitter {
    min: Duration,
    max: Duration,
    attempt: u32,
    rng: StdRng,
}

impl FullJitter {
    /// `seed: None` seeds from the OS.
    pub(crate) fn new(min: Duration, max: Duration, seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            min,
            max: max.max(min),
            attempt: 0,
            rng,
        }
    }

    /// The upper bound of the next delay.
    pub(crate) fn ceiling(&self) -> Duration {
        let factor = 1u32 << self.attempt.min(MAX_DOUBLINGS);
        self.min.saturating_mul(factor).min(self.max)
    }

    /// Draws the next delay and counts the attempt.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let cap = u64::try_from(self.ceiling().as_nanos()).unwrap_or(u64::MAX);
        self.attempt = self.attempt.saturating_add(1);
        Duration::from_nanos(self.rng.random_range(0..=cap))
    }

    /// After a successful registration the next failure starts from the minimum again.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_capped_at_max() {
        let min = Duration::from_millis(100);
        let max = Duration::from_millis(1_000);
        let mut b = FullJitter::new(min, max, Some(7));
        let ceilings: Vec<u64> = (0..6)
            .map(|_| {
                let c = b.ceiling();
                let d = b.next_delay();
                assert!(d <= c, "{d:?} > {c:?}");
                c.as_millis() as u64
            })
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1_000, 1_000]);
        for _ in 0..100 {
            assert!(b.next_delay() <= max);
        }
        b.reset();
        assert_eq!(b.ceiling(), min);
    }

    #[test]
    fn jitter_spreads_over_the_whole_range() {
        let mut b = FullJitter::new(Duration::from_secs(60), Duration::from_secs(60), Some(1));
        let draws: Vec<Duration> = (0..200).map(|_| b.next_delay()).collect();
        assert!(draws.iter().any(|d| *d < Duration::from_secs(10)));
        assert!(draws.iter().any(|d| *d > Duration::from_secs(50)));
    }

    #[test]
    fn the_same_seed_gives_the_same_delays() {
        let min = Duration::from_millis(10);
        let max = Duration::from_secs(60);
        let mut a = FullJitter::new(min, max, Some(42));
        let mut b = FullJitter::new(min, max, Some(42));
        for _ in 0..40 {
            assert_eq!(a.next_delay(), b.next_delay());
        }
    }
}
