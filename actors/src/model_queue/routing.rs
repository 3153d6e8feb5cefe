//! Node choice. The default scores each node by its own in-flight count against its
//! capacity, plus its last reported KV-cache use; round robin exists so that routing quality
//! can be measured against it on the same fleet.

use serde::{Deserialize, Serialize};

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

/// How the queue picks a node (configuration: `routing = "least_loaded" | "round_robin"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingStrategy {
    /// Lowest in-flight share plus KV use; ties go to the node with fewer waiting.
    #[default]
    LeastLoaded,
    /// Each node in turn.
    RoundRobin,
}

impl RoutingStrategy {
    /// Index into `nodes` (all with room, in node-id order) of the node to use.
    pub fn choose(self, nodes: &[NodeView<'_>], cursor: &mut usize) -> Option<usize> {
        if nodes.is_empty() {
            return None;
        }
        match self {
            RoutingStrategy::RoundRobin => {
                let i = *cursor % nodes.len();
                *cursor = cursor.wrapping_add(1);
                Some(i)
            }
            RoutingStrategy::LeastLoaded => nodes
                .iter()
                .enumerate()
                .min_by(|(_, a), (_, b)| {
                    score(a)
                        .total_cmp(&score(b))
                        .then(a.engine_waiting.cmp(&b.engine_waiting))
                })
                .map(|(i, _)| i),
        }
    }
}

/// In-flight share is exact and fresh; the heartbeat's KV use is up to 5 s old, so it
/// weighs half as much.
fn score(n: &NodeView<'_>) -> f64 {
    let share = f64::from(n.in_flight) / f64::from(n.capacity.max(1));
    share + 0.5 * n.kv_cache_usage
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(id: &str, in_flight: u32, kv: f64) -> NodeView<'_> {
        NodeView {
            node_id: id,
            in_flight,
            capacity: 32,
            kv_cache_usage: kv,
            engine_waiting: 0,
        }
    }

    #[test]
    fn least_loaded_prefers_fewer_in_flight_then_kv_headroom() {
        let mut c = 0;
        let nodes = [view("a", 10, 0.1), view("b", 2, 0.1), view("c", 2, 0.9)];
        assert_eq!(RoutingStrategy::LeastLoaded.choose(&nodes, &mut c), Some(1));
    }

    #[test]
    fn round_robin_cycles() {
        let mut c = 0;
        let nodes = [view("a", 10, 0.0), view("b", 0, 0.0)];
        let picks: Vec<_> = (0..4)
            .map(|_| RoutingStrategy::RoundRobin.choose(&nodes, &mut c))
            .collect();
        assert_eq!(picks, [Some(0), Some(1), Some(0), Some(1)]);
    }
}
