//! Node choice. The default, `cache_aware`, scores each node with room on the prompt blocks
//! it is predicted to hold ([`prefix`]), its in-flight share, its engine's waiting requests
//! and its KV-cache use; `least_loaded` ignores the cache, and `round_robin` exists so that
//! routing quality can be measured against it on the same fleet (docs/capacity.md,
//! "Routing").
//!
//! KV pressure counts against a node as load, never against its cache: a prompt whose
//! prefix a node holds needs fewer new blocks there than anywhere else, so under pressure
//! affinity matters more, not less — except on a node that is full and carrying more than
//! twice the mean ([`OVERLOAD_FACTOR`]), whose cache stops drawing work. (An earlier version
//! discounted the cache of every node above 80 % KV use; in the routing benchmark's
//! oversubscribed llm-d shape every node sits there, the discount turned `cache_aware` into
//! `least_loaded`, and throughput fell by a third.)

pub mod prefix;

use std::collections::HashMap;

use hashlink::LruCache;
use serde::{Deserialize, Serialize};

pub use prefix::{MAX_BLOCKS, PrefixIndex, RouteKey, block_hashes};

/// What the chooser sees of a node that has room.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView<'a> {
    /// The node's id.
    pub node_id: &'a str,
    /// Assignments in flight on it, counted by the queue itself.
    pub in_flight: u32,
    /// Assignments it may carry at once for this model.
    pub capacity: u32,
    /// Its KV-cache use (0–1) from the last heartbeat.
    pub kv_cache_usage: f64,
    /// Requests waiting inside its engine, from the last heartbeat.
    pub engine_waiting: u64,
}

/// How the queue picks a node (configuration: `routing = "cache_aware" | "least_loaded" |
/// "round_robin"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingStrategy {
    /// Predicted prefill saved against load (see [`Router`]).
    #[default]
    CacheAware,
    /// Lowest in-flight share plus KV use; ties go to the node with fewer waiting.
    LeastLoaded,
    /// Each node in turn.
    RoundRobin,
}

impl RoutingStrategy {
    /// The configuration name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CacheAware => "cache_aware",
            Self::LeastLoaded => "least_loaded",
            Self::RoundRobin => "round_robin",
        }
    }

    /// Parses a configuration name.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::CacheAware, Self::LeastLoaded, Self::RoundRobin]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// Weight of a full predicted cache hit against a whole node's load (in-flight share 0–1).
/// Above 1, a long shared prefix keeps going to the node holding it until that node is out
/// of slots or KV headroom, then spills (and the next node caches it too): on a GPU, decode
/// throughput grows almost linearly with the batch, so a fuller node costs each stream little,
/// while a prefill avoided saves whole seconds of a long prompt.
pub const AFFINITY_WEIGHT: f64 = 2.0;
/// A node carrying more than this many times the mean in-flight of the nodes with room (and
/// [`OVERLOAD_SLACK`] more) while its KV cache is at least [`OVERLOAD_KV`] full is hot: what it
/// holds stops drawing work to it (its affinity is cancelled), so a group of clients sharing
/// a prefix it holds spills to a second node, which caches the prefix too, instead of piling
/// on until the engine preempts. Below that, following the cache costs each stream little.
/// (Found by the routing benchmark: llm-d's shape with 300–400-token questions, where one of
/// eight nodes took 86 % of the preemptions and the mean TTFT was 6–7 s; with this rule 1.4 s.)
pub const OVERLOAD_FACTOR: f64 = 2.0;
/// See [`OVERLOAD_FACTOR`]: a few in flight more than the rest is not hot on a quiet fleet.
pub const OVERLOAD_SLACK: f64 = 2.0;
/// See [`OVERLOAD_FACTOR`]: the heartbeat's KV use at which a node counts as full.
pub const OVERLOAD_KV: f64 = 0.9;
/// Prompts shorter than this many tokens count as this long: a fully cached short prompt
/// saves a few milliseconds of prefill and should not outweigh load.
pub const AFFINITY_FLOOR_TOKENS: u32 = 256;
/// Waiters a node that frees a slot may look through, under `cache_aware`, for the one whose
/// prompt it holds the most of (see [`Router::pick`]).
pub const LOOK_AHEAD: usize = 16;
/// Times a waiter may be passed over that way before it is served first, whatever it matches.
pub const MAX_PASSED: u32 = 4;

