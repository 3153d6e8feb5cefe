//! Supervision tests on a paused clock: the whole tree in-process, real queue, node and
//! generation actors, an in-memory ledger, each node's socket replaced by its frame channel,
//! and panics injected through the test-only fault hooks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tokio::sync::mpsc;

use super::*;
use crate::error::{ErrorCode, Failure};
use crate::generation::{
    GenEvent, GenerationArgs, GenerationStream, StreamBound, Timeouts, events,
};
use crate::model_queue::{QueueConfig, RoutingStrategy};
use crate::node::{NodeArgs, NodeHandle};
use crate::ports::SystemClock;
use crate::ports::memory::{MapCoordinator, MemoryLedger, RowStatus};
use crate::protocol::{Api, NodeFrame, ServerFrame};
use crate::test_counter::CounterCell;

const MODEL: &str = "llama-3.1-8b-instruct";

/// Counts `switchyard_actor_restarts_total` by `kind` (installed on the test's only thread:
/// a paused-clock test runs every actor there).
#[derive(Debug, Default)]
struct Restarts(Mutex<BTreeMap<String, Arc<AtomicU64>>>);

impl Restarts {
    fn of(&self, kind: &str) -> u64 {
        self.0
            .lock()
            .unwrap()
            .get(kind)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }
}

impl Recorder for Restarts {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() != crate::metric_names::ACTOR_RESTARTS_TOTAL {
            return Counter::noop();
        }
        let kind = key
            .labels()
            .find(|l| l.key() == "kind")
            .map(|l| l.value().to_owned())
            .unwrap_or_default();
        let cell = self.0.lock().unwrap().entry(kind).or_default().clone();
        Counter::from_arc(Arc::new(CounterCell(cell)))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

struct Harness {
    sup: Supervision,
    ledger: Arc<MemoryLedger>,
}

impl Harness {
    fn queue(&self) -> &crate::model_queue::ModelQueueHandle {
        &self.sup.queues[MODEL]
    }
}

async fn harness(node_capacity: u32, queue_policy: RestartPolicy) -> Harness {
    let ledger = Arc::new(MemoryLedger::default());
    let sup = Supervision::start(SupervisionArgs {
        ledger: ledger.clone(),
        queues: vec![QueueArgs {
            model: MODEL.into(),
            config: QueueConfig {
                max_waiting: 8,
                max_waiting_tokens: u64::MAX,
                policy: crate::tier::Policy::fifo(Duration::from_secs(30)),
                node_capacity,
                routing: RoutingStrategy::LeastLoaded,
                cache_blocks: 1024,
            },
            clock: Arc::new(SystemClock),
            cluster: None,
        }],
        queue_policy,
        supervisor_policy: RestartPolicy {
            max_restarts: 1,
            window: Duration::from_secs(600),
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        },
        extra: Vec::new(),
    })
    .await
    .unwrap();
    Harness { sup, ledger }
}

async fn connect(h: &Harness, id: &str) -> (NodeHandle, mpsc::Receiver<ServerFrame>) {
    let (tx, rx) = mpsc::channel(64);
    let args = NodeArgs {
        node_id: id.into(),
        models: vec![MODEL.into()],
        link: crate::node::Link::Socket(tx),
        queues: [(MODEL.to_string(), h.queue().clone())].into(),
        directory: h.sup.nodes.directory().clone(),
        ledger: h.ledger.clone(),
        lifecycle: None,
        coordinator: Arc::new(MapCoordinator::default()),
        replica_id: "r1".into(),
        heartbeat_timeout: Duration::from_secs(3600),
        clock: Arc::new(SystemClock),
        trust: crate::node::NodeTrust::default(),
        protocol: crate::protocol::PROTOCOL_VERSION,
        gpus: 0,
        accounting: None,
        capacity: BTreeMap::new(),
    };
    let node = h.sup.nodes.start(args).await.unwrap();
    settle().await;
    (node, rx)
}

async fn start(h: &Harness, request_id: &str) -> Result<GenerationStream, Failure> {
    let (tx, rx) = events::channel(StreamBound::default());
    let args = GenerationArgs {
        request_id: request_id.into(),
        model: MODEL.into(),
        body: serde_json::json!({"model": MODEL, "messages": []}),
        api: Api::Chat,
        embedding_dimensions: None,
        x_request_id: None,
        traceparent: None,
        reservation: crate::ports::memory::reservation(
            request_id,
            MODEL,
            crate::ports::UsageBounds::UNBOUNDED,
        ),
        queue: h.queue().clone(),
        route: None,
        ledger: h.ledger.clone(),
        events: tx,
        timeouts: Timeouts::default(),
        clock: Arc::new(SystemClock),
        on_end: None,
        lifecycle: None,
        resumable: false,
        tier: crate::tier::Tier::Default,
        attempts: None,
    };
    h.sup.generations.start_generation(args, rx).await
}

/// The next assignment sent to the node (acks of settled `done`s skipped).
async fn expect_assign(out: &mut mpsc::Receiver<ServerFrame>) -> (String, u64) {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), out.recv())
            .await
            .expect("an assign within a minute")
            .expect("the connection is open")
        {
            ServerFrame::Assign {
                request_id,
                attempt,
                ..
            } => return (request_id, attempt),
            ServerFrame::Ack { .. } => {}
            other => panic!("expected assign, got {other:?}"),
        }
    }
}

