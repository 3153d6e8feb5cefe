//! A small model checker over the pure core: random inputs (see `model.rs`) are stepped the
//! way the actor steps them, and every way the generation ends is checked.

use proptest::prelude::*;

use super::model::*;
use crate::error::ErrorCode;
use crate::generation::core::{Claim, Effect, Input, Where};
use crate::generation::msg::{GenEvent, Timer};
use crate::lifecycle::{AttemptState, Status};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn every_way_a_generation_ends_keeps_the_client_the_row_and_the_record_right(
        recorded in any::<bool>(),
        bounded in any::<bool>(),
        ops in proptest::collection::vec(op(), 0..48),
        dice in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        // Bounded, the second chunk crosses the output bound, so its path (a violation, the
        // client failed, the node stopped) is among those explored.
        let mut world = World::new(recorded, bounded, dice);
        if bounded {
            world = world.output_bound(5);
        }
        world.step(Input::Admit);
        for op in ops {
            world.apply(op);
        }
        world.quiesce();
        world.check_end();
    }

    #[test]
    fn a_generation_that_runs_to_the_end_is_billed_what_the_client_is_told(
        recorded in any::<bool>(),
        chunks in 0u64..5,
        p in 0u64..300,
        c in 0u64..300,
        commit_at in 0u64..7,
    ) {
        // The row commits at any point: before the dispatch, between frames, after the done.
        let mut world = World::new(recorded, true, Vec::new());
        world.step(Input::Admit);
        world.apply(Op::Dispatch(true));
        for seq in 0..chunks {
            if seq == commit_at {
                world.apply(Op::Reserved);
            }
            world.apply(Op::Chunk(Which::Current, Src::Holder, seq));
        }
        world.apply(Op::Done(Which::Current, Src::Holder, p, c, 0));
        prop_assert!(world.terminals.is_empty() || world.reserved_ok);
        world.quiesce();
        world.check_end();
        let billed = world.bounds.bill(p, c);
        prop_assert_eq!(world.ledger, Ledger::Settled(billed.prompt_tokens, billed.completion_tokens));
        prop_assert!(matches!(world.terminals.as_slice(), [GenEvent::Finished(_)]));
    }
}

/// Drives a fixed script (the row commits at once) and returns the world.
fn script(recorded: bool, ops: &[Op]) -> World {
    let mut world = World::new(recorded, false, Vec::new());
    world.step(Input::Admit);
    world.apply(Op::Reserved);
    for op in ops {
        world.apply(op.clone());
    }
    world
}

#[test]
fn a_client_back_within_the_grace_keeps_the_generation_running() {
    let mut world = script(
        true,
        &[
            Op::Dispatch(true),
            Op::Chunk(Which::Current, Src::Holder, 0),
            Op::ClientGone,
            Op::ClientBack,
        ],
    );
    // The grace's timer fires: nothing is cancelled.
    let grace = world
        .timers
        .iter()
        .position(|t| matches!(t, Timer::CancelGrace(_)))
        .unwrap();
    world.apply(Op::Fire(grace));
    assert!(matches!(world.core.at, Where::Running { .. }));
    world.apply(Op::Chunk(Which::Current, Src::Holder, 1));
    world.apply(Op::Done(Which::Current, Src::Holder, 3, 2, 0));
    assert!(matches!(
        world.terminals.as_slice(),
        [GenEvent::Finished(_)]
    ));
    world.quiesce();
    world.check_end();
}

#[test]
fn a_client_back_after_the_cancel_changes_nothing() {
    let mut world = script(
        true,
        &[
            Op::Dispatch(true),
            Op::Chunk(Which::Current, Src::Holder, 0),
            Op::ClientGone,
        ],
    );
    let grace = world
        .timers
        .iter()
        .position(|t| matches!(t, Timer::CancelGrace(_)))
        .unwrap();
    world.apply(Op::Fire(grace));
    assert!(matches!(world.core.at, Where::Cancelling { .. }));
    world.apply(Op::ClientBack);
    assert!(matches!(world.core.at, Where::Cancelling { .. }));
    world.apply(Op::Done(Which::Current, Src::Holder, 3, 1, 2));
    assert!(matches!(
        world.terminals.as_slice(),
        [GenEvent::Cancelled(_)]
    ));
    world.quiesce();
    world.check_end();
}

#[test]
fn a_restarted_queue_gets_the_waiting_generation_back_at_the_front() {
    let mut world = script(false, &[]);
    let fx = world.core.step(
        Input::QueueRestarted {
            model: "other".into(),
        },
        world.now,
    );
    assert!(fx.is_empty());
    let fx = world.core.step(
        Input::QueueRestarted {
            model: MODEL.into(),
        },
        world.now,
    );
    assert_eq!(
        fx,
        vec![Effect::Enqueue {
            front: true,
            avoid: None
        }]
    );
    let fx = world.core.step(Input::Enqueued(Ok(())), world.now);
    assert!(fx.is_empty());
    assert!(matches!(world.core.at, Where::Queued { .. }));
}

#[test]
fn a_crashed_node_actor_is_a_lost_node_only_for_its_own_attempt() {
    let mut world = script(false, &[Op::Dispatch(true)]);
    world.apply(Op::NodeGone(false));
    assert!(matches!(world.core.at, Where::Running { .. }));
    world.apply(Op::NodeGone(true));
    // Nothing streamed: the lease fences the attempt before anything is decided.
    assert!(matches!(world.core.at, Where::Fencing { .. }));
}

