//! Generation lifecycle tests on a paused clock, with real queue and node actors, an
//! in-memory ledger, and the node's socket replaced by the actor's own frame channel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::*;
use crate::error::ErrorCode;
use crate::model_queue::{
    ModelQueueActor, ModelQueueHandle, QueueArgs, QueueConfig, RoutingStrategy,
};
use crate::node::{NodeActor, NodeArgs, NodeHandle};
use crate::ports::memory::{MapCoordinator, MemoryLedger, RowStatus, reservation};
use crate::ports::{Coordinator, Reservation, SystemClock};
use crate::protocol::{NodeFrame, ServerFrame};

mod capacity;
mod departed;
mod fuzz;
mod leaving;
mod model;
mod overlap;
mod properties;
mod recorded_again;
mod routing;
mod settled_metric;
mod slots;
mod squared;
mod tiers;
mod trust;

const MODEL: &str = "llama-3.1-8b-instruct";

struct Harness {
    ledger: Arc<MemoryLedger>,
    queue: ModelQueueHandle,
    gens: Generations,
    coord: Arc<MapCoordinator>,
}

async fn harness(max_waiting: usize, node_capacity: u32) -> Harness {
    harness_routed(max_waiting, node_capacity, RoutingStrategy::LeastLoaded).await
}

/// [`harness`] with the queue choosing nodes by `routing`.
async fn harness_routed(
    max_waiting: usize,
    node_capacity: u32,
    routing: RoutingStrategy,
) -> Harness {
    harness_with(QueueConfig {
        max_waiting,
        max_waiting_tokens: u64::MAX,
        policy: crate::tier::Policy::fifo(Duration::from_secs(30)),
        node_capacity,
        routing,
        cache_blocks: 1024,
    })
    .await
}

/// A harness whose model queue has `config`.
async fn harness_with(config: QueueConfig) -> Harness {
    let ledger = Arc::new(MemoryLedger::default());
    let queue = ModelQueueActor::start(QueueArgs {
        model: MODEL.into(),
        config,
        clock: Arc::new(SystemClock),
        cluster: None,
    })
    .await
    .unwrap();
    let gens = Generations::start(ledger.clone(), Directory::default())
        .await
        .unwrap();
    Harness {
        ledger,
        queue,
        gens,
        coord: Arc::new(MapCoordinator::with_pubsub()),
    }
}

async fn connect(h: &Harness, id: &str) -> (NodeHandle, mpsc::Receiver<ServerFrame>) {
    connect_with(h, id, crate::protocol::PROTOCOL_VERSION, BTreeMap::new()).await
}

async fn connect_with(
    h: &Harness,
    id: &str,
    protocol: u32,
    capacity: BTreeMap<String, u32>,
) -> (NodeHandle, mpsc::Receiver<ServerFrame>) {
    let (tx, rx) = mpsc::channel(64);
    let args = NodeArgs {
        node_id: id.into(),
        models: vec![MODEL.into()],
        link: crate::node::Link::Socket(tx),
        queues: [(MODEL.to_string(), h.queue.clone())].into(),
        directory: h.gens.directory().clone(),
        ledger: h.ledger.clone(),
        lifecycle: None,
        coordinator: h.coord.clone(),
        replica_id: "r1".into(),
        heartbeat_timeout: Duration::from_secs(15),
        clock: Arc::new(SystemClock),
        trust: crate::node::NodeTrust::default(),
        protocol,
        gpus: 0,
        accounting: None,
        capacity,
    };
    let node = NodeActor::start(args).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1)).await; // let the queue see it
    (node, rx)
}

async fn start(h: &Harness, request_id: &str) -> Result<GenerationStream, crate::error::Failure> {
    start_with(h, request_id, None).await
}

