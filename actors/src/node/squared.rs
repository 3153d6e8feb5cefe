//! The socket's count of a node's work squared with the node's own: a `heartbeat` listing
//! the assignments the agent holds gives back the slot of each one it no longer has (its
//! `done` or `error` lost, or the agent dropped it), which would otherwise hold a slot of the
//! node's capacity (`actor::at_capacity`) for as long as the connection lasts.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ractor::ActorRef;

use super::actor::{InFlight, NodeState, send, violation};
use super::frames::release;
use super::link::{self, Dest, Transport};
use super::msg::{NodeMsg, Violation};
use crate::generation::GenerationMsg;
use crate::metric_names::NODE_ASSIGNMENTS_RECLAIMED_TOTAL;
use crate::protocol::{Held, MAX_HEARTBEAT_ASSIGNMENTS, NodeFrame, ServerFrame};

/// The `error` code the socket's replica relays to a proxy for an assignment the node no
/// longer holds: the proxy ends it as on a lost node (never as a refusal, which would retry
/// at once work that may have run). Only between replicas; no agent sends it.
pub(super) const NODE_LOST: &str = "node_lost";

/// What decides whether an assignment left out of a heartbeat is gone from the node.
#[derive(Debug, Clone, Copy)]
pub(super) struct Horizon {
    /// Heartbeats heard on this connection before the one being read.
    pub(super) beats: u64,
    /// When the heartbeat is read.
    pub(super) now: tokio::time::Instant,
    /// How long an assignment the node never acknowledged may be in transit to it.
    pub(super) unaccepted_after: Duration,
}