#[test]
fn every_delta_goes_to_the_sender_even_after_the_client_left() {
    let mut world = script(
        true,
        &[
            Op::Dispatch(true),
            Op::ClientGone,
            Op::Chunk(Which::Current, Src::Holder, 0),
            Op::Chunk(Which::Current, Src::Holder, 1),
        ],
    );
    assert_eq!(world.deltas, 2);
    world.quiesce();
    world.check_end();
}

#[test]
fn a_failed_settle_is_retried_on_timers_not_in_the_handler() {
    let mut world = script(false, &[Op::Dispatch(true)]);
    world.dice = vec![0];
    world.next_die = 0;
    world.apply(Op::Done(Which::Current, Src::Holder, 5, 5, 0));
    assert!(matches!(world.core.at, Where::Settling(_)));
    assert_eq!(world.timers.last(), Some(&Timer::SettleRetry));
    // A cancel meanwhile is handled at once and changes nothing.
    world.apply(Op::Cancel);
    assert!(matches!(world.core.at, Where::Settling(_)));
    let retry = world.timers.len() - 1;
    world.apply(Op::Fire(retry));
    assert_eq!(world.ledger, Ledger::Settled(5, 5));
    assert!(matches!(
        world.terminals.as_slice(),
        [GenEvent::Finished(_)]
    ));
    world.quiesce();
    world.check_end();
}

#[test]
fn the_work_is_sent_while_the_row_commits_and_nothing_is_told_before_it_has() {
    let mut world = World::new(true, false, Vec::new());
    world.step(Input::Admit);
    world.apply(Op::Dispatch(true));
    // Sent to the node, the admission not yet answered.
    assert_eq!(world.sent, 1);
    assert!(matches!(world.core.at, Where::Running { .. }));
    assert!(world.replies.is_empty());
    world.apply(Op::Chunk(Which::Current, Src::Holder, 0));
    world.apply(Op::Chunk(Which::Current, Src::Holder, 1));
    assert_eq!(world.deltas, 0, "output before the row committed");
    world.apply(Op::Reserved);
    assert!(matches!(world.replies.as_slice(), [Ok(())]));
    assert_eq!(
        world.deltas, 2,
        "the held output follows the commit, in order"
    );
    world.apply(Op::Done(Which::Current, Src::Holder, 3, 2, 0));
    world.quiesce();
    world.check_end();
    assert_eq!(world.ledger, Ledger::Settled(3, 2));
}

#[test]
fn a_row_refused_after_the_dispatch_stops_the_node_and_bills_nothing() {
    // Dice: the holders record and the enqueue succeed, the record writes succeed, the node
    // is sent the work, then the ledger refuses (die 0: insufficient balance).
    let mut world = World::new(true, false, vec![99, 99, 99, 99, 99, 99, 0]);
    world.step(Input::Admit);
    world.apply(Op::Dispatch(true));
    assert_eq!(world.sent, 1);
    world.apply(Op::Chunk(Which::Current, Src::Holder, 0));
    world.next_die = 6;
    world.apply(Op::Reserved);
    assert!(matches!(
        world.replies.as_slice(),
        [Err(f)] if f.code == ErrorCode::InsufficientBalance
    ));
    assert_eq!(world.deltas, 0);
    assert_eq!(world.ledger, Ledger::None);
    assert_eq!(world.stops, 1);
    let rec = world.record.as_ref().unwrap();
    assert_eq!(rec.status, Status::Rejected, "the key may be retried");
    assert_eq!(rec.attempt_state, AttemptState::Refused);
    world.step(Input::Stopped);
    world.check_end();
}

/// A `done` that says the attempt sent more chunks than came, or a gap in the chunks' `seq`:
/// the client is told its answer is incomplete (never handed it as whole), and the engine's
/// work is billed all the same.
#[test]
fn output_lost_on_the_way_fails_the_client_and_bills_the_work() {
    for (second, sent, whole) in [
        (1, Some(2), true),
        (1, None, true),
        (1, Some(3), false),
        (2, None, false),
    ] {
        let mut world = script(
            true,
            &[
                Op::Dispatch(true),
                Op::Chunk(Which::Current, Src::Holder, 0),
                Op::Chunk(Which::Current, Src::Holder, second),
            ],
        );
        let attempt = world.epoch(Which::Current);
        let from = world.node(attempt, Src::Holder);
        world.frame(attempt, &from);
        world.step(Input::Done {
            attempt,
            claim: Claim {
                prompt_tokens: 5,
                completion_tokens: 3,
                cached_tokens: None,
                chunks: sent,
                finish_reason: "stop".into(),
            },
            from,
        });
        world.quiesce();
        match world.terminals.as_slice() {
            [GenEvent::Finished(usage)] if whole => assert_eq!(usage.completion_tokens, 3),
            [GenEvent::Failed(failure)] if !whole => {
                assert_eq!(failure.code, ErrorCode::ModelBackendError);
            }
            other => panic!("sent {sent:?}: {other:?}"),
        }
        assert_eq!(world.core.settled_tokens, Some(8), "sent {sent:?}");
        world.check_end();
    }
}
