//! Where one assignment's frames go: the generation that holds it here, the replica it
//! is relayed to, or a live generation found in the directory; and its slot given back when
//! it ends.

use super::actor::NodeState;
use super::link::{self, Dest};
use crate::generation::GenerationMsg;
use crate::metric_names::STALE_FRAMES_TOTAL;

/// The replica whose generation holds this attempt, when it is not on this one.
pub(super) fn relays_to(state: &NodeState, request_id: &str, attempt: u64) -> Option<String> {
    match state
        .in_flight
        .get(request_id)
        .filter(|f| f.attempt == attempt)
    {
        Some(f) => match &f.dest {
            Dest::Replica(replica) => Some(replica.clone()),
            Dest::Local(_) | Dest::Orphaned => None,
        },
        // A `done` sent again while its first copy, relayed, still waits for that replica's
        // ack: it goes the same way. Settled here instead, it would bill an attempt the
        // generation may have fenced meanwhile (found by the simulation, seed 217).
        None => link::awaiting_ack(state, request_id, attempt),
    }
}

/// Forgets an assignment and gives its slot back to the model's queue (when this replica's
/// queue dispatched it).
pub(super) fn release(state: &mut NodeState, request_id: &str) {
    // Only this replica's own dispatches count in its queue: another replica's assignment
    // is given back by that replica's proxy.
    if let Some(f) = state.in_flight.remove(request_id)
        && matches!(f.dest, Dest::Local(_))
        && let Some(queue) = state.args.queues.get(&f.model)
    {
        queue.released(&state.args.node_id);
    }
}

/// Sends a message to the generation a frame belongs to: the assignment's own actor, or a
/// live generation in the directory (a `done` resent after a reconnect, or a frame naming
/// another node's request: every message carries this node's handle, and the generation
/// accepts it only from the node that holds that attempt). False when no generation is alive
/// to take it.
pub(super) fn route(state: &NodeState, request_id: &str, attempt: u64, msg: GenerationMsg) -> bool {
    if let Some(f) = state
        .in_flight
        .get(request_id)
        .filter(|f| f.attempt == attempt)
        && let Dest::Local(generation) = &f.dest
    {
        match generation.cast(msg) {
            Ok(()) => return true,
            Err(ractor::MessagingErr::SendErr(msg)) => {
                return route_directory(state, request_id, msg);
            }
            Err(_) => return false,
        }
    }
    route_directory(state, request_id, msg)
}

fn route_directory(state: &NodeState, request_id: &str, msg: GenerationMsg) -> bool {
    match state.args.directory.get(request_id) {
        Some(generation) => generation.cast(msg).is_ok(),
        None => {
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "no_generation").increment(1);
            false
        }
    }
}
