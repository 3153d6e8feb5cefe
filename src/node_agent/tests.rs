//! The agent end to end: the real simulator as the engine, a scripted WebSocket peer as the
//! server (`test_peer`), and the agent in between over real sockets.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use switchyard_actors::protocol::{Gpu, Location, NodeFrame, ServerFrame};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::test_peer::{Conn, Peer};
use super::*;
use crate::sim::{FaultSpec, SimConfig, SimServer};

mod lease;

async fn sim(time_scale: f64, faults: FaultSpec) -> SimServer {
    SimServer::start(SimConfig {
        model: "tiny".into(),
        time_scale,
        max_model_len: Some(1024),
        faults,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn config(peer: &Peer, sim: &SimServer) -> AgentConfig {
    let mut cfg = AgentConfig::new(&peer.url, "node-1", "node-secret", sim.base_url());
    cfg.heartbeat_interval = Duration::from_millis(250);
    cfg.backoff_min = Duration::from_millis(10);
    cfg.backoff_max = Duration::from_millis(50);
    cfg.health_poll_interval = Duration::from_millis(20);
    cfg.seed = Some(7);
    cfg
}

struct Agent {
    task: JoinHandle<Result<(), AgentError>>,
    shutdown: CancellationToken,
    stats: Arc<AgentStats>,
}

fn start(cfg: AgentConfig) -> Agent {
    let shutdown = CancellationToken::new();
    let stats = Arc::new(AgentStats::default());
    let task = tokio::spawn(run_with_stats(cfg, shutdown.clone(), stats.clone()));
    Agent {
        task,
        shutdown,
        stats,
    }
}

impl Agent {
    /// Cancels the agent and checks that `run` returns Ok promptly.
    async fn stop(self) {
        self.shutdown.cancel();
        self.finished().await;
    }

    async fn finished(self) {
        tokio::time::timeout(Duration::from_secs(3), self.task)
            .await
            .expect("run did not return")
            .unwrap()
            .unwrap();
    }
}

fn assign(request_id: &str, max_tokens: u32) -> ServerFrame {
    assign_model(request_id, "tiny", max_tokens)
}

fn assign_model(request_id: &str, model: &str, max_tokens: u32) -> ServerFrame {
    ServerFrame::Assign {
        request_id: request_id.into(),
        attempt: 1,
        model: model.into(),
        // The server's client asked for a non-streamed answer under an alias; the agent
        // streams anyway and names the engine's model.
        body: serde_json::json!({
            "model": "small",
            "messages": [{"role": "user", "content": "Tell me about switchyards."}],
            "max_tokens": max_tokens,
            "stream": false,
        }),
        api: switchyard_actors::protocol::Api::Chat,
        x_request_id: None,
        traceparent: None,
        lease_ms: None,
        tier: None,
    }
}

fn ack(request_id: &str) -> ServerFrame {
    ServerFrame::Ack {
        request_id: request_id.into(),
        attempt: 1,
    }
}

fn cancel(request_id: &str) -> ServerFrame {
    ServerFrame::Cancel {
        request_id: request_id.into(),
        attempt: 1,
    }
}

async fn eventually(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the node sent for one attempt, up to its `done` (or an `error` without one).
#[derive(Debug, Default)]
struct Relayed {
    accepted: bool,
    seqs: Vec<u64>,
    text: String,
    error: Option<(String, String)>,
    done: Option<NodeFrame>,
}

impl Relayed {
    fn done_usage(&self) -> (u64, u64, &str) {
        match self.done.as_ref().expect("no done") {
            NodeFrame::Done {
                prompt_tokens,
                completion_tokens,
                finish_reason,
                ..
            } => (*prompt_tokens, *completion_tokens, finish_reason),
            other => panic!("{other:?}"),
        }
    }
}

/// Reads frames of `id` until its `done`; with `error_ends`, an `error` ends it too.
async fn relayed(conn: &mut Conn, id: &str, error_ends: bool) -> Relayed {
    let mut r = Relayed::default();
    loop {
        match conn.recv_work().await {
            NodeFrame::Accepted { request_id, .. } if request_id == id => r.accepted = true,
            NodeFrame::Chunk {
                request_id,
                seq,
                delta,
                ..
            } if request_id == id => {
                r.seqs.push(seq);
                let piece = switchyard_actors::output::Piece::from_wire(delta, None)
                    .expect("a well-formed delta");
                r.text.push_str(&piece.text);
            }
            NodeFrame::Error {
                request_id,
                code,
                message,
                ..
            } if request_id == id => {
                r.error = Some((code, message));
                if error_ends {
                    return r;
                }
            }
            f @ NodeFrame::Done { .. } => {
                assert!(matches!(&f, NodeFrame::Done { request_id, .. } if request_id == id));
                r.done = Some(f);
                return r;
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
}

/// Reads frames of `id` until `n` chunks arrived.
async fn accepted_and_chunks(conn: &mut Conn, n: usize) {
    assert!(matches!(conn.recv_work().await, NodeFrame::Accepted { .. }));
    for _ in 0..n {
        assert!(matches!(conn.recv_work().await, NodeFrame::Chunk { .. }));
    }
}

#[tokio::test]
async fn registers_with_the_engines_models_then_heartbeats() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let mut cfg = config(&peer, &sim);
    cfg.location = Location::Cloud;
    cfg.gpus = vec![Gpu {
        index: 0,
        name: "NVIDIA L40S".into(),
        memory_mib: 46_068,
    }];
    let agent = start(cfg.clone());
    let (mut conn, register) = peer.accept_registered().await;
    assert_eq!(
        register,
        NodeFrame::Register {
            node_id: "node-1".into(),
            token: "node-secret".into(),
            gpus: cfg.gpus.clone(),
            models: vec!["tiny".into()],
            version: cfg.version.clone(),
            location: Location::Cloud,
            protocol: switchyard_actors::protocol::PROTOCOL_VERSION,
        }
    );
    match conn.recv().await {
        NodeFrame::Heartbeat {
            queue_depth,
            running,
            gpu_util,
            models,
            assignments,
            ..
        } => {
            assert_eq!((queue_depth, running, gpu_util), (0, 0, 0.0));
            assert_eq!(models, ["tiny"]);
            assert_eq!(
                assignments,
                Some(Vec::new()),
                "holding nothing, and saying so"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(agent.stats.connections(), 1);
    assert_eq!(agent.stats.registrations(), 1);
    assert!(
        !format!("{cfg:?}").contains("node-secret"),
        "Debug redacts the token"
    );
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn an_assignment_streams_with_the_engines_exact_usage() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    // Frames the agent does not know, or cannot read, are ignored.
    conn.send_raw(r#"{"type":"reboot","now":true}"#);
    conn.send_raw("not json at all");
    conn.send(ServerFrame::LoadModel {
        name: "other".into(),
    });
    conn.send(assign("r1", 8));
    conn.send(assign("r1", 8)); // a duplicate of an attempt in flight
    let r = relayed(&mut conn, "r1", false).await;
    assert!(r.accepted && r.error.is_none());
    assert!(!r.seqs.is_empty() && !r.text.is_empty());
    assert_eq!(r.seqs, (0..r.seqs.len() as u64).collect::<Vec<_>>());
    // The `done` says how many chunks went out, so a gateway that got fewer knows.
    assert!(
        matches!(&r.done, Some(NodeFrame::Done { chunks: Some(n), .. }) if *n == r.seqs.len() as u64),
        "{:?}",
        r.done
    );
    let (prompt, completion, reason) = r.done_usage();
    let engine = sim.stats();
    assert_eq!(completion, 8);
    assert_eq!(engine.generation_tokens, 8, "the duplicate did not run");
    assert_eq!(prompt, engine.prompt_tokens);
    assert!(prompt > 0);
    assert_eq!(reason, "length");
    assert_eq!(agent.stats.unacked_dones(), 1);
    conn.send(ack("r1"));
    eventually("ack", Duration::from_secs(1), || {
        agent.stats.unacked_dones() == 0
    })
    .await;
    // A replay of an acked attempt is not run again.
    conn.send(assign("r1", 8));
    assert!(
        conn.try_recv_work(Duration::from_millis(300))
            .await
            .is_none()
    );
    assert_eq!(agent.stats.assignments(), 1);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn cancel_mid_stream_aborts_the_engine_sequence_and_reports_usage_so_far() {
    // Real time: about 19 ms per token, so 500 tokens would take ~10 s.
    let sim = sim(1.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 500));
    accepted_and_chunks(&mut conn, 3).await;
    assert_eq!(sim.stats().running, 1);
    conn.send(cancel("r1"));
    let cancelled_at = Instant::now();
    let r = relayed(&mut conn, "r1", false).await;
    let (prompt, completion, reason) = r.done_usage();
    assert_eq!(reason, "abort");
    assert!(prompt > 0);
    assert!((3..500).contains(&completion), "{completion}");
    eventually(
        "the engine to free the sequence",
        Duration::from_secs(1),
        || sim.stats().running == 0,
    )
    .await;
    assert!(cancelled_at.elapsed() < Duration::from_secs(1));
    // The engine may have produced a token or two the agent never saw.
    let produced = sim.stats().generation_tokens;
    assert!(
        completion <= produced && produced <= completion + 3,
        "{completion} vs {produced}"
    );
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn an_engine_crash_mid_stream_gives_done_error_then_an_error() {
    let faults = FaultSpec {
        crash_after_tokens: Some(3),
        ..Default::default()
    };
    let sim = sim(20.0, faults).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 50));
    let r = relayed(&mut conn, "r1", false).await;
    assert!(r.accepted);
    assert!(
        r.error.is_none(),
        "the done comes first: it proves the attempt started"
    );
    match conn.recv_work().await {
        NodeFrame::Error { code, .. } => assert_eq!(code, "model_backend_error"),
        other => panic!("expected the error after the done, got {other:?}"),
    }
    let (prompt, completion, reason) = r.done_usage();
    assert_eq!(reason, "error");
    assert!(prompt > 0);
    assert!((1..=3).contains(&completion), "{completion}");
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn an_engine_that_cannot_be_reached_is_refused_with_its_own_code() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    sim.set_faults(&FaultSpec {
        exit_after_ms: Some(0),
        ..Default::default()
    });
    sim.stopped().await;
    conn.send(assign("r-gone", 8));
    let r = relayed(&mut conn, "r-gone", true).await;
    let (code, message) = r.error.unwrap();
    assert_eq!(code, "engine_unreachable");
    assert!(message.starts_with("engine unreachable"), "{message}");
    assert!(!r.accepted);
    agent.stop().await;
}

#[tokio::test]
async fn engine_refusals_map_to_error_codes_without_done() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;

    conn.send(assign_model("r-404", "no-such-model", 8));
    let r = relayed(&mut conn, "r-404", true).await;
    let (code, message) = r.error.unwrap();
    assert_eq!(code, "model_not_found");
    assert!(message.contains("does not exist"), "{message}");
    assert!(!r.accepted);

    conn.send(assign("r-400", 0)); // max_tokens 0: vLLM answers 400
    let (code, _) = relayed(&mut conn, "r-400", true).await.error.unwrap();
    assert_eq!(code, "invalid_request");

    sim.set_faults(&FaultSpec {
        http_500: Some(1),
        ..Default::default()
    });
    conn.send(assign("r-500", 8));
    let (code, _) = relayed(&mut conn, "r-500", true).await.error.unwrap();
    assert_eq!(code, "model_backend_error");

    conn.send(ServerFrame::Assign {
        request_id: "r-body".into(),
        attempt: 1,
        model: "tiny".into(),
        body: serde_json::json!(["not", "an", "object"]),
        api: switchyard_actors::protocol::Api::Chat,
        x_request_id: None,
        traceparent: None,
        lease_ms: None,
        tier: None,
    });
    let (code, _) = relayed(&mut conn, "r-body", true).await.error.unwrap();
    assert_eq!(code, "invalid_request");

    assert!(
        conn.try_recv_work(Duration::from_millis(300))
            .await
            .is_none(),
        "no done after a refusal"
    );
    assert_eq!(agent.stats.unacked_dones(), 0);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn unacked_dones_are_resent_after_a_reconnect_until_acked() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 4));
    let done = relayed(&mut conn, "r1", false).await.done.unwrap();
    conn.close();

    let (mut conn, _) = peer.accept_registered().await;
    assert_eq!(conn.recv().await, done, "the unacked done comes first");
    conn.send(ack("r1"));
    eventually("ack", Duration::from_secs(1), || {
        agent.stats.unacked_dones() == 0
    })
    .await;
    conn.close();

    let (mut conn, _) = peer.accept_registered().await;
    assert!(matches!(conn.recv().await, NodeFrame::Heartbeat { .. }));
    assert_eq!(agent.stats.registrations(), 3);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn a_lost_connection_cancels_in_flight_work_and_keeps_its_done() {
    let sim = sim(1.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 500));
    accepted_and_chunks(&mut conn, 2).await;
    conn.close();
    eventually(
        "the engine to free the sequence",
        Duration::from_secs(1),
        || sim.stats().running == 0,
    )
    .await;
    let (mut conn, _) = peer.accept_registered().await;
    match conn.recv().await {
        NodeFrame::Done {
            request_id,
            completion_tokens,
            finish_reason,
            ..
        } => {
            assert_eq!(request_id, "r1");
            assert_eq!(finish_reason, "abort");
            assert!(completion_tokens >= 2);
        }
        other => panic!("{other:?}"),
    }
    agent.stop().await;
    sim.shutdown().await;
}

/// The request ids a heartbeat lists, in order.
fn listed(frame: &NodeFrame) -> Option<Vec<(String, u64)>> {
    match frame {
        NodeFrame::Heartbeat {
            assignments: Some(held),
            ..
        } => Some(
            held.iter()
                .map(|h| (h.request_id.clone(), h.attempt))
                .collect(),
        ),
        _ => None,
    }
}

#[tokio::test]
async fn heartbeats_list_the_running_assignments_until_their_done_is_sent() {
    let faults = FaultSpec {
        stall_after_tokens: Some(2),
        ..Default::default()
    };
    let sim = sim(20.0, faults).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 100));
    conn.send(assign("r2", 100));
    let both = vec![("r1".to_owned(), 1), ("r2".to_owned(), 1)];
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        assert!(Instant::now() < deadline, "no heartbeat listing both");
        if listed(&conn.recv().await).as_ref() == Some(&both) {
            break;
        }
    }
    // Once r1's `done` is on the socket, no heartbeat after it lists r1; every one before it
    // still does.
    conn.send(cancel("r1"));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut done = false;
    loop {
        assert!(Instant::now() < deadline, "no heartbeat after the done");
        let frame = conn.recv().await;
        if matches!(&frame, NodeFrame::Done { request_id, .. } if request_id == "r1") {
            done = true;
            continue;
        }
        let Some(held) = listed(&frame) else {
            continue;
        };
        if done {
            assert_eq!(held, [("r2".to_owned(), 1)]);
            break;
        }
        assert_eq!(held, both, "left out before its done was sent");
    }
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn heartbeats_follow_the_engines_running_count() {
    let faults = FaultSpec {
        stall_after_tokens: Some(2),
        ..Default::default()
    };
    let sim = sim(20.0, faults).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 100));
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        assert!(
            Instant::now() < deadline,
            "no heartbeat with the stalled request"
        );
        if let NodeFrame::Heartbeat {
            running,
            kv_cache_usage,
            ..
        } = conn.recv().await
            && running == 1
        {
            assert!(kv_cache_usage > 0.0 && kv_cache_usage <= 1.0);
            break;
        }
    }
    conn.send(cancel("r1"));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut done = None;
    loop {
        assert!(
            Instant::now() < deadline,
            "no idle heartbeat after the cancel"
        );
        match conn.recv().await {
            NodeFrame::Heartbeat { running: 0, .. } if done.is_some() => break,
            f @ NodeFrame::Done { .. } => done = Some(f),
            _ => {}
        }
    }
    match done.unwrap() {
        NodeFrame::Done {
            completion_tokens,
            finish_reason,
            ..
        } => assert_eq!((completion_tokens, finish_reason.as_str()), (2, "abort")),
        _ => unreachable!(),
    }
    assert!(agent.stats.heartbeats() >= 2);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn drain_refuses_new_work_finishes_in_flight_and_returns_ok() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 100));
    assert!(matches!(conn.recv_work().await, NodeFrame::Accepted { .. }));
    conn.send(ServerFrame::Drain {});
    conn.send(assign("r2", 8));
    let mut refused = false;
    let mut finished = None;
    while finished.is_none() || !refused {
        match conn.recv_work().await {
            NodeFrame::Error {
                request_id, code, ..
            } => {
                assert_eq!((request_id.as_str(), code.as_str()), ("r2", "draining"));
                refused = true;
            }
            NodeFrame::Done {
                request_id,
                completion_tokens,
                finish_reason,
                ..
            } => {
                assert_eq!(request_id, "r1");
                finished = Some((completion_tokens, finish_reason));
            }
            NodeFrame::Chunk { request_id, .. } => assert_eq!(request_id, "r1"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(finished.unwrap(), (100, "length".to_owned()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !agent.task.is_finished(),
        "the agent waits for the last ack"
    );
    conn.send(ack("r1"));
    conn.closed().await;
    agent.finished().await;
}

#[tokio::test]
async fn rejected_with_retry_after_delays_the_next_attempt() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let mut conn = peer.accept().await;
    assert!(matches!(conn.recv().await, NodeFrame::Register { .. }));
    conn.send(ServerFrame::Rejected {
        reason: "registration rate limit".into(),
        retry_after_ms: Some(400),
    });
    let rejected_at = Instant::now();
    conn.close();
    let (_conn, _) = peer.accept_registered().await;
    assert!(
        rejected_at.elapsed() >= Duration::from_millis(400),
        "retried after {:?}",
        rejected_at.elapsed()
    );
    assert_eq!(agent.stats.rejections(), 1);
    eventually("registration", Duration::from_secs(1), || {
        agent.stats.registrations() == 1
    })
    .await;
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn waits_for_the_engine_to_load_before_registering() {
    // 12 s of engine time at time scale 20: /health answers 503 for 600 ms.
    let faults = FaultSpec {
        load_delay_ms: Some(12_000),
        ..Default::default()
    };
    let sim = sim(20.0, faults).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    assert!(peer.try_accept(Duration::from_millis(300)).await.is_none());
    assert_eq!(agent.stats.connections(), 0);
    let (_conn, register) = peer.accept_registered().await;
    assert!(matches!(register, NodeFrame::Register { models, .. } if models == ["tiny"]));
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn a_silent_server_is_left_and_a_quiet_live_one_is_kept() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (conn, _) = peer.accept_registered().await;
    conn.mute();
    let muted_at = Instant::now();
    let (_conn, _) = peer.accept_registered().await;
    let detected = muted_at.elapsed();
    // Idle bound: max(3 heartbeat intervals, 2 s), plus at most 50 ms of backoff.
    assert!(
        (Duration::from_millis(1900)..Duration::from_secs(4)).contains(&detected),
        "{detected:?}"
    );
    // A server that sends nothing but answers pings stays connected past that bound.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(agent.stats.connections(), 2);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn shutdown_cancels_work_flushes_its_done_and_returns_ok() {
    let sim = sim(1.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let agent = start(config(&peer, &sim));
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(assign("r1", 500));
    accepted_and_chunks(&mut conn, 1).await;
    let stopped_at = Instant::now();
    agent.stop().await;
    assert!(stopped_at.elapsed() < Duration::from_millis(1500));
    let r = relayed(&mut conn, "r1", false).await;
    assert_eq!(r.done_usage().2, "abort");
    conn.closed().await;
    eventually(
        "the engine to free the sequence",
        Duration::from_secs(1),
        || sim.stats().running == 0,
    )
    .await;
    sim.shutdown().await;
}

/// Recognises the error a bad configuration should give.
type IsExpected = fn(&AgentError) -> bool;

#[tokio::test]
async fn unusable_configuration_is_an_error_at_once() {
    let token = CancellationToken::new();
    let engine = "http://127.0.0.1:9";
    let cases: [(AgentConfig, IsExpected); 4] = [
        (AgentConfig::new("ftp://x", "n", "t", engine), |e| {
            matches!(e, AgentError::ServerUrl(_))
        }),
        (
            AgentConfig {
                ca_file: Some("/nonexistent/ca.pem".into()),
                ..AgentConfig::new("https://x", "n", "t", engine)
            },
            |e| matches!(e, AgentError::Tls(_)),
        ),
        (AgentConfig::new("http://x", "n", "t", "nope"), |e| {
            matches!(e, AgentError::EngineUrl(_))
        }),
        (AgentConfig::new("http://x", "", "t", engine), |e| {
            matches!(e, AgentError::Config(_))
        }),
    ];
    for (cfg, expected) in cases {
        let err = tokio::time::timeout(Duration::from_secs(1), run(cfg, token.clone()))
            .await
            .unwrap()
            .unwrap_err();
        assert!(expected(&err), "{err}");
    }
}

#[test]
fn server_urls_map_to_the_control_plane_endpoint() {
    let e = Endpoint::from_server_url("http://gw.internal:8080").unwrap();
    assert_eq!(e.url, "ws://gw.internal:8080/v1/nodes/connect");
    assert_eq!(
        (e.scheme, e.host.as_str(), e.port),
        (Scheme::Ws, "gw.internal", 8080)
    );
    let e = Endpoint::from_server_url("https://switchyard.example.com/").unwrap();
    assert_eq!(e.url, "wss://switchyard.example.com/v1/nodes/connect");
    assert_eq!((e.scheme, e.port), (Scheme::Wss, 443));
    let e = Endpoint::from_server_url("http://[::1]:9000/prefix/").unwrap();
    assert_eq!(e.url, "ws://[::1]:9000/prefix/v1/nodes/connect");
    assert_eq!(e.host, "::1");
    assert!(Endpoint::from_server_url("http://user:pw@h:1").is_err());
    assert!(Endpoint::from_server_url("localhost:8080").is_err());
}