/// A generation with a record in `store` (admitted there first).
async fn start_recorded(
    h: &Harness,
    request_id: &str,
    store: &Arc<crate::lifecycle::memory::MemoryGenerations>,
) -> GenerationStream {
    admit_in(store, request_id).await;
    let lifecycle: Arc<dyn crate::lifecycle::GenerationStore> = store.clone();
    start_with(h, request_id, Some(lifecycle)).await.unwrap()
}

/// Admits `request_id` in `store`, as the lifecycle admission does before the actor starts.
async fn admit_in(store: &crate::lifecycle::memory::MemoryGenerations, request_id: &str) {
    use crate::lifecycle::{GenerationStore, MessagePolicy, NewGeneration};
    let new = NewGeneration {
        id: request_id.into(),
        subject: "alice".into(),
        idempotency_key: request_id.into(),
        fingerprint: "fp".into(),
        model: MODEL.into(),
    };
    let decision = store
        .admit_generation(&new, &MessagePolicy::default(), 0)
        .await
        .unwrap();
    assert!(matches!(decision, crate::lifecycle::Decision::Admitted(_)));
}

async fn start_with(
    h: &Harness,
    request_id: &str,
    lifecycle: Option<Arc<dyn crate::lifecycle::GenerationStore>>,
) -> Result<GenerationStream, crate::error::Failure> {
    start_bounded(
        h,
        request_id,
        lifecycle,
        crate::ports::UsageBounds::UNBOUNDED,
    )
    .await
}

async fn start_bounded(
    h: &Harness,
    request_id: &str,
    lifecycle: Option<Arc<dyn crate::lifecycle::GenerationStore>>,
    bounds: crate::ports::UsageBounds,
) -> Result<GenerationStream, crate::error::Failure> {
    start_timed(h, request_id, lifecycle, bounds, Timeouts::default()).await
}

async fn start_timed(
    h: &Harness,
    request_id: &str,
    lifecycle: Option<Arc<dyn crate::lifecycle::GenerationStore>>,
    bounds: crate::ports::UsageBounds,
    timeouts: Timeouts,
) -> Result<GenerationStream, crate::error::Failure> {
    start_api(
        h,
        request_id,
        lifecycle,
        bounds,
        timeouts,
        crate::protocol::Api::Chat,
    )
    .await
}

async fn start_api(
    h: &Harness,
    request_id: &str,
    lifecycle: Option<Arc<dyn crate::lifecycle::GenerationStore>>,
    bounds: crate::ports::UsageBounds,
    timeouts: Timeouts,
    api: crate::protocol::Api,
) -> Result<GenerationStream, crate::error::Failure> {
    let (args, rx) = generation_args(h, request_id, h.ledger.clone(), lifecycle, bounds);
    let args = GenerationArgs {
        timeouts,
        api,
        embedding_dimensions: None,
        ..args
    };
    h.gens.start_generation(args, rx).await
}

/// The arguments of a test generation `request_id` through `ledger`: chat, default
/// deadlines, a reservation of 10 prompt tokens and 100 output tokens bounded by `bounds`.
fn generation_args(
    h: &Harness,
    request_id: &str,
    ledger: Arc<dyn crate::ports::Ledger>,
    lifecycle: Option<Arc<dyn crate::lifecycle::GenerationStore>>,
    bounds: crate::ports::UsageBounds,
) -> (GenerationArgs, EventReceiver) {
    let (tx, rx) = events::channel(StreamBound::default());
    let args = GenerationArgs {
        request_id: request_id.into(),
        model: MODEL.into(),
        body: serde_json::json!({"model": MODEL, "messages": []}),
        api: crate::protocol::Api::Chat,
        embedding_dimensions: None,
        x_request_id: None,
        traceparent: None,
        reservation: reservation(request_id, MODEL, bounds),
        queue: h.queue.clone(),
        route: None,
        ledger,
        events: tx,
        timeouts: Timeouts::default(),
        clock: Arc::new(SystemClock),
        on_end: None,
        resumable: lifecycle.is_some(),
        tier: crate::tier::Tier::Default,
        lifecycle,
        attempts: Some(crate::attempts::Recorder {
            coordinator: h.coord.clone(),
            replica_id: "r1".into(),
        }),
    };
    (args, rx)
}