/// The next terminal event (deltas skipped), within the request's own deadlines.
async fn end_of(stream: &mut GenerationStream) -> GenEvent {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), stream.next())
            .await
            .expect("the generation ends: it never hangs")
            .expect("a terminal event");
        if !matches!(event, GenEvent::Delta(_)) {
            return event;
        }
    }
}

fn finish(node: &NodeHandle, id: &str, attempt: u64) {
    node.deliver(NodeFrame::Accepted {
        request_id: id.into(),
        attempt,
    });
    node.deliver(NodeFrame::Done {
        request_id: id.into(),
        attempt,
        prompt_tokens: 10,
        completion_tokens: 2,
        finish_reason: "stop".into(),
        cached_tokens: None,
        chunks: None,
    });
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(5)).await;
}

#[tokio::test(start_paused = true)]
async fn a_crashed_queue_is_restarted_rebuilt_from_its_nodes_and_its_waiters_dispatched() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    let mut waiting = start(&h, "r2").await.unwrap();
    settle().await;
    assert_eq!(h.queue().stats().await.unwrap().waiting, 1);

    h.queue().crash();
    settle().await;

    assert_eq!(restarts.of(kind::MODEL_QUEUE), 1);
    assert!(h.queue().is_bound());
    let stats = h.queue().stats().await.unwrap();
    // The node re-announced its one assignment: the node is full, nothing over-assigned.
    assert_eq!(stats.nodes, vec![("n1".to_string(), 1, false)]);
    assert_eq!(stats.waiting, 1, "the waiting generation re-queued itself");
    assert!(out.try_recv().is_err(), "no assignment past capacity");

    // A new request for the model is admitted by the new queue.
    let mut third = start(&h, "r3").await.unwrap();
    settle().await;
    assert_eq!(h.queue().stats().await.unwrap().waiting, 2);

    // The slot frees: the generation that waited through the crash goes first.
    finish(&node, "r1", 1);
    assert!(matches!(end_of(&mut first).await, GenEvent::Finished(_)));
    assert_eq!(expect_assign(&mut out).await, ("r2".into(), 1));
    finish(&node, "r2", 1);
    assert!(matches!(end_of(&mut waiting).await, GenEvent::Finished(_)));
    assert_eq!(expect_assign(&mut out).await, ("r3".into(), 1));
    finish(&node, "r3", 1);
    assert!(matches!(end_of(&mut third).await, GenEvent::Finished(_)));
    assert_eq!(h.ledger.row("r2").unwrap().status, RowStatus::Settled);
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_crashed_node_actor_closes_its_connection_and_its_work_is_retried_elsewhere() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out1).await, ("r1".into(), 1));
    let (n2, mut out2) = connect(&h, "n2").await;

    n1.crash();
    settle().await;

    assert_eq!(restarts.of(kind::NODE), 1);
    // Its socket's writer sees the channel close: the agent reconnects.
    assert!(
        out1.recv().await.is_none(),
        "the crashed node's connection is closed"
    );
    let stats = h.queue().stats().await.unwrap();
    assert_eq!(stats.nodes, vec![("n2".to_string(), 0, false)]);
    // Nothing streamed: after the lost node's lease the attempt is fenced and retried.
    assert_eq!(expect_assign(&mut out2).await, ("r1".into(), 2));
    finish(&n2, "r1", 2);
    assert!(matches!(end_of(&mut stream).await, GenEvent::Finished(_)));
    // The node may connect again, supervised like the first time.
    let (_again, _out) = connect(&h, "n1").await;
    assert_eq!(h.sup.nodes.len(), 2);
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_streaming_generation_on_a_crashed_node_ends_typed() {
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    node.deliver(NodeFrame::Accepted {
        request_id: "r1".into(),
        attempt: 1,
    });
    node.deliver(NodeFrame::Chunk {
        request_id: "r1".into(),
        attempt: 1,
        seq: 0,
        delta: crate::output::WireDelta::Text("Hel".into()),
        logprobs: None,
    });
    settle().await;

    node.crash();

    match end_of(&mut stream).await {
        GenEvent::Failed(f) => assert_eq!(f.code, ErrorCode::ModelBackendError),
        other => panic!("expected a typed failure, got {other:?}"),
    }
    // No `done` came back: after the wait for one, the row is settled from what streamed.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_ne!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);
    // The queue no longer routes to it.
    let refused = start(&h, "r2").await.err().unwrap();
    assert_eq!(refused.code, ErrorCode::NoHealthyNode);
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_for_nodes_that_left_moments_ago_and_is_refused_once_they_stay_away() {
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (node, _out) = connect(&h, "n1").await;
    // A queue tick sees it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    node.stop();
    settle().await;

    // Its replica died, say: the request waits for the node, which comes back and runs it.
    let mut waiting = start(&h, "r1").await.expect("admitted to wait");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (back, mut out) = connect(&h, "n1").await;
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    finish(&back, "r1", 1);
    assert!(matches!(end_of(&mut waiting).await, GenEvent::Finished(_)));

    // Gone for longer than that: refused at once.
    tokio::time::sleep(Duration::from_millis(200)).await;
    back.stop();
    tokio::time::sleep(crate::model_queue::NODES_RETURN_WITHIN).await;
    let refused = start(&h, "r2").await.err().unwrap();
    assert_eq!(refused.code, ErrorCode::NoHealthyNode);
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_queue_crashing_in_a_loop_escalates_and_is_then_reported_down_typed() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let policy = RestartPolicy {
        max_restarts: 1,
        window: Duration::from_secs(600),
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
    };
    let h = harness(1, policy).await;
    let (_node, mut out) = connect(&h, "n1").await;
    let _first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    let mut waiting = start(&h, "r2").await.unwrap();
    settle().await;

    // First crash: restarted at once.
    h.queue().crash();
    settle().await;
    assert_eq!(restarts.of(kind::MODEL_QUEUE), 1);
    assert_eq!(restarts.of(kind::SUPERVISOR), 0);
    // Second within the window: the queue supervisor escalates; the root restarts it (after
    // its first-restart-immediate policy) and every queue is rebuilt.
    h.queue().crash();
    settle().await;
    assert_eq!(restarts.of(kind::MODEL_QUEUE), 2);
    assert_eq!(restarts.of(kind::SUPERVISOR), 1);
    assert!(h.sup.down().is_empty());
    let stats = h.queue().stats().await.unwrap();
    assert_eq!(stats.nodes, vec![("n1".to_string(), 1, false)]);
    assert_eq!(stats.waiting, 1, "still waiting, in the rebuilt queue");

    // The fresh queue supervisor allows one more restart; the one after escalates again,
    // past the root's budget: the queues are given up on and the replica reports it.
    h.queue().crash();
    settle().await;
    h.queue().crash();
    settle().await;
    assert_eq!(restarts.of(kind::SUPERVISOR), 2);
    assert_eq!(h.sup.down(), vec!["model_queues"]);
    assert!(!h.queue().is_bound());
    // The waiter ends typed, and new requests are refused typed at once: never a hang.
    match end_of(&mut waiting).await {
        GenEvent::Failed(f) => assert_eq!(f.code, ErrorCode::NoHealthyNode),
        other => panic!("expected no_healthy_node, got {other:?}"),
    }
    let refused = tokio::time::timeout(Duration::from_secs(1), start(&h, "r3"))
        .await
        .expect("refused at once")
        .err()
        .unwrap();
    assert_eq!(refused.code, ErrorCode::NoHealthyNode);
    assert_eq!(h.ledger.row("r2").unwrap().status, RowStatus::Cancelled);
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn the_queue_restarts_after_a_growing_backoff() {
    let policy = RestartPolicy {
        max_restarts: 5,
        window: Duration::from_secs(60),
        backoff: Duration::from_secs(1),
        max_backoff: Duration::from_secs(5),
    };
    let h = harness(1, policy).await;
    let (_node, _out) = connect(&h, "n1").await;
    h.queue().crash();
    settle().await;
    assert!(h.queue().is_bound(), "the first restart is immediate");
    h.queue().crash();
    settle().await;
    // Meanwhile requests are refused typed, not hung.
    assert!(!h.queue().is_bound());
    assert_eq!(
        start(&h, "r1").await.err().unwrap().code,
        ErrorCode::NoHealthyNode
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(h.queue().is_bound(), "restarted after its backoff");
    assert!(start(&h, "r2").await.is_ok());
    h.sup.stop();
}

#[test]
fn the_restart_window_backs_off_then_escalates_and_forgets_old_crashes() {
    let policy = RestartPolicy {
        max_restarts: 3,
        window: Duration::from_secs(10),
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(150),
    };
    let mut w = RestartWindow::default();
    let t0 = Instant::now();
    assert_eq!(w.record(t0, &policy), Some(Duration::ZERO));
    assert_eq!(w.record(t0, &policy), Some(Duration::from_millis(100)));
    assert_eq!(w.record(t0, &policy), Some(Duration::from_millis(150)));
    assert_eq!(w.record(t0, &policy), None);
    // Past the window the old crashes no longer count.
    assert_eq!(
        w.record(t0 + Duration::from_secs(11), &policy),
        Some(Duration::ZERO)
    );
}

#[tokio::test(start_paused = true)]
async fn a_crashed_generation_supervisor_is_restarted_and_settles_what_died_with_it() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (node, mut out) = connect(&h, "n1").await;
    let _first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    let mut waiting = start(&h, "r2").await.unwrap();
    settle().await;

    h.sup.generations.crash_supervisor();
    settle().await;

    assert_eq!(restarts.of(kind::SUPERVISOR), 1);
    match end_of(&mut waiting).await {
        GenEvent::Failed(f) => assert_eq!(f.code, ErrorCode::ModelBackendError),
        other => panic!("expected a typed failure, got {other:?}"),
    }
    assert_eq!(h.ledger.row("r2").unwrap().status, RowStatus::Cancelled);
    assert!(h.sup.generations.directory().is_empty());
    // The running one's row was released as after its own crash; the node's later `done`
    // finds no generation and is acked (the row stays final), so the node may forget it.
    assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Cancelled);
    finish(&node, "r1", 1);
    settle().await;
    assert!(matches!(
        out.try_recv(),
        Ok(ServerFrame::Ack { request_id, attempt: 1 }) if request_id == "r1"
    ));
    // New generations start under the new supervisor.
    let mut next = start(&h, "r3").await.unwrap();
    settle().await;
    assert_eq!(expect_assign(&mut out).await, ("r3".into(), 1));
    finish(&node, "r3", 1);
    assert!(matches!(end_of(&mut next).await, GenEvent::Finished(_)));
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_crashed_node_supervisor_is_restarted_and_its_nodes_reconnect() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (_node, mut out) = connect(&h, "n1").await;

    h.sup.nodes.crash_supervisor();
    settle().await;

    assert_eq!(restarts.of(kind::SUPERVISOR), 1);
    assert!(
        out.recv().await.is_none(),
        "its node's connection is closed"
    );
    assert!(h.queue().stats().await.unwrap().nodes.is_empty());
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    finish(&node, "r1", 1);
    assert!(matches!(end_of(&mut stream).await, GenEvent::Finished(_)));
    h.sup.stop();
}

#[tokio::test(start_paused = true)]
async fn a_generation_supervisor_stopped_on_purpose_ends_its_streams_and_stays_stopped() {
    let restarts = Restarts::default();
    let _recorder = metrics::set_default_local_recorder(&restarts);
    let h = harness(1, RestartPolicy::QUEUES).await;
    let (_node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));

    h.sup.generations.stop();

    // Nothing the tree keeps holds the client's stream open.
    let ended = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("the stream ends with its generation");
    assert_eq!(ended, None);
    // A deliberate stop is no crash: not counted, not restarted.
    settle().await;
    assert_eq!(restarts.of(kind::SUPERVISOR), 0);
    assert_eq!(
        start(&h, "r2").await.err().unwrap().code,
        ErrorCode::QuotaServiceUnavailable
    );
    h.sup.stop();
}
