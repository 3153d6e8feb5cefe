//! A queue's count of a node squared with what the node carries. The queue counts each
//! node's assignments per replica from dispatches and releases; any message lost on the way
//! (a release that crossed a Redis restart, a replica frozen past its lease, an owner killed
//! between a dispatch and its report) would leave slots counted that nothing runs, and the
//! node would stay "full" for good. The replica holding the node's socket sees every
//! assignment the node carries, from every replica, and says so with each heartbeat; a count
//! above that — plus what was dispatched too recently to have reached the socket — is
//! brought down to it, so a lost slot comes back within one heartbeat. Counts are never
//! raised from it: a node given too much refuses the excess at its socket (`not_sent`), and
//! the generation goes back to the queue.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::actor::{NodeEntry, QueueState};
use crate::metric_names::QUEUE_SLOTS_RECLAIMED_TOTAL;

/// How long a dispatch may take to reach the node's socket (the owner's decision relayed to
/// a follower, the attempt recorded, the `assign` relayed to the socket's replica): slots
/// taken within it are not held against the socket's count.
pub(super) const IN_TRANSIT: Duration = Duration::from_secs(3);

/// Slots taken on one node lately, by replica, oldest first.
#[derive(Debug, Default)]
pub(super) struct Recent(VecDeque<(String, Instant)>);

impl Recent {
    /// `replica` took a slot at `now`.
    pub(super) fn took(&mut self, replica: &str, now: Instant) {
        self.forget_before(now);
        self.0.push_back((replica.to_owned(), now));
    }

    fn forget_before(&mut self, now: Instant) {
        while self
            .0
            .front()
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) > IN_TRANSIT)
        {
            self.0.pop_front();
        }
    }

    /// Slots taken within [`IN_TRANSIT`] of `now`, by replica.
    fn by_replica(&mut self, now: Instant) -> BTreeMap<String, u32> {
        self.forget_before(now);
        let mut by = BTreeMap::new();
        for (r, _) in &self.0 {
            *by.entry(r.clone()).or_default() += 1;
        }
        by
    }
}

/// `running` (the queue's count per replica) squared with `carried` (the socket's) and
/// `recent` (taken within [`IN_TRANSIT`]): each replica's count at most what the socket
/// carries of it plus its recent slots. Returns the slots given back, by replica.
pub(super) fn square(
    running: &mut BTreeMap<String, u32>,
    carried: &BTreeMap<String, u32>,
    recent: &BTreeMap<String, u32>,
) -> BTreeMap<String, u32> {
    let mut back = BTreeMap::new();
    for (replica, count) in running.iter_mut() {
        let most = carried
            .get(replica)
            .copied()
            .unwrap_or(0)
            .saturating_add(recent.get(replica).copied().unwrap_or(0));
        if *count > most {
            back.insert(replica.clone(), *count - most);
            *count = most;
        }
    }
    running.retain(|_, n| *n > 0);
    back
}

impl NodeEntry {
    /// What the socket says `node_id` carries, at `now`: the slots counted above it come
    /// back. Returns how many, by replica.
    pub(super) fn carries(
        &mut self,
        carried: &BTreeMap<String, u32>,
        now: Instant,
    ) -> BTreeMap<String, u32> {
        let recent = self.recent.by_replica(now);
        square(&mut self.running, carried, &recent)
    }
}

impl QueueState {
    /// The replica holding `node_id`'s socket says what it carries of this model.
    pub(super) fn node_carries(&mut self, node_id: &str, carried: &BTreeMap<String, u32>) {
        let now = self.args.clock.now();
        let Some(n) = self.nodes.get_mut(node_id) else {
            return;
        };
        let back_by = n.carries(carried, now);
        let back: u32 = back_by.values().sum();
        // As a follower, a slot of this replica's own that came back may have been one of an
        // owner's grant: it is released as a finished assignment would be, so the grant's
        // place is free again (or goes back to the owner once recalled).
        let mine = back_by.get(&self.me).copied().unwrap_or(0);
        if self.follows() {
            for _ in 0..mine {
                if !self.release_granted(node_id) {
                    self.tell_owner(crate::cluster::QueueItem::Released {
                        node_id: node_id.to_owned(),
                    });
                }
            }
        }
        if back > 0 {
            metrics::counter!(QUEUE_SLOTS_RECLAIMED_TOTAL, "model" => self.args.model.clone())
                .increment(u64::from(back));
            tracing::info!(model = %self.args.model, node_id, slots = back, "slots counted on a node that it does not carry came back");
            self.dispatch();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::square;

    fn map(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn counts_above_what_the_socket_carries_come_back() {
        let mut running = map(&[("r1", 20), ("r2", 16), ("r3", 4)]);
        // r1's count is right; r2 lost 12 releases; r3 is gone from the socket entirely.
        let back = square(&mut running, &map(&[("r1", 20), ("r2", 4)]), &map(&[]));
        assert_eq!(back, map(&[("r2", 12), ("r3", 4)]));
        assert_eq!(running, map(&[("r1", 20), ("r2", 4)]));
    }

    #[test]
    fn recent_dispatches_are_not_held_against_the_socket() {
        let mut running = map(&[("r1", 10)]);
        // Three dispatched in the last moments have not reached the socket yet.
        assert!(square(&mut running, &map(&[("r1", 7)]), &map(&[("r1", 3)])).is_empty());
        assert_eq!(running, map(&[("r1", 10)]));
        assert_eq!(
            square(&mut running, &map(&[("r1", 5)]), &map(&[("r1", 3)])),
            map(&[("r1", 2)])
        );
        assert_eq!(running, map(&[("r1", 8)]));
    }

    #[test]
    fn a_count_below_the_socket_is_never_raised() {
        let mut running = map(&[("r1", 2)]);
        assert!(square(&mut running, &map(&[("r1", 9), ("r2", 5)]), &map(&[])).is_empty());
        assert_eq!(running, map(&[("r1", 2)]));
    }
}