async fn expect_assign(out: &mut mpsc::Receiver<ServerFrame>) -> (String, u64) {
    match tokio::time::timeout(Duration::from_secs(30), out.recv())
        .await
        .unwrap()
        .unwrap()
    {
        ServerFrame::Assign {
            request_id,
            attempt,
            ..
        } => (request_id, attempt),
        other => panic!("expected assign, got {other:?}"),
    }
}

fn chunk(id: &str, attempt: u64, seq: u64, delta: &str) -> NodeFrame {
    NodeFrame::Chunk {
        request_id: id.into(),
        attempt,
        seq,
        delta: crate::output::WireDelta::Text(delta.into()),
        logprobs: None,
    }
}

fn done(id: &str, attempt: u64, p: u64, c: u64, reason: &str) -> NodeFrame {
    NodeFrame::Done {
        request_id: id.into(),
        attempt,
        prompt_tokens: p,
        completion_tokens: c,
        finish_reason: reason.into(),
        cached_tokens: None,
        chunks: None,
    }
}

async fn settle_a_moment() {
    tokio::time::sleep(Duration::from_millis(5)).await;
}

#[tokio::test(start_paused = true)]
async fn a_request_streams_settles_once_and_acks() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    node.deliver(NodeFrame::Accepted {
        request_id: "r1".into(),
        attempt: 1,
    });
    node.deliver(chunk("r1", 1, 0, "Hel"));
    node.deliver(chunk("r1", 1, 0, "Hel")); // duplicate seq: dropped
    node.deliver(chunk("r1", 1, 1, "lo"));
    node.deliver(done("r1", 1, 12, 2, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("Hel".into())));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("lo".into())));
    let Some(GenEvent::Finished(usage)) = stream.next().await else {
        panic!("finished expected")
    };
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (12, 2));
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Ack { attempt: 1, .. })
    ));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.transitions
        ),
        (RowStatus::Settled, 12, 2, 1)
    );
    assert_eq!(row.cost, 16, "12 x 1 + 2 x 2 microcredits");
}

