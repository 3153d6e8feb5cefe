//! A queue's count of a node squared with what the node carries. The queue counts each
//! node's assignments per replica from dispatches and releases; any message lost on the way
//! (a release that crossed a Redis restart, a replica frozen past its lease, an owner killed
//! between a dispatch and its report) would leave slots counted that nothing runs, and the
//! node would stay "full" for good. The replica holding the node's socket sees every
//! assignment the node carries, from every replica, and says so with each heartbeat; a count
//! above that — plus what was dispatched too recently to have reached the socket — is
//! brought down to it, so a lost slot comes back within one heartbeat.
//!
//! A count below the socket's is raised only when the socket refuses an `assign` for want
//! of room ([`Word::Exact`]): its actor has released everything it ended before it speaks,
//! so nothing given back is in transit there, and it announces the word to every replica at
//! once. Elsewhere a release may still be on its way, but the socket drops an assignment
//! before its replica hears it ended, so a count that is right is never below the socket's:
//! raising it to the word is only ever late by what ended since, given back at the next
//! heartbeat. The node counts as full until a slot of it comes back. A queue that counted
//! too little (a follower's releases crossed by a heartbeat, a replica frozen past its
//! lease, the node back under a new connection still running its work) waits for room
//! instead of dispatching there again and again — the owner above all, which counts every
//! replica's work and holds no socket of its own. A heartbeat's word is not trusted
//! upwards: overtaken by the releases that followed it, it would hold free slots for a
//! heartbeat, while a refusal's comes only when the node is full anyway.

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

/// How a socket's word is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Word {
    /// A heartbeat's announcement, which may cross releases on their way here: counts only
    /// come down to it.
    Announced,
    /// The socket's actor on this replica refusing an `assign`, after everything it released
    /// was sent here: counts are squared both ways, and the node counts as full.
    Exact,
}

/// What squaring changed, by replica.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Squared {
    /// Counted above what the socket carries: given back.
    pub(super) back: BTreeMap<String, u32>,
    /// Carried and not counted: counted now.
    pub(super) found: BTreeMap<String, u32>,
}

/// `running` (the queue's count per replica) squared with `carried` (the socket's): each
/// replica's count at most what the socket carries plus what it took lately (`taken`); with
/// `floor` (the slots the owner granted each replica, whose work it counts there), at least
/// what the socket carries less that.
pub(super) fn square(
    running: &mut BTreeMap<String, u32>,
    carried: &BTreeMap<String, u32>,
    taken: &BTreeMap<String, u32>,
    floor: Option<&BTreeMap<String, u32>>,
) -> Squared {
    let of = |m: &BTreeMap<String, u32>, r: &str| m.get(r).copied().unwrap_or(0);
    let replicas: std::collections::BTreeSet<String> =
        running.keys().chain(carried.keys()).cloned().collect();
    let mut squared = Squared::default();
    for replica in replicas {
        let carries = of(carried, &replica);
        let count = running.entry(replica.clone()).or_default();
        let most = carries.saturating_add(of(taken, &replica));
        let least = floor.map_or(0, |granted| carries.saturating_sub(of(granted, &replica)));
        if *count > most {
            squared.back.insert(replica, *count - most);
            *count = most;
        } else if *count < least {
            squared.found.insert(replica, least - *count);
            *count = least;
        }
    }
    running.retain(|_, n| *n > 0);
    squared
}

impl NodeEntry {
    /// What the socket says `node_id` carries, at `now`, taken as `word`.
    pub(super) fn carries(
        &mut self,
        carried: &BTreeMap<String, u32>,
        word: Word,
        now: Instant,
    ) -> Squared {
        self.full = word == Word::Exact;
        let taken = self.recent.by_replica(now);
        let floor = (word == Word::Exact).then_some(&self.granted);
        square(&mut self.running, carried, &taken, floor)
    }
}

impl QueueState {
    /// The part of a socket's word this queue counts. Alone (no cluster), every generation
    /// the node carries is this queue's, whatever its replica calls itself; a follower counts
    /// only its own work (the owner counts every replica's); the owner counts all of it.
    fn share<'a>(
        &self,
        carried: &'a BTreeMap<String, u32>,
    ) -> std::borrow::Cow<'a, BTreeMap<String, u32>> {
        let own = if self.cluster.is_none() {
            carried.values().sum()
        } else if self.follows() {
            carried.get(&self.me).copied().unwrap_or(0)
        } else {
            return std::borrow::Cow::Borrowed(carried);
        };
        std::borrow::Cow::Owned(BTreeMap::from([(self.me.clone(), own)]))
    }

    /// The replica holding `node_id`'s socket says what it carries of this model.
    pub(super) fn node_carries(
        &mut self,
        node_id: &str,
        carried: &BTreeMap<String, u32>,
        word: Word,
    ) {
        let now = self.args.clock.now();
        let carried = self.share(carried);
        let carried = carried.as_ref();
        let Some(n) = self.nodes.get_mut(node_id) else {
            return;
        };
        let Squared {
            back: back_by,
            found,
        } = n.carries(carried, word, now);
        if !found.is_empty() {
            let slots: u32 = found.values().sum();
            tracing::info!(model = %self.args.model, node_id, slots, "slots the node carries that were not counted are counted now");
        }
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

    use super::{Squared, square};

    fn map(pairs: &[(&str, u32)]) -> BTreeMap<String, u32> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn counts_above_what_the_socket_carries_come_back() {
        let mut running = map(&[("r1", 20), ("r2", 16), ("r3", 4)]);
        // r1's count is right; r2 lost 12 releases; r3 is gone from the socket entirely.
        let squared = square(
            &mut running,
            &map(&[("r1", 20), ("r2", 4)]),
            &map(&[]),
            None,
        );
        assert_eq!(squared.back, map(&[("r2", 12), ("r3", 4)]));
        assert_eq!(running, map(&[("r1", 20), ("r2", 4)]));
    }

    #[test]
    fn recent_dispatches_are_not_held_against_the_socket() {
        let mut running = map(&[("r1", 10)]);
        // Three dispatched in the last moments have not reached the socket yet.
        let taken = map(&[("r1", 3)]);
        let squared = square(&mut running, &map(&[("r1", 7)]), &taken, None);
        assert_eq!(squared, Squared::default());
        assert_eq!(running, map(&[("r1", 10)]));
        let squared = square(&mut running, &map(&[("r1", 5)]), &taken, None);
        assert_eq!(squared.back, map(&[("r1", 2)]));
        assert_eq!(running, map(&[("r1", 8)]));
    }

    #[test]
    fn a_heartbeat_never_raises_a_count() {
        let mut running = map(&[("r1", 2)]);
        let squared = square(&mut running, &map(&[("r1", 9), ("r2", 5)]), &map(&[]), None);
        assert_eq!(squared, Squared::default());
        assert_eq!(running, map(&[("r1", 2)]));
    }

    #[test]
    fn a_refusal_counts_what_the_socket_carries_less_the_grants() {
        // The node came back under a new connection still running r1's 9 and r2's 5; r2
        // works on 3 slots the owner granted it, counted there.
        let mut running = map(&[("r1", 2)]);
        let granted = map(&[("r2", 3)]);
        let carried = map(&[("r1", 9), ("r2", 5)]);
        let squared = square(&mut running, &carried, &map(&[]), Some(&granted));
        assert_eq!(squared.found, map(&[("r1", 7), ("r2", 2)]));
        assert_eq!(running, map(&[("r1", 9), ("r2", 2)]));
    }
}