/// The request ids of `in_flight` that a heartbeat listing `listed` shows the node no longer
/// holds.
///
/// The agent lists an assignment from the moment it takes it (before its `accepted` can be
/// sent) until its `done` or final `error` has been queued on the socket, and builds each
/// heartbeat's list after the previous heartbeat was queued. The node → server direction is
/// one ordered stream, read here in order. So for an assignment whose `accepted` arrived
/// before the previous heartbeat did: the agent had it before it queued that heartbeat, hence
/// before it built this one's list; left out, it had finished, and its `done` or `error`,
/// queued before this heartbeat, arrived before it and ended the assignment here already — or
/// it was lost. Either way the node does not run it. "Assigned before the previous heartbeat
/// arrived" would not do: the server → node direction is another stream, and an `assign`
/// still on its way may cross any number of heartbeats. Counting heartbeats rather than
/// comparing times keeps the rule exact when two frames are read at the same instant and
/// whatever the clock does.
///
/// An assignment the node never acknowledged (an `assign` it never read, a refusal lost) has
/// no such proof; it is taken as gone once it was sent `unaccepted_after` ago (the node's
/// heartbeat timeout: an `assign` slower than that on a live connection is not expected).
/// Should one arrive later anyway, the `cancel` sent with the reclaim follows it on the same
/// ordered stream and stops it at once.
pub(super) fn vanished(
    in_flight: &BTreeMap<String, InFlight>,
    listed: &BTreeSet<(&str, u64)>,
    horizon: Horizon,
) -> Vec<String> {
    in_flight
        .iter()
        .filter(|(id, f)| !listed.contains(&(id.as_str(), f.attempt)))
        .filter(|(_, f)| match f.accepted {
            Some(beats) => beats < horizon.beats,
            None => {
                horizon.now.saturating_duration_since(f.assigned_at) >= horizon.unaccepted_after
            }
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// A heartbeat arrived where the node's socket is: when it lists the node's assignments,
/// every one the node no longer holds ends. Called before the heartbeat is counted.
pub(super) async fn on_heartbeat(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    assignments: Option<Vec<Held>>,
) {
    // A proxy's heartbeat is its owner's: the owner squares.
    let (Some(held), Transport::Socket { .. }) = (assignments, &state.transport) else {
        return;
    };
    if held.len() > MAX_HEARTBEAT_ASSIGNMENTS {
        violation(state, myself, Violation::MalformedFrame, None).await;
        return;
    }
    let listed: BTreeSet<(&str, u64)> = held
        .iter()
        .map(|h| (h.request_id.as_str(), h.attempt))
        .collect();
    let horizon = Horizon {
        beats: state.beats,
        now: state.args.clock.now(),
        unaccepted_after: state.args.heartbeat_timeout,
    };
    let gone = vanished(&state.in_flight, &listed, horizon);
    if gone.is_empty() {
        return;
    }
    metrics::counter!(NODE_ASSIGNMENTS_RECLAIMED_TOTAL, "node" => state.args.node_id.clone())
        .increment(gone.len() as u64);
    tracing::warn!(node_id = %state.args.node_id, count = gone.len(), "the node's heartbeat no longer lists assignments counted on it; their slots are given back");
    for request_id in gone {
        reclaim(state, myself, request_id);
    }
}

/// Ends one assignment the node no longer holds: the node is told to stop it (in case an
/// `assign` still on its way reaches it), its slot goes back, and its generation hears its
/// node lost it — here as `NodeLost`, on another replica through the relayed [`NODE_LOST`].
fn reclaim(state: &mut NodeState, myself: &ActorRef<NodeMsg>, request_id: String) {
    let Some(f) = state.in_flight.get(&request_id) else {
        return;
    };
    let attempt = f.attempt;
    let told = match &f.dest {
        Dest::Local(generation) => Some(Ok(generation.clone())),
        Dest::Replica(replica) => Some(Err(replica.clone())),
        Dest::Orphaned => None,
    };
    release(state, &request_id);
    send(
        state,
        myself,
        ServerFrame::Cancel {
            request_id: request_id.clone(),
            attempt,
        },
    );
    match told {
        Some(Ok(generation)) => {
            let _ = generation.cast(GenerationMsg::NodeLost { attempt });
        }
        Some(Err(replica)) => {
            let frame = NodeFrame::Error {
                request_id,
                attempt,
                code: NODE_LOST.into(),
                message: "the node no longer holds this assignment".into(),
            };
            link::relay(state, myself, replica, &frame);
        }
        None => {}
    }
}

/// A proxy hears from the node's owner that the node lost one of this replica's
/// assignments: it ends as on a lost node, and its slot goes back to this replica's queue.
pub(super) fn lost_on_node(state: &mut NodeState, request_id: &str, attempt: u64) {
    let generation = match state.in_flight.get(request_id) {
        Some(f) if f.attempt == attempt => match &f.dest {
            Dest::Local(generation) => Some(generation.clone()),
            Dest::Replica(_) | Dest::Orphaned => None,
        },
        _ => return,
    };
    release(state, request_id);
    if let Some(generation) = generation {
        let _ = generation.cast(GenerationMsg::NodeLost { attempt });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn carried(entries: &[(&str, u64, Option<u64>, u64)]) -> BTreeMap<String, InFlight> {
        let origin = tokio::time::Instant::now();
        entries
            .iter()
            .map(|&(id, attempt, accepted, sent_secs)| {
                let f = InFlight {
                    attempt,
                    model: "m".into(),
                    dest: Dest::Orphaned,
                    accepted,
                    assigned_at: origin + Duration::from_secs(sent_secs),
                };
                (id.to_owned(), f)
            })
            .collect()
    }

    fn horizon(beats: u64, now_secs: u64) -> Horizon {
        Horizon {
            beats,
            now: tokio::time::Instant::now() + Duration::from_secs(now_secs),
            unaccepted_after: Duration::from_secs(15),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_accepted_assignment_left_out_after_the_previous_heartbeat_is_gone() {
        // Accepted after 2 heartbeats; now reading the 4th (3 heard before it).
        let in_flight = carried(&[("a", 1, Some(2), 0)]);
        assert_eq!(vanished(&in_flight, &BTreeSet::new(), horizon(3, 0)), ["a"]);
        // Listed: kept, whatever its age.
        let listed = [("a", 1)].into();
        assert!(vanished(&in_flight, &listed, horizon(3, 100)).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn an_accepted_assignment_is_kept_until_a_heartbeat_has_come_after_it() {
        // Accepted between the 2nd and the 3rd heartbeats: the 3rd may have been built
        // before the agent took it (it came before the accepted on the wire, or was built
        // first and queued after it), so only the 4th can leave it out.
        let in_flight = carried(&[("a", 1, Some(2), 0)]);
        assert!(vanished(&in_flight, &BTreeSet::new(), horizon(2, 100)).is_empty());
        // The first heartbeat of a connection proves nothing about an acceptance before it.
        let first = carried(&[("a", 1, Some(0), 0)]);
        assert!(vanished(&first, &BTreeSet::new(), horizon(0, 100)).is_empty());
        assert_eq!(vanished(&first, &BTreeSet::new(), horizon(1, 0)), ["a"]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_assign_still_on_its_way_is_kept_until_it_is_overdue() {
        // Sent at 10 s, never acknowledged: heartbeats may cross it on the wire.
        let in_flight = carried(&[("a", 1, None, 10)]);
        assert!(vanished(&in_flight, &BTreeSet::new(), horizon(9, 10)).is_empty());
        assert!(vanished(&in_flight, &BTreeSet::new(), horizon(9, 24)).is_empty());
        assert_eq!(
            vanished(&in_flight, &BTreeSet::new(), horizon(9, 25)),
            ["a"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_of_another_attempt_does_not_hold_this_one() {
        let in_flight = carried(&[("a", 2, Some(0), 0), ("b", 1, Some(0), 0)]);
        let listed = [("a", 1), ("b", 1), ("c", 7)].into();
        assert_eq!(vanished(&in_flight, &listed, horizon(5, 0)), ["a"]);
    }
}