#[tokio::test(start_paused = true)]
async fn a_client_that_nobody_can_follow_is_cancelled_on_the_node_at_once() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    drop(stream);
    let asked = tokio::time::timeout(Duration::from_millis(50), out.recv()).await;
    assert!(
        matches!(asked, Ok(Some(ServerFrame::Cancel { attempt: 1, .. }))),
        "cancelled without a grace: {asked:?}"
    );
    node.deliver(done("r1", 1, 12, 1, "abort"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!((row.status, row.completion_tokens), (RowStatus::Settled, 1));
}

#[tokio::test(start_paused = true)]
async fn a_recorded_client_that_leaves_is_cancelled_on_the_node_after_the_grace_and_settled_for_what_it_got()
 {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let mut stream = start_recorded(&h, "r1", &store).await;
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    drop(stream);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(out.try_recv().is_err(), "no cancel within the 2 s grace");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    node.deliver(done("r1", 1, 12, 3, "abort"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!((row.status, row.completion_tokens), (RowStatus::Settled, 3));
}

#[tokio::test(start_paused = true)]
async fn a_recorded_generation_nobody_can_come_back_to_is_cancelled_at_once() {
    // A chat completion without Idempotency-Key of a principal whose messages are metered:
    // it has a record, but no key its client could come back with.
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    admit_in(&store, "r1").await;
    let lifecycle: Arc<dyn crate::lifecycle::GenerationStore> = store.clone();
    let (args, rx) = generation_args(
        &h,
        "r1",
        h.ledger.clone(),
        Some(lifecycle),
        crate::ports::UsageBounds::UNBOUNDED,
    );
    let args = GenerationArgs {
        resumable: false,
        tier: crate::tier::Tier::Default,
        ..args
    };
    let mut stream = h.gens.start_generation(args, rx).await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(chunk("r1", 1, 0, "a"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("a".into())));
    drop(stream);
    let left = tokio::time::Instant::now();
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    assert!(left.elapsed() < Duration::from_millis(100), "no grace");
    node.deliver(done("r1", 1, 12, 1, "abort"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    settle_a_moment().await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!((row.status, row.completion_tokens), (RowStatus::Settled, 1));
}

#[tokio::test(start_paused = true)]
async fn a_node_lost_before_any_token_is_retried_once_on_another_node() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await.1, 1);
    let lost_at = tokio::time::Instant::now();
    n1.connection_lost();
    assert_eq!(
        expect_assign(&mut out2).await,
        ("r1".into(), 2),
        "attempt 2 on the other node"
    );
    // Its `accepted` may have been lost: attempt 1 is fenced by its lease first.
    assert!(lost_at.elapsed() >= Timeouts::default().lease);
    n2.deliver(chunk("r1", 1, 0, "stale")); // the old epoch is fenced
    n2.deliver(chunk("r1", 2, 0, "fresh"));
    n2.deliver(done("r1", 2, 12, 1, "length"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("fresh".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r1").unwrap().completion_tokens, 1);
}

#[tokio::test(start_paused = true)]
async fn a_node_lost_mid_stream_errors_the_client_and_settles_from_the_resent_done() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    n1.deliver(chunk("r1", 1, 0, "partial"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("partial".into())));
    n1.connection_lost();
    let Some(GenEvent::Failed(f)) = stream.next().await else {
        panic!("error event expected")
    };
    assert_eq!(f.code, ErrorCode::ModelBackendError);
    assert_eq!(
        h.ledger.row("r1").unwrap().status,
        RowStatus::Reserved,
        "waiting for the node's done"
    );
    // The node reconnects and resends its done: the new connection finds the generation.
    let (again, mut out_again) = connect(&h, "n1").await;
    again.deliver(done("r1", 1, 12, 7, "error"));
    assert!(matches!(
        out_again.recv().await,
        Some(ServerFrame::Ack { .. })
    ));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (RowStatus::Settled, 12, 7)
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_done_the_row_settles_from_received_chunks_after_the_wait() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    n1.deliver(chunk("r1", 1, 0, "a"));
    n1.deliver(chunk("r1", 1, 1, "b"));
    stream.next().await;
    stream.next().await;
    n1.connection_lost();
    tokio::time::sleep(Timeouts::default().settle_wait + Duration::from_secs(1)).await;
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (RowStatus::Settled, 10, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn no_node_gives_no_healthy_node_and_leaves_no_reservation() {
    let h = harness(8, 4).await;
    let err = start(&h, "r1").await.unwrap_err();
    assert_eq!(err.code, ErrorCode::NoHealthyNode);
    assert!(err.retry_after_secs.is_some());
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Cancelled);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_with_retry_after_and_the_deadline_expires_waiters() {
    let h = harness(1, 1).await;
    let (_node, mut out) = connect(&h, "n1").await;
    let _running = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    let mut waiting = start(&h, "r2").await.unwrap();
    let full = start(&h, "r3").await.unwrap_err();
    assert_eq!(full.code, ErrorCode::QueueFull);
    assert!(full.retry_after_secs.unwrap() >= 1);
    assert_eq!(h.ledger.row("r3").unwrap().status, RowStatus::Cancelled);
    tokio::time::sleep(Duration::from_secs(31)).await;
    let Some(GenEvent::Failed(f)) = waiting.next().await else {
        panic!("capacity_exhausted expected")
    };
    assert_eq!(f.code, ErrorCode::CapacityExhausted);
    assert_eq!(h.ledger.row("r2").unwrap().status, RowStatus::Cancelled);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_while_queued_frees_its_place_and_reservation() {
    let h = harness(4, 1).await;
    let (_node, mut out) = connect(&h, "n1").await;
    let _running = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    let waiting = start(&h, "r2").await.unwrap();
    drop(waiting);
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r2").unwrap().status, RowStatus::Cancelled);
    assert_eq!(h.queue.stats().await.unwrap().waiting, 0);
}

#[tokio::test(start_paused = true)]
async fn an_engine_error_before_acceptance_is_retried_then_reported() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    let err = |attempt| NodeFrame::Error {
        request_id: "r1".into(),
        attempt,
        code: "model_backend_error".into(),
        message: "boom".into(),
    };
    node.deliver(err(1));
    assert_eq!(expect_assign(&mut out).await.1, 2, "retried once");
    node.deliver(err(2));
    let Some(GenEvent::Failed(f)) = stream.next().await else {
        panic!("error expected")
    };
    assert_eq!(f.code, ErrorCode::ModelBackendError);
    assert_eq!(
        h.ledger.row("r1").unwrap().status,
        RowStatus::Cancelled,
        "no GPU work was billed"
    );
}

#[tokio::test(start_paused = true)]
async fn the_ledger_being_down_fails_admission_closed() {
    let h = harness(8, 4).await;
    let (_node, _out) = connect(&h, "n1").await;
    h.ledger.set_unavailable(true);
    let err = start(&h, "r1").await.unwrap_err();
    assert_eq!(err.code, ErrorCode::QuotaServiceUnavailable);
}

#[tokio::test(start_paused = true)]
async fn heartbeats_go_to_the_coordinator_and_a_silent_node_is_dropped() {
    let h = harness(8, 4).await;
    let (node, _out) = connect(&h, "n1").await;
    node.deliver(NodeFrame::Heartbeat {
        queue_depth: 2,
        running: 5,
        kv_cache_usage: 0.25,
        gpu_util: 0.0,
        models: vec![MODEL.into()],
        engine_counters: None,
        assignments: None,
    });
    settle_a_moment().await;
    let hb = h.coord.get_hash("node:n1").await.unwrap().unwrap();
    assert_eq!((hb["running"].as_str(), hb["owner"].as_str()), ("5", "r1"));
    tokio::time::sleep(Duration::from_secs(17)).await;
    assert!(
        h.coord.get_hash("node:n1").await.unwrap().is_none(),
        "dropped after missed heartbeats"
    );
    assert!(h.queue.stats().await.unwrap().nodes.is_empty());
}

#[tokio::test(start_paused = true)]
async fn no_first_token_in_time_is_a_generation_timeout_and_cancels_on_the_node() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let beating = node.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            beating.deliver(NodeFrame::Heartbeat {
                queue_depth: 0,
                running: 1,
                kv_cache_usage: 0.1,
                gpu_util: 0.0,
                models: vec![MODEL.into()],
                engine_counters: None,
                assignments: None,
            });
        }
    });
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out).await;
    node.deliver(NodeFrame::Accepted {
        request_id: "r1".into(),
        attempt: 1,
    });
    tokio::time::sleep(Timeouts::default().first_token + Duration::from_secs(1)).await;
    let Some(GenEvent::Failed(f)) = stream.next().await else {
        panic!("timeout expected")
    };
    assert_eq!(f.code, ErrorCode::GenerationTimeout);
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    node.deliver(done("r1", 1, 12, 0, "abort"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!((row.status, row.completion_tokens), (RowStatus::Settled, 0));
}

#[tokio::test(start_paused = true)]
async fn a_stale_done_from_an_older_attempt_is_acked_but_not_billed() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (_n2, mut out2) = connect(&h, "n2").await;
    let _stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    n1.connection_lost();
    assert_eq!(expect_assign(&mut out2).await.1, 2);
    // The first node comes back and reports its abandoned attempt.
    let (again, mut out_again) = connect(&h, "n1").await;
    again.deliver(done("r1", 1, 12, 5, "abort"));
    assert!(matches!(
        out_again.recv().await,
        Some(ServerFrame::Ack { attempt: 1, .. })
    ));
    assert_eq!(
        h.ledger.row("r1").unwrap().status,
        RowStatus::Reserved,
        "attempt 2 still owns the row"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_node_confirming_its_stop_ends_the_fence_early() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (_n2, mut out2) = connect(&h, "n2").await;
    let _stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    let lost_at = tokio::time::Instant::now();
    n1.connection_lost();
    // Back within the lease, the node reports that attempt 1 stopped (its agent cancels
    // work when its connection drops): attempt 1 can no longer run, so attempt 2 goes now.
    let (again, mut out_again) = connect(&h, "n1").await;
    again.deliver(done("r1", 1, 12, 0, "abort"));
    assert!(matches!(
        out_again.recv().await,
        Some(ServerFrame::Ack { attempt: 1, .. })
    ));
    let (_, attempt) = tokio::select! {
        a = expect_assign(&mut out2) => a,
        a = expect_assign(&mut out_again) => a,
    };
    assert_eq!(attempt, 2);
    assert!(
        lost_at.elapsed() < Timeouts::default().lease,
        "did not wait out the lease"
    );
    assert_eq!(
        h.ledger.row("r1").unwrap().status,
        RowStatus::Reserved,
        "attempt 1 not billed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cancel_before_the_node_answers_waits_for_the_fence() {
    let h = harness(8, 4).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    expect_assign(&mut out1).await;
    stream.cancel();
    assert!(matches!(
        out1.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    // The node is lost without confirming: cancelled only once its lease fenced it.
    n1.connection_lost();
    let started = tokio::time::Instant::now();
    match stream.next().await {
        Some(GenEvent::Cancelled(u)) => assert_eq!(u.completion_tokens, 0),
        other => panic!("expected cancelled, got {other:?}"),
    }
    assert!(started.elapsed() >= Timeouts::default().settle_wait);
    settle_a_moment().await;
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Settled);
}

#[tokio::test(start_paused = true)]
async fn a_client_leaving_during_the_fence_ends_it_cancelled() {
    use crate::lifecycle::{MessageState, Status};
    let h = harness(8, 4).await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let (n1, mut out1) = connect(&h, "n1").await;
    let stream = start_recorded(&h, "r1", &store).await;
    expect_assign(&mut out1).await;
    n1.connection_lost();
    settle_a_moment().await;
    drop(stream);
    tokio::time::sleep(Timeouts::default().lease * 2).await;
    settle_a_moment().await;
    // No second attempt for a client that left; nothing streamed, nothing billed; the
    // fenced attempt may have run, so its message is spent.
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Cancelled);
    assert!(
        h.gens.directory().get("r1").is_none(),
        "the generation ended"
    );
    let rec = store.records().pop().unwrap();
    assert_eq!(
        (rec.status, rec.message, rec.slot_held),
        (Status::Cancelled, MessageState::Consumed, false)
    );
}

#[tokio::test(start_paused = true)]
async fn a_recorded_generation_moves_through_accept_and_done() {
    use crate::lifecycle::{AttemptState, MessageState, Status};
    let h = harness(8, 4).await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start_recorded(&h, "r1", &store).await;
    let (_, attempt) = expect_assign(&mut out1).await;
    settle_a_moment().await;
    let rec = store.records().pop().unwrap();
    assert_eq!(
        (rec.attempt, rec.attempt_state, rec.message),
        (1, AttemptState::Dispatched, MessageState::Reserved)
    );
    n1.deliver(chunk("r1", attempt, 0, "hi"));
    n1.deliver(done("r1", attempt, 12, 1, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("hi".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    settle_a_moment().await;
    let rec = store.records().pop().unwrap();
    assert_eq!(
        (rec.status, rec.message, rec.output.as_deref()),
        (Status::Completed, MessageState::Consumed, Some("hi"))
    );
    assert_eq!((rec.input_tokens, rec.output_tokens), (12, 1));
}

#[tokio::test(start_paused = true)]
async fn a_refusal_crossing_a_cancel_ends_at_once_and_spends_nothing() {
    use crate::lifecycle::{GenerationStore, MessageState, Status};
    let h = harness(8, 4).await;
    let store = Arc::new(crate::lifecycle::memory::MemoryGenerations::default());
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start_recorded(&h, "r1", &store).await;
    expect_assign(&mut out1).await;
    store
        .apply_generation("r1", &crate::lifecycle::Event::RequestCancel, 0)
        .await
        .unwrap();
    stream.cancel();
    assert!(matches!(
        out1.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    let started = tokio::time::Instant::now();
    n1.deliver(NodeFrame::Error {
        request_id: "r1".into(),
        attempt: 1,
        code: "model_loading".into(),
        message: "loading".into(),
    });
    assert!(matches!(stream.next().await, Some(GenEvent::Cancelled(_))));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "no wait for a done that never comes"
    );
    settle_a_moment().await;
    let rec = store.records().pop().unwrap();
    assert_eq!(
        (rec.status, rec.message),
        (Status::Cancelled, MessageState::Released)
    );
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Cancelled);
}

#[tokio::test]
async fn mid_upgrade_work_only_new_agents_run_goes_to_them_and_never_holds_up_chat() {
    use crate::protocol::Api;
    let h = harness(8, 1).await;
    let (_old, mut old_out) = connect_with(&h, "n0", 1, BTreeMap::new()).await;
    let (_new, mut new_out) = connect_with(&h, "n1", 2, BTreeMap::new()).await;
    let unbounded = crate::ports::UsageBounds::UNBOUNDED;
    let t = Timeouts::default();
    // A completion goes to the only node that can run it, though the other is idle too.
    let _c0 = start_api(&h, "c0", None, unbounded, t, Api::Completions)
        .await
        .unwrap();
    let (id, _) = expect_assign(&mut new_out).await;
    assert_eq!(id, "c0");
    // The next one waits for that node; chat behind it is not held up by it.
    let _c1 = start_api(&h, "c1", None, unbounded, t, Api::Completions)
        .await
        .unwrap();
    let _chat = start(&h, "chat1").await.unwrap();
    let (id, _) = expect_assign(&mut old_out).await;
    assert_eq!(id, "chat1");
    settle_a_moment().await;
    assert!(
        new_out.try_recv().is_err(),
        "c1 waits for the new node's room"
    );
    assert!(old_out.try_recv().is_err(), "never on the old node");
}

#[tokio::test(start_paused = true)]
async fn a_crashed_node_actor_is_a_lost_node_for_the_attempt_it_held_and_nothing_else() {
    let h = harness(8, 4).await;
    let (_n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await.1, 1);
    let generation = h.gens.directory().get("r1").unwrap();
    generation
        .cast(GenerationMsg::NodeGone {
            node_id: "n2".into(),
        })
        .unwrap();
    settle_a_moment().await;
    assert!(
        out2.try_recv().is_err(),
        "another node's crash changes nothing"
    );
    let lost_at = tokio::time::Instant::now();
    generation
        .cast(GenerationMsg::NodeGone {
            node_id: "n1".into(),
        })
        .unwrap();
    // As on a lost connection: the attempt is fenced by its lease, then retried elsewhere.
    assert_eq!(expect_assign(&mut out2).await, ("r1".into(), 2));
    assert!(lost_at.elapsed() >= Timeouts::default().lease);
    n2.deliver(chunk("r1", 2, 0, "fresh"));
    n2.deliver(done("r1", 2, 12, 1, "stop"));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("fresh".into())));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
}
