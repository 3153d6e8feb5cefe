//! Trust no node (SPEC section 7): a frame is believed only from the node that holds its
//! attempt, a report is billed only within the request's bounds, and a retry goes away from
//! the node that failed it.

use super::*;
use crate::ports::{ReviewReason, UsageBounds};

const FIVE_TOKENS: UsageBounds = UsageBounds {
    prompt_tokens: 100,
    completion_tokens: 5,
};

fn refusal(id: &str, attempt: u64) -> NodeFrame {
    NodeFrame::Error {
        request_id: id.into(),
        attempt,
        code: "engine_unreachable".into(),
        message: "engine unreachable".into(),
    }
}

/// Frames written to a node's socket so far.
fn drain(out: &mut mpsc::Receiver<ServerFrame>) -> Vec<ServerFrame> {
    let mut frames = Vec::new();
    while let Ok(f) = out.try_recv() {
        frames.push(f);
    }
    frames
}

fn heartbeat() -> NodeFrame {
    NodeFrame::Heartbeat {
        queue_depth: 0,
        running: 0,
        kv_cache_usage: 0.0,
        gpu_util: 0.0,
        models: vec![MODEL.into()],
        engine_counters: None,
        assignments: None,
    }
}

#[tokio::test(start_paused = true)]
async fn another_nodes_frames_change_nothing_and_are_never_acked() {
    let h = harness(8, 4).await;
    let (victim, mut out1) = connect(&h, "n1").await;
    let (rogue, mut out2) = connect(&h, "n2").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await, ("r1".into(), 1));

    rogue.deliver(NodeFrame::Accepted {
        request_id: "r1".into(),
        attempt: 1,
    });
    rogue.deliver(chunk("r1", 1, 0, "forged"));
    rogue.deliver(done("r1", 1, 1, 100_000, "stop"));
    rogue.deliver(chunk("r1", 7, 0, "an epoch never dispatched"));
    settle_a_moment().await;
    assert_eq!(
        h.ledger.row("r1").unwrap().status,
        RowStatus::Reserved,
        "the forged done settled nothing"
    );

    victim.deliver(chunk("r1", 1, 0, "real"));
    victim.deliver(done("r1", 1, 12, 1, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("real".into())));
    let Some(GenEvent::Finished(usage)) = stream.next().await else {
        panic!("finished expected")
    };
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (12, 1));
    settle_a_moment().await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (RowStatus::Settled, 12, 1)
    );
    assert!(
        drain(&mut out2).is_empty(),
        "nothing, no ack, went to the rogue"
    );
    assert!(
        drain(&mut out1)
            .iter()
            .any(|f| matches!(f, ServerFrame::Ack { attempt: 1, .. }))
    );
}

#[tokio::test(start_paused = true)]
async fn a_node_that_keeps_violating_is_disconnected() {
    let h = harness(8, 4).await;
    let (_victim, mut out1) = connect(&h, "n1").await;
    let (rogue, _out2) = connect(&h, "n2").await;
    let _stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    // The default tolerates 10 within a minute.
    for seq in 0..10 {
        rogue.deliver(chunk("r1", 1, seq, "x"));
    }
    settle_a_moment().await;
    assert_eq!(
        h.queue.stats().await.unwrap().nodes.len(),
        2,
        "10 tolerated"
    );
    rogue.deliver(chunk("r1", 1, 10, "x"));
    settle_a_moment().await;
    let nodes = h.queue.stats().await.unwrap().nodes;
    assert_eq!(
        nodes.iter().map(|n| n.0.as_str()).collect::<Vec<_>>(),
        ["n1"],
        "the 11th disconnected it"
    );
}

#[tokio::test(start_paused = true)]
async fn a_seq_going_backwards_is_a_violation_and_dropped() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    node.deliver(chunk("r1", 1, 1, "b"));
    for _ in 0..11 {
        node.deliver(chunk("r1", 1, 0, "again"));
    }
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("b".into())));
    settle_a_moment().await;
    assert!(
        h.queue.stats().await.unwrap().nodes.is_empty(),
        "11 regressions disconnect the node"
    );
}

