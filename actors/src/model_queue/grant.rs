//! Capacity grants: the queue's owner lends each follower a share of every node's slots
//! while nothing waits, so a follower's generation starts at once on a node it holds a free
//! slot of — without the two pub/sub hops of asking the owner (and without touching pub/sub
//! at all when that node's socket is on the follower too).
//!
//! The owner stays the only judge of capacity: it counts a grant as taken from the moment it
//! sends it until the slots come back, and a follower starts no more on a node than its grant
//! there. Grants and returns are increments, so a `Grant` and a `Return` crossing each other
//! leave both sides' counts right; the owner's count is never below what the follower uses.
//! When a generation finds no node with room, the owner recalls the grants of the nodes that
//! could run it (`Revoke`): the follower returns the unused slots at once and each used one
//! as its generation ends. A grant lives as long as the owner record that sent it: a new
//! owner, a new incarnation or a `Resync` drops it, and what runs on it is reported as plain
//! running work.

use std::collections::BTreeMap;

use ractor::ActorRef;
use tokio::time::Instant;

use super::actor::QueueState;
use super::msg::Slot;
use super::routing::{AFFINITY_FLOOR_TOKENS, NodeView, RouteKey, RoutingStrategy};
use crate::cluster::{QueueItem, QueueReply};
use crate::generation::GenerationMsg;
use crate::protocol::Api;

/// As a follower: the owner's grant on one node.
#[derive(Debug, Default)]
pub(super) struct Held {
    /// Slots this replica may use.
    slots: u32,
    /// Of which its generations use now.
    used: u32,
    /// Recalled: each slot goes back as it frees.
    revoked: bool,
}

/// A queue's grants, held (as a follower) or given (as the owner; the counts are on the
/// nodes, [`super::actor::NodeEntry::granted`]).
#[derive(Debug, Default)]
pub(super) struct Grants {
    held: BTreeMap<String, Held>,
    /// Generations this replica started on a grant.
    started: u64,
}

impl Grants {
    /// Generations started on a grant so far.
    pub(super) fn started(&self) -> u64 {
        self.started
    }
}

impl QueueState {
    fn grants_mut(&mut self) -> Option<&mut Grants> {
        self.cluster.as_mut().map(|m| &mut m.grants)
    }

    /// As a follower: starts `generation` on a node with a free granted slot, if there is
    /// one; true when it did.
    pub(super) fn start_on_grant(
        &mut self,
        generation: &ActorRef<GenerationMsg>,
        avoid: Option<&str>,
        api: Api,
        route: Option<&RouteKey>,
    ) -> bool {
        let capacity = self.args.config.node_capacity;
        // Only the owner sees where every prompt went: a prompt long enough for a node's
        // cache to matter is placed by it, one pub/sub hop against seconds of prefill.
        if self.router.strategy() == RoutingStrategy::CacheAware
            && route.is_some_and(|r| r.prompt_tokens >= AFFINITY_FLOOR_TOKENS)
        {
            return false;
        }
        let Some(m) = self.cluster.as_ref() else {
            return false;
        };
        let candidates: Vec<NodeView<'_>> = m
            .grants
            .held
            .iter()
            .filter(|(id, h)| h.used < h.slots && Some(id.as_str()) != avoid)
            .filter_map(|(id, _)| {
                let n = self.nodes.get(id)?;
                (n.routable() && n.handle.speaks(api)).then(|| n.view(id, capacity))
            })
            .collect();
        let Some(chosen) = self.router.choose(route, &candidates) else {
            return false;
        };
        let node_id = candidates[chosen].node_id.to_owned();
        let Some(entry) = self.nodes.get_mut(&node_id) else {
            return false;
        };
        // Counted before it is sent: a dispatch that does not arrive gives its slot back
        // (the grant's place included).
        entry.take(&self.me, self.args.clock.now());
        let msg = GenerationMsg::Dispatch {
            node: entry.handle.clone(),
            slot: Slot::new(self.myself.clone(), &node_id),
        };
        if let Some(g) = self.grants_mut()
            && let Some(h) = g.held.get_mut(&node_id)
        {
            h.used += 1;
        }
        if generation.cast(msg).is_err() {
            return false;
        }
        self.router.placed(&node_id, route);
        if let Some(g) = self.grants_mut() {
            g.started += 1;
        }
        true
    }

    /// As a follower: the owner granted `slots` more of `node_id`.
    pub(super) fn granted(&mut self, node_id: String, slots: u32) {
        if let Some(g) = self.grants_mut() {
            let h = g.held.entry(node_id).or_default();
            h.slots = h.slots.saturating_add(slots);
            h.revoked = false;
        }
    }

    /// As a follower: the owner (or the node's departure) recalls the grant on `node_id`.
    pub(super) fn revoke(&mut self, node_id: &str) {
        let Some(g) = self.grants_mut() else {
            return;
        };
        let Some(h) = g.held.get_mut(node_id) else {
            return;
        };
        let unused = h.slots.saturating_sub(h.used);
        h.slots = h.used;
        h.revoked = true;
        if h.slots == 0 {
            g.held.remove(node_id);
        }
        if unused > 0 {
            self.tell_owner(QueueItem::Return {
                node_id: node_id.to_owned(),
                slots: unused,
            });
        }
    }