/// Sessions remembered per model (`x-session-id` → the node of its last request).
pub const SESSIONS: usize = 65_536;

/// The node a session's last request went to, with that request's prompt tokens.
#[derive(Debug, Clone)]
struct Sticky {
    node_id: String,
    prompt_tokens: u32,
}

/// One model's node choice: the strategy, and for `cache_aware` each node's
/// [`PrefixIndex`] and the sessions' last nodes. Lives in the model's queue; whoever
/// dispatches calls [`Router::choose`] and then [`Router::placed`].
#[derive(Debug)]
pub struct Router {
    strategy: RoutingStrategy,
    cursor: usize,
    /// Blocks one node's index holds at most (its KV cache).
    cache_blocks: usize,
    indices: HashMap<String, PrefixIndex>,
    sessions: LruCache<u64, Sticky>,
}

impl Router {
    /// A router for nodes whose KV cache holds `cache_blocks` blocks.
    pub fn new(strategy: RoutingStrategy, cache_blocks: usize) -> Self {
        Self {
            strategy,
            cursor: 0,
            cache_blocks,
            indices: HashMap::new(),
            sessions: LruCache::new(SESSIONS),
        }
    }

    /// The strategy.
    pub fn strategy(&self) -> RoutingStrategy {
        self.strategy
    }

    /// Index into `nodes` (all with room, in node-id order) of the node to use for a request
    /// with `route` (`None`: nothing known of its prompt).
    pub fn choose(&mut self, route: Option<&RouteKey>, nodes: &[NodeView<'_>]) -> Option<usize> {
        let indices = &self.indices;
        let predicted = |n: &NodeView<'_>| match (route, indices.get(n.node_id)) {
            (Some(r), Some(idx)) => r.tokens_of(idx.matched(&r.blocks)),
            _ => 0,
        };
        let cached: Vec<u32> = nodes.iter().map(predicted).collect();
        self.choose_on(route, nodes, &cached)
    }

    /// [`Router::choose`] with the cached prompt tokens of each node given (`cached[i]` for
    /// `nodes[i]`): what a router that knew every node's cache exactly would do (the routing
    /// benchmark's oracle).
    pub fn choose_on(
        &mut self,
        route: Option<&RouteKey>,
        nodes: &[NodeView<'_>],
        cached: &[u32],
    ) -> Option<usize> {
        if nodes.is_empty() {
            return None;
        }
        match self.strategy {
            RoutingStrategy::RoundRobin => {
                let i = self.cursor % nodes.len();
                self.cursor = self.cursor.wrapping_add(1);
                Some(i)
            }
            RoutingStrategy::LeastLoaded => best(nodes, 0, |_, n| -load(n)),
            RoutingStrategy::CacheAware => {
                let sticky = route
                    .and_then(|r| r.session)
                    .and_then(|s| self.sessions.peek(&s));
                // Exact ties of prompts (an idle fleet, a prefix nobody holds) rotate, so that
                // separate conversations arriving one at a time spread their caches over the
                // nodes; anything else breaks ties in node-id order.
                let start = if route.is_some_and(|r| !r.blocks.is_empty()) {
                    let start = self.cursor;
                    self.cursor = self.cursor.wrapping_add(1);
                    start
                } else {
                    0
                };
                let hot_above = hot_above(nodes);
                best(nodes, start, |i, n| {
                    let mut tokens = cached.get(i).copied().unwrap_or(0);
                    if let (Some(s), Some(r)) = (sticky, route)
                        && s.node_id == n.node_id
                    {
                        // The session's last node is credited with half its last prompt.
                        tokens = tokens.max(s.prompt_tokens.min(r.prompt_tokens) / 2);
                    }
                    let prompt = route.map_or(0, |r| r.prompt_tokens);
                    let waiting = n.engine_waiting as f64 / f64::from(n.capacity.max(1));
                    let hot = f64::from(n.in_flight) > hot_above && n.kv_cache_usage >= OVERLOAD_KV;
                    let drawn = if hot { 0.0 } else { affinity(tokens, prompt) };
                    drawn * AFFINITY_WEIGHT - load(n) - 0.5 * waiting
                })
            }
        }
    }

    /// Under `cache_aware`, which of the first waiters (`routes`, in queue order; the first is
    /// the one [`Router::choose`] placed on `node_id`) goes to `node_id` instead: the one whose
    /// prompt it is predicted to hold the most tokens of, if that beats the first by a block,
    /// unless the first was already passed over [`MAX_PASSED`] times. Index into `routes`.
    /// At saturation every strategy would otherwise hand the head of the queue to the node
    /// that just freed a slot, whatever that node holds.
    pub fn pick<'a>(
        &self,
        node_id: &str,
        first_passed: u32,
        routes: impl Iterator<Item = Option<&'a RouteKey>>,
    ) -> usize {
        if self.strategy != RoutingStrategy::CacheAware || first_passed >= MAX_PASSED {
            return 0;
        }
        let Some(index) = self.indices.get(node_id) else {
            return 0;
        };
        let held = |r: Option<&RouteKey>| r.map_or(0, |r| r.tokens_of(index.matched(&r.blocks)));
        let mut best = (0, 0u32);
        for (i, r) in routes.take(LOOK_AHEAD).enumerate() {
            let tokens = held(r);
            if i == 0 {
                best = (0, tokens);
            } else if tokens > best.1.saturating_add(r.map_or(0, |r| r.block_size)) {
                best = (i, tokens);
            }
        }
        best.0
    }