#[tokio::test(start_paused = true)]
async fn completion_tokens_beyond_max_tokens_are_billed_at_the_bound_and_marked() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start_bounded(&h, "r1", None, FIVE_TOKENS).await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "hello"));
    node.deliver(done("r1", 1, 12, 100_000, "length"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("hello".into())));
    let Some(GenEvent::Finished(usage)) = stream.next().await else {
        panic!("finished expected")
    };
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens),
        (12, 5),
        "the client sees what the ledger bills"
    );
    settle_a_moment().await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.review,
            row.claimed
        ),
        (
            RowStatus::Settled,
            12,
            5,
            Some(ReviewReason::UsageOverBound),
            Some((12, 100_000))
        )
    );
    assert!(
        drain(&mut out)
            .iter()
            .any(|f| matches!(f, ServerFrame::Ack { .. })),
        "settled, so acked"
    );
}

#[tokio::test(start_paused = true)]
async fn counts_no_ledger_can_hold_end_with_an_error_and_settle_at_the_bound() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start_bounded(&h, "r1", None, FIVE_TOKENS).await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "hello"));
    node.deliver(done("r1", 1, u64::MAX, u64::MAX, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("hello".into())));
    let Some(GenEvent::Failed(f)) = stream.next().await else {
        panic!("an error, not success with usage the ledger never recorded")
    };
    assert_eq!(f.code, ErrorCode::ModelBackendError);
    settle_a_moment().await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.review
        ),
        (
            RowStatus::Settled,
            100,
            5,
            Some(ReviewReason::UsageUnrepresentable)
        )
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_attempt_is_retried_on_the_other_node() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await, ("r1".into(), 1));
    n1.deliver(refusal("r1", 1));
    assert_eq!(
        expect_assign(&mut out2).await,
        ("r1".into(), 2),
        "not back to the node that refused"
    );
    n2.deliver(chunk("r1", 2, 0, "ok"));
    n2.deliver(done("r1", 2, 12, 1, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("ok".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
}

/// Assignments that never reached a node (its connection gone between the queue's choice and
/// the send, as when the replica holding several nodes' sockets dies) do not spend the one
/// retry: the request runs on the next node that takes it.
#[tokio::test(start_paused = true)]
async fn assignments_that_never_reached_a_node_do_not_spend_the_retry() {
    let h = harness(8, 1).await;
    // The live node is busy; the two free ones have lost their connections.
    let (live, mut out) = connect(&h, "n3").await;
    let _busy = start(&h, "r0").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r0".into(), 1));
    let (_n1, gone1) = connect(&h, "n1").await;
    let (_n2, gone2) = connect(&h, "n2").await;
    drop((gone1, gone2));
    let mut stream = start(&h, "r1").await.unwrap();
    settle_a_moment().await;
    // Both free nodes were tried and could not be sent to; the request waits for n3.
    live.deliver(done("r0", 1, 3, 0, "stop"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 3));
    live.deliver(chunk("r1", 3, 0, "ok"));
    live.deliver(done("r1", 3, 12, 1, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("ok".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Settled);
}

#[tokio::test(start_paused = true)]
async fn a_node_refusing_twice_in_a_row_leaves_routing_until_its_next_heartbeat() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (_n2, mut out2) = connect(&h, "n2").await;
    let _r1 = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await.0, "r1");
    n1.deliver(refusal("r1", 1));
    assert_eq!(expect_assign(&mut out2).await, ("r1".into(), 2));
    // n1 is the less loaded one now, so r2 goes there, and is refused too.
    let _r2 = start(&h, "r2").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await.0, "r2");
    n1.deliver(refusal("r2", 1));
    assert_eq!(expect_assign(&mut out2).await, ("r2".into(), 2));
    settle_a_moment().await;
    assert_eq!(h.queue.stats().await.unwrap().suspended, ["n1"]);
    // Suspended: new work goes to the busier n2.
    let _r3 = start(&h, "r3").await.unwrap();
    assert_eq!(expect_assign(&mut out2).await.0, "r3");
    assert!(drain(&mut out1).is_empty());
    // A heartbeat (its engine's metrics answered again) brings it back.
    n1.deliver(heartbeat());
    settle_a_moment().await;
    assert!(h.queue.stats().await.unwrap().suspended.is_empty());
    let _r4 = start(&h, "r4").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await.0, "r4");
}

