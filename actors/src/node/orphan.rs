//! A `done` that no live generation takes: settled from the frame alone.

use super::actor::{NodeState, send, violation};
use super::link;
use super::msg::{NodeMsg, Violation};
use crate::attempts::{self, Holder};
use crate::lifecycle::{AttemptState, Event, Outcome};
use crate::metric_names::{STALE_FRAMES_TOTAL, count_settled_tokens};
use crate::ports::{
    EntryStatus, LedgerEntry, MAX_TOKEN_COUNT, ReviewReason, SettleOutcome, Settlement,
};
use crate::protocol::{NodeFrame, ServerFrame};
use ractor::ActorRef;

/// Whether a `done` no generation here takes may go to its generation's replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Forward {
    /// To the replica the attempt record names, when that is another one still listening.
    ToGeneration,
    /// Settle here: that replica is gone, or had its chance to ack it.
    Never,
}

/// How long a `done` whose attempt no record names waits before it is settled from the frame
/// alone (see [`unrecorded_long_enough`]).
pub(super) const UNRECORDED_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How soon a `done` left unacked here (no record names its attempt yet, or the record could
/// not be read) is read again. The node sends it again only after 30 s, as long as a whole
/// generation may take: left to the node, a `done` that arrived in the second between Redis
/// coming back empty and its generation recording its attempt again reached that generation
/// only after its deadline (`redis-restart-empty`, 2 streams in 2,600).
pub(crate) const LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Reads `done` again in [`LOOK_AGAIN`], as if the node had sent it again; one copy per
/// attempt waits at a time (the node's own copies come on top), at most
/// [`super::actor::MAX_STRAYS`].
fn look_again(state: &mut NodeState, myself: &ActorRef<NodeMsg>, done: &NodeFrame) {
    let NodeFrame::Done {
        request_id,
        attempt,
        ..
    } = done
    else {
        return;
    };
    if state.again.len() >= super::actor::MAX_STRAYS
        || !state.again.insert((request_id.clone(), *attempt))
    {
        return;
    }
    let again = done.clone();
    myself.send_after(LOOK_AGAIN, move || NodeMsg::DoneAgain(again));
}

/// Whether a `done` of `attempt` that no record names was first seen [`UNRECORDED_WAIT`] ago
/// or more (it is remembered now if not). With a coordinator shared by replicas a missing
/// record no longer proves the generation gone: Redis may have lost it (restarted empty)
/// while the generation lives on elsewhere and may have fenced this very attempt and
/// retried — settled at once, the fenced attempt's tokens would be billed to the retry's row
/// (the simulation, Redis restarted empty). Left unacked, it is read again each
/// [`LOOK_AGAIN`]; within a second of Redis's return a live generation has recorded its
/// attempts anew (`cluster::epoch`), and the copy goes to it. (An in-process coordinator is lost only with every generation it recorded: there a
/// missing record settles at once.)
fn unrecorded_long_enough(state: &mut NodeState, request_id: &str, attempt: u64) -> bool {
    let now = state.args.clock.now();
    if state.unrecorded.len() > super::actor::MAX_STRAYS {
        state.unrecorded.clear();
    }
    let first = *state
        .unrecorded
        .entry((request_id.to_owned(), attempt))
        .or_insert(now);
    let waited = now.saturating_duration_since(first) >= UNRECORDED_WAIT;
    if waited {
        state.unrecorded.remove(&(request_id.to_owned(), attempt));
    }
    waited
}

/// A `done` whose generation is not live on this replica. While the attempt record names
/// another replica for the generation, the `done` goes there: only the live generation knows
/// whether it fenced the attempt (settled here, a `done` racing the generation's retry would
/// bill the retry's row for the fenced attempt; found by the simulation, seed 336). Otherwise
/// the generation is gone (a replica restart, a crashed actor): settle the row from the frame
/// alone — a row already final is left as is — then ack it. Only the node the attempt was
/// assigned to may do this (the record says which); when the record is gone, the row is
/// settled within its bounds and marked for review. If the ledger is down the `done` stays
/// unacked and the node sends it again.
pub(super) async fn settle_orphan(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    done: NodeFrame,
    forward: Forward,
) {
    // A copy: the frame itself may still be relayed whole.
    let NodeFrame::Done {
        request_id,
        attempt,
        prompt_tokens,
        completion_tokens,
        finish_reason,
        ..
    } = done.clone()
    else {
        return;
    };
    let record = match attempts::lookup(state.args.coordinator.as_ref(), &request_id, attempt).await
    {
        Ok(record) => record,
        Err(e) => {
            tracing::warn!(%request_id, error = %e, "could not check who held a done's attempt; left unacked");
            look_again(state, myself, &done);
            return;
        }
    };
    let Some(mut review) = vouch(state, myself, record.holder, &done).await else {
        return;
    };
    if forward == Forward::ToGeneration
        && let Some(replica) = record.replica
        && replica != state.args.replica_id
    {
        tracing::debug!(%request_id, attempt, %replica, "a done for a generation on another replica goes there");
        if link::relay(state, myself, replica, &done) {
            return;
        }
    }
    let verified = review.is_none();
    if prompt_tokens > MAX_TOKEN_COUNT || completion_tokens > MAX_TOKEN_COUNT {
        violation(state, myself, Violation::UsageOutOfRange, Some(&request_id)).await;
        review = Some(ReviewReason::UsageUnrepresentable);
    }
    // The row to settle: the request id, or the generation's current admission's row. A
    // `done` for an older or fenced attempt is stale: acked (the node may forget it), never
    // billed.
    let mut ledger_id = request_id.clone();
    let mut record = None;
    if let Some(store) = &state.args.lifecycle {
        match store.get_generation(&request_id).await {
            Ok(Some(rec)) => {
                // A refused attempt is never billed either: its node refused it, or the
                // server did when its row was refused after the work went out.
                if rec.attempt != attempt
                    || matches!(
                        rec.attempt_state,
                        AttemptState::Fenced | AttemptState::Refused
                    )
                {
                    metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
                    tracing::info!(%request_id, attempt, "rejected a done from a fenced attempt");
                    send(
                        state,
                        myself,
                        ServerFrame::Ack {
                            request_id,
                            attempt,
                        },
                    );
                    return;
                }
                ledger_id.clone_from(&rec.ledger_id);
                record = Some(rec);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(%request_id, error = %e, "could not check a done's attempt; left unacked");
                return;
            }
        }
    }
    // The row's model and bounds, read before it settles: a settle applied here is counted in
    // `switchyard_settled_tokens_total` as the generation counts its own (what the bounds
    // bill), and a read after the settle could fail and lose that count for good (the
    // node's next copy finds the row final).
    let row = match state.args.ledger.entry(&ledger_id).await {
        Ok(row) => row,
        Err(e) => {
            tracing::warn!(%request_id, error = %e, "could not read an orphan done's row; left unacked");
            return;
        }
    };
    let settlement = Settlement {
        request_id: ledger_id.clone(),
        prompt_tokens,
        completion_tokens,
        review,
        node_id: Some(state.args.node_id.clone()),
    };
    let outcome = match state.args.ledger.settle(&settlement).await {
        // No record of the attempt and no row: a request this server never admitted.
        Ok(SettleOutcome::Unknown) if !verified => {
            violation(state, myself, Violation::ForeignRequest, Some(&request_id)).await;
            return;
        }
        Ok(outcome) => outcome,
        Err(e) => {
            tracing::warn!(%request_id, error = %e, "could not settle an orphan done; left unacked");
            return;
        }
    };
    tracing::info!(%request_id, attempt, ?outcome, "settled a done without a live generation");
    if outcome == SettleOutcome::Applied
        && let Some(row) = row
    {
        let billed = row.bounds.bill(prompt_tokens, completion_tokens);
        count_settled_tokens(row.model, billed.prompt_tokens, billed.completion_tokens);
    }
    // The record shows what the ledger holds, never the claim.
    if let (Some(store), Some(rec)) = (&state.args.lifecycle, record)
        && !rec.status.is_terminal()
    {
        let (input_tokens, output_tokens) = match state.args.ledger.entry(&ledger_id).await {
            Ok(Some(LedgerEntry {
                status:
                    EntryStatus::Settled {
                        prompt_tokens,
                        completion_tokens,
                    },
                ..
            })) => (prompt_tokens, completion_tokens),
            Ok(_) => (0, 0),
            Err(e) => {
                tracing::warn!(%request_id, error = %e, "could not read a settled row; left unacked");
                return;
            }
        };
        let failed = review == Some(ReviewReason::UsageUnrepresentable)
            || matches!(finish_reason.as_str(), "abort" | "error");
        let finish = Event::Finish {
            attempt,
            from_node: true,
            outcome: if failed {
                Outcome::Failed("model_backend_error".into())
            } else {
                Outcome::Completed
            },
            input_tokens,
            output_tokens,
            output: None,
            output_extra: None,
            finish_reason: Some(finish_reason),
        };
        let now = state.args.clock.wall().timestamp_millis();
        if let Err(e) = store.apply_generation(&request_id, &finish, now).await {
            tracing::warn!(%request_id, error = %e, "could not end a generation from its done; the sweeper will");
        }
    }
    send(
        state,
        myself,
        ServerFrame::Ack {
            request_id,
            attempt,
        },
    );
}

/// What the attempt record says of this node's `done`: `None` when it is not settled now (a
/// violation counted, or an unrecorded one to be read again shortly), else the review
/// mark the settle carries (`None`: the record names this node).
async fn vouch(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    holder: Holder,
    done: &NodeFrame,
) -> Option<Option<ReviewReason>> {
    let NodeFrame::Done {
        request_id,
        attempt,
        ..
    } = done
    else {
        return None;
    };
    let (request_id, attempt) = (request_id.as_str(), *attempt);
    match holder {
        Holder::Node(node) if node == state.args.node_id => Some(None),
        Holder::Node(_) | Holder::NotAssigned => {
            violation(state, myself, Violation::ForeignRequest, Some(request_id)).await;
            None
        }
        Holder::Unrecorded => {
            if state.args.coordinator.is_shared()
                && !unrecorded_long_enough(state, request_id, attempt)
            {
                tracing::info!(node_id = %state.args.node_id, %request_id, attempt, "no record of who held this attempt yet; reading its done again shortly");
                look_again(state, myself, done);
                return None;
            }
            tracing::warn!(node_id = %state.args.node_id, %request_id, attempt, "no record of who held this attempt; settling within its bounds for review");
            Some(Some(ReviewReason::UnverifiedNode))
        }
    }
}