    /// A request with `route` was dispatched to `node_id`: the node now holds its blocks,
    /// and its session's next request is credited to it.
    pub fn placed(&mut self, node_id: &str, route: Option<&RouteKey>) {
        if self.strategy != RoutingStrategy::CacheAware {
            return;
        }
        let Some(route) = route else {
            return;
        };
        if !route.blocks.is_empty() {
            let capacity = self.cache_blocks;
            self.indices
                .entry(node_id.to_owned())
                .or_insert_with(|| PrefixIndex::new(capacity))
                .record(&route.blocks);
        }
        if let Some(session) = route.session {
            self.sessions.insert(
                session,
                Sticky {
                    node_id: node_id.to_owned(),
                    prompt_tokens: route.prompt_tokens,
                },
            );
        }
    }

    /// `node_id` left (or came back as a new connection, its engine possibly restarted):
    /// nothing of its cache is assumed any more, by its index or by a session.
    pub fn forget(&mut self, node_id: &str) {
        self.indices.remove(node_id);
        self.sessions.retain(|_, s| s.node_id != node_id);
    }

    /// Prompt tokens `node_id` is predicted to hold of `route`.
    pub fn predicted(&self, node_id: &str, route: &RouteKey) -> u32 {
        self.indices
            .get(node_id)
            .map_or(0, |idx| route.tokens_of(idx.matched(&route.blocks)))
    }
}

/// The index of the highest `score`; ties go to fewer requests waiting in the engine, then
/// to the first from `start` on (node-id order, wrapping).
fn best(
    nodes: &[NodeView<'_>],
    start: usize,
    score: impl Fn(usize, &NodeView<'_>) -> f64,
) -> Option<usize> {
    let len = nodes.len().max(1);
    let from_start = |i: usize| (i + len - start % len) % len;
    nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (i, score(i, n), n.engine_waiting))
        .max_by(|(ia, sa, wa), (ib, sb, wb)| {
            sa.total_cmp(sb)
                .then(wb.cmp(wa))
                .then(from_start(*ib).cmp(&from_start(*ia)))
        })
        .map(|(i, _, _)| i)
}

/// The in-flight count above which a node is hot (see [`OVERLOAD_FACTOR`]).
fn hot_above(nodes: &[NodeView<'_>]) -> f64 {
    let total: f64 = nodes.iter().map(|n| f64::from(n.in_flight)).sum();
    OVERLOAD_FACTOR * total / nodes.len().max(1) as f64 + OVERLOAD_SLACK
}

/// In-flight share is exact and fresh; the heartbeat's KV use is up to 5 s old, so it weighs
/// half as much.
fn load(n: &NodeView<'_>) -> f64 {
    let share = f64::from(n.in_flight) / f64::from(n.capacity.max(1));
    share + 0.5 * n.kv_cache_usage
}

/// Prefill saved, as a share of the prompt (never of less than [`AFFINITY_FLOOR_TOKENS`]).
fn affinity(cached: u32, prompt: u32) -> f64 {
    f64::from(cached) / f64::from(prompt.max(AFFINITY_FLOOR_TOKENS))
}

#[cfg(test)]
mod tests;
