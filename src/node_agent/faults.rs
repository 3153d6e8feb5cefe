//! Faults a test harness or a drill injects into a running agent, to reproduce what a lossy
//! network or a buggy node does to the server. A production agent never arms any: every
//! counter starts at zero and only a caller holding the handle can change it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cloneable handle on the agent's injected faults; clones share the same counters, so a
/// harness keeps one clone of [`super::AgentConfig::faults`] and arms it while the agent runs.
#[derive(Debug, Clone, Default)]
pub struct AgentFaults {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// `accepted` frames still to be swallowed.
    drop_accepted: AtomicU64,
}

impl AgentFaults {
    /// The agent silently does not send its next `n` `accepted` frames (replacing any count
    /// still pending); their chunks, `done`s and errors go out as usual.
    pub fn drop_accepted(&self, n: u64) {
        self.inner.drop_accepted.store(n, Ordering::SeqCst);
    }

    /// `accepted` frames still to be dropped.
    pub fn pending_dropped_accepted(&self) -> u64 {
        self.inner.drop_accepted.load(Ordering::SeqCst)
    }

    /// Consumes one pending drop; true when this `accepted` must not be sent.
    pub(crate) fn take_accepted_drop(&self) -> bool {
        self.inner
            .drop_accepted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_exactly_n_and_clones_share_the_count() {
        let faults = AgentFaults::default();
        let handle = faults.clone();
        assert!(!faults.take_accepted_drop());
        handle.drop_accepted(2);
        assert_eq!(faults.pending_dropped_accepted(), 2);
        assert!(faults.take_accepted_drop());
        assert!(faults.take_accepted_drop());
        assert!(!faults.take_accepted_drop());
        assert_eq!(handle.pending_dropped_accepted(), 0);
    }
}