#[tokio::test(start_paused = true)]
async fn a_done_outliving_its_generation_settles_only_from_the_node_that_held_it() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (rogue, mut out2) = connect(&h, "n2").await;
    let _stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    n1.deliver(chunk("r1", 1, 0, "a"));
    settle_a_moment().await;
    // The replica's generations stop mid-flight (a restart): the row awaits the node's done.
    h.gens.stop();
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);

    rogue.deliver(done("r1", 1, 1, 1, "stop"));
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);
    assert!(drain(&mut out2).is_empty(), "never acked");

    n1.deliver(done("r1", 1, 12, 3, "stop"));
    settle_a_moment().await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.review
        ),
        (RowStatus::Settled, 12, 3, None)
    );
    assert!(
        drain(&mut out1)
            .iter()
            .any(|f| matches!(f, ServerFrame::Ack { .. }))
    );
}

#[tokio::test(start_paused = true)]
async fn output_beyond_the_requests_bound_ends_it_stops_the_node_and_settles_within_bounds() {
    use crate::lifecycle::Status;
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    // Admitted through the record (so the outcome is stored), bounded to five tokens:
    // 5 × 1 KiB + 64 KiB of output at most.
    use crate::lifecycle::{GenerationStore, MessagePolicy, NewGeneration};
    let new = NewGeneration {
        id: "r1".into(),
        subject: "alice".into(),
        idempotency_key: "r1".into(),
        fingerprint: "fp".into(),
        model: MODEL.into(),
    };
    store
        .admit_generation(&new, &MessagePolicy::default(), 0)
        .await
        .unwrap();
    let lifecycle: Arc<dyn GenerationStore> = store.clone();
    let mut stream = start_bounded(&h, "r1", Some(lifecycle), FIVE_TOKENS)
        .await
        .unwrap();
    expect_assign(&mut out).await;
    let slice = "x".repeat(16 << 10);
    for seq in 0..8 {
        node.deliver(chunk("r1", 1, seq, &slice));
    }
    // Four slices (64 KiB) fit; the fifth crosses 69 KiB and nothing from it on is relayed.
    for _ in 0..4 {
        assert!(matches!(stream.next().await, Some(GenEvent::Delta(_))));
    }
    let Some(GenEvent::Failed(f)) = stream.next().await else {
        panic!("a typed failure after the bound")
    };
    assert_eq!(f.code, ErrorCode::ModelBackendError);
    let frames = drain(&mut out);
    assert!(
        frames
            .iter()
            .any(|f| matches!(f, ServerFrame::Cancel { attempt: 1, .. })),
        "the engine's work is stopped: {frames:?}"
    );
    // The node's `done` (claiming far more than five tokens) settles within the bounds.
    node.deliver(done("r1", 1, 12, 100_000, "abort"));
    settle_a_moment().await;
    assert_eq!(stream.next().await, None, "nothing after the failure");
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (RowStatus::Settled, 12, 5)
    );
    assert!(
        drain(&mut out)
            .iter()
            .any(|f| matches!(f, ServerFrame::Ack { .. }))
    );
    let rec = store.records().pop().unwrap();
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(
        rec.output.as_deref().map(str::len),
        Some(4 * slice.len()),
        "the record keeps what was relayed, nothing past the bound"
    );
}