    /// As a follower: `node_id` left this replica's view; the whole grant goes back (the
    /// generations that used it there have lost their node), and their ends are plain
    /// releases (the next report squares the owner's count).
    pub(super) fn node_left(&mut self, node_id: &str) {
        let Some(h) = self.grants_mut().and_then(|g| g.held.remove(node_id)) else {
            return;
        };
        if h.slots > 0 {
            self.tell_owner(QueueItem::Return {
                node_id: node_id.to_owned(),
                slots: h.slots,
            });
        }
    }

    /// As a follower: the slots it holds of each node (reported to the owner).
    pub(super) fn held(&self) -> BTreeMap<String, u32> {
        self.cluster.as_ref().map_or_else(BTreeMap::new, |m| {
            m.grants
                .held
                .iter()
                .map(|(id, h)| (id.clone(), h.slots))
                .collect()
        })
    }

    /// As a follower: one of this replica's generations on `node_id` ended. True when it ran
    /// on the grant (its slot stays with this replica, or goes back if recalled); false when
    /// the owner counted it (the owner hears of it as released).
    pub(super) fn release_granted(&mut self, node_id: &str) -> bool {
        let Some(g) = self.grants_mut() else {
            return false;
        };
        let Some(h) = g.held.get_mut(node_id).filter(|h| h.used > 0) else {
            return false;
        };
        h.used -= 1;
        if h.revoked {
            h.slots = h.slots.saturating_sub(1);
            if h.slots == 0 {
                g.held.remove(node_id);
            }
            self.tell_owner(QueueItem::Return {
                node_id: node_id.to_owned(),
                slots: 1,
            });
        }
        true
    }

    /// As a follower: the owner record that gave the grants is gone (a new owner or
    /// incarnation, or it forgot this replica); what runs on them is plain running work now.
    pub(super) fn drop_grants(&mut self) {
        if let Some(g) = self.grants_mut() {
            g.held.clear();
        }
    }

    /// As a follower: this replica's generations on `node_id` that run on the grant (the
    /// owner counts them in the grant, not in the report).
    pub(super) fn on_grant(&self, node_id: &str) -> u32 {
        self.cluster
            .as_ref()
            .and_then(|m| m.grants.held.get(node_id))
            .map_or(0, |h| h.used)
    }

    /// As the owner, while nothing waits: tops each follower up to its share of every
    /// routable node (an equal share per replica, this one's kept for itself), from the
    /// room left. A node recalled within the last renewal period is left alone.
    pub(super) fn share_capacity(&mut self) {
        // Under cache_aware the owner places every prompt itself: it alone sees where each
        // one went, and a slot lent away would make the node holding a hot prefix look full
        // at a fraction of its capacity.
        if !self.line.is_empty()
            || !self.decides()
            || self.router.strategy() == RoutingStrategy::CacheAware
        {
            return;
        }
        let now = self.args.clock.now();
        let capacity = self.args.config.node_capacity;
        let Some(m) = self.cluster.as_ref() else {
            return;
        };
        let calm = m.cluster.period();
        let followers: Vec<String> = m.followers().collect();
        let replicas = u32::try_from(followers.len() + 1).unwrap_or(u32::MAX);
        let share = capacity / replicas;
        if share == 0 {
            return;
        }
        let mut grants: Vec<(String, String, u32)> = Vec::new();
        for (id, n) in &self.nodes {
            if !n.routable()
                || n.recalled
                    .is_some_and(|at| now.saturating_duration_since(at) < calm)
            {
                continue;
            }
            let mut room = capacity.saturating_sub(n.taken(capacity));
            for f in &followers {
                let have = n.granted.get(f).copied().unwrap_or(0);
                let give = share.saturating_sub(have).min(room);
                if give > 0 {
                    room -= give;
                    grants.push((f.clone(), id.clone(), give));
                }
            }
        }
        for (replica, node_id, slots) in grants {
            if self.grant_remote(&replica, &node_id, slots)
                && let Some(n) = self.nodes.get_mut(&node_id)
            {
                *n.granted.entry(replica).or_default() += slots;
                n.recalled = None;
            }
        }
    }

    /// As the owner: a generation of `api` found no node with room; the grants on the nodes
    /// that could run it (but `avoid`) are recalled.
    pub(super) fn recall(&mut self, api: Api, avoid: Option<&str>, now: Instant) {
        let mut revokes: Vec<(String, String)> = Vec::new();
        for (id, n) in &mut self.nodes {
            if Some(id.as_str()) == avoid || !n.routable() || !n.handle.speaks(api) {
                continue;
            }
            if n.recalled.is_some() {
                continue;
            }
            let holders: Vec<String> = n
                .granted
                .iter()
                .filter(|(_, slots)| **slots > 0)
                .map(|(r, _)| r.clone())
                .collect();
            if holders.is_empty() {
                continue;
            }
            n.recalled = Some(now);
            revokes.extend(holders.into_iter().map(|r| (r, id.clone())));
        }
        for (replica, node_id) in revokes {
            self.tell_replica(&replica, QueueReply::Revoke { node_id });
        }
    }

    /// As the owner: `from` gave back `slots` of its grant on `node_id`.
    pub(super) fn returned(&mut self, from: &str, node_id: &str, slots: u32) {
        if let Some(have) = self
            .nodes
            .get_mut(node_id)
            .and_then(|n| n.granted.get_mut(from))
        {
            *have = have.saturating_sub(slots);
        }
    }
}
