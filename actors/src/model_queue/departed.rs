//! Work counted on a node that left this queue's view. A node leaves when its actor stops
//! or its heartbeats stop reaching this replica, but what was dispatched to it may still be
//! on its way or running there (an `assign` relayed before a Redis stall arrives after it).
//! Forgetting those slots would let the queue fill the node again from zero when it
//! returns, one past its capacity or more. So the counts stay here while the node is away:
//! every release while away takes one off, a follower's forgetting drops its share, and a
//! returning node starts from what is left (the owner's next report from each follower
//! then replaces that follower's share with what it really runs there).

use std::collections::BTreeMap;

use super::actor::{NodeEntry, QueueState};

/// Per node that left: the assignments still counted on it, by replica.
#[derive(Debug, Default)]
pub(super) struct Departed(BTreeMap<String, BTreeMap<String, u32>>);

impl Departed {
    /// `node_id` left with `entry`'s counts.
    pub(super) fn keep(&mut self, node_id: &str, entry: &NodeEntry) {
        let running: BTreeMap<String, u32> = entry
            .running
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(r, n)| (r.clone(), *n))
            .collect();
        if running.is_empty() {
            self.0.remove(node_id);
        } else {
            self.0.insert(node_id.to_owned(), running);
        }
    }

    /// `node_id` is back: its entry carries what is still counted on it, except where the
    /// entry already knows better (a rejoining node actor's own in-flight count).
    pub(super) fn restore(&mut self, node_id: &str, entry: &mut NodeEntry) {
        for (replica, n) in self.0.remove(node_id).unwrap_or_default() {
            entry.running.entry(replica).or_insert(n);
        }
    }

    /// One of `replica`'s assignments on `node_id`, away, ended; false when none was
    /// counted there.
    pub(super) fn give_back(&mut self, node_id: &str, replica: &str) -> bool {
        let Some(running) = self.0.get_mut(node_id) else {
            return false;
        };
        let Some(n) = running.get_mut(replica).filter(|n| **n > 0) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            running.remove(replica);
        }
        if running.is_empty() {
            self.0.remove(node_id);
        }
        true
    }

    /// `replica` is gone: nothing of its counts.
    pub(super) fn forget(&mut self, replica: &str) {
        self.0.retain(|_, running| {
            running.remove(replica);
            !running.is_empty()
        });
    }
}

impl QueueState {
    /// One of `replica`'s assignments on `node_id` ended, whether the node is here or away.
    pub(super) fn give_back(&mut self, node_id: &str, replica: &str) {
        match self.nodes.get_mut(node_id) {
            Some(n) => n.give_back(replica),
            None => {
                self.departed.give_back(node_id, replica);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Departed;

    fn counts(d: &Departed, node: &str) -> Vec<(String, u32)> {
        d.0.get(node)
            .map(|r| r.iter().map(|(k, v)| (k.clone(), *v)).collect())
            .unwrap_or_default()
    }

    #[test]
    fn releases_while_away_and_forgotten_replicas_come_off() {
        let mut d = Departed::default();
        d.0.insert(
            "n1".into(),
            [("r1".to_owned(), 2), ("r2".to_owned(), 1)].into(),
        );
        assert!(d.give_back("n1", "r1"));
        assert!(!d.give_back("n1", "r3"));
        assert!(!d.give_back("n2", "r1"));
        assert_eq!(
            counts(&d, "n1"),
            vec![("r1".to_owned(), 1), ("r2".to_owned(), 1)]
        );
        d.forget("r2");
        assert_eq!(counts(&d, "n1"), vec![("r1".to_owned(), 1)]);
        assert!(d.give_back("n1", "r1"));
        assert!(d.0.is_empty(), "an empty node is not kept");
    }
}
