//! Attempt leases and injected faults, end to end: the agent between the simulator and the
//! scripted peer, whose silence (a muted, half-open socket) the agent has not yet noticed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

/// An assignment of `max_tokens` holding a lease of `lease_ms`.
fn leased(request_id: &str, max_tokens: u32, lease_ms: u64) -> ServerFrame {
    match assign(request_id, max_tokens) {
        ServerFrame::Assign {
            request_id,
            attempt,
            model,
            body,
            api,
            ..
        } => ServerFrame::Assign {
            request_id,
            attempt,
            model,
            body,
            api,
            x_request_id: None,
            traceparent: None,
            lease_ms: Some(lease_ms),
            tier: None,
        },
        other => unreachable!("{other:?}"),
    }
}

/// The `(request_id, completion_tokens, finish_reason)` of a `done`.
fn done_of(frame: NodeFrame) -> (String, u64, String) {
    match frame {
        NodeFrame::Done {
            request_id,
            completion_tokens,
            finish_reason,
            ..
        } => (request_id, completion_tokens, finish_reason),
        other => panic!("expected a done, got {other:?}"),
    }
}

#[tokio::test]
async fn a_leased_attempt_stops_when_a_half_open_server_goes_silent() {
    // Real time: about 19 ms per token, so 500 tokens would run ~10 s.
    let sim = sim(1.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let mut cfg = config(&peer, &sim);
    // The idle bound is then max(3 × 1 s, 2 s) = 3 s: the lease must act long before it.
    cfg.heartbeat_interval = Duration::from_secs(1);
    let agent = start(cfg);
    let (mut conn, _) = peer.accept_registered().await;
    conn.send(leased("leased", 500, 400));
    conn.send(assign("plain", 500));
    let mut accepted = 0;
    let mut chunks = 0;
    while accepted < 2 || chunks < 4 {
        match conn.recv_work().await {
            NodeFrame::Accepted { .. } => accepted += 1,
            NodeFrame::Chunk { .. } => chunks += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(sim.stats().running, 2);

    // Half-open: the socket stays up but nothing comes back, not even a pong.
    conn.mute();
    let muted_at = Instant::now();
    eventually(
        "the lease to close the leased engine request",
        Duration::from_secs(2),
        || sim.stats().running == 1,
    )
    .await;
    let stopped_after = muted_at.elapsed();
    // Heard at most one ping interval (L/3) before the mute, stopped at L after that.
    assert!(
        (Duration::from_millis(200)..Duration::from_millis(1200)).contains(&stopped_after),
        "{stopped_after:?}"
    );
    assert_eq!(
        agent.stats.connections(),
        1,
        "the lease acted before the connection was given up"
    );
    // The unleased attempt runs on until the connection is given up.
    assert_eq!(agent.stats.in_flight(), 1);

    let (mut conn, _) = peer.accept_registered().await;
    assert!(
        muted_at.elapsed() >= Duration::from_millis(2700),
        "reconnected by the idle bound, not by the lease"
    );
    eventually(
        "the engine to free the unleased sequence",
        Duration::from_secs(1),
        || sim.stats().running == 0,
    )
    .await;
    // Both dones come back first, in the order they were recorded.
    let (id, leased_tokens, reason) = done_of(conn.recv().await);
    assert_eq!((id.as_str(), reason.as_str()), ("leased", "abort"));
    let (id, plain_tokens, reason) = done_of(conn.recv().await);
    assert_eq!((id.as_str(), reason.as_str()), ("plain", "abort"));
    assert!(leased_tokens >= 2, "usage so far: {leased_tokens}");
    assert!(
        plain_tokens > leased_tokens + 50,
        "the plain attempt ran ~2.5 s longer: {plain_tokens} vs {leased_tokens}"
    );
    assert_eq!(agent.stats.unacked_dones(), 2);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn a_leased_attempt_on_a_quiet_healthy_connection_is_kept_alive_by_pings() {
    // About 19 ms per token: 100 tokens take ~2 s, more than six 300 ms leases.
    let sim = sim(1.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let mut cfg = config(&peer, &sim);
    // Heartbeat pings only at connect and after 10 s: they cannot renew the lease here.
    cfg.heartbeat_interval = Duration::from_secs(10);
    let agent = start(cfg);
    let (mut conn, _) = peer.accept_registered().await;
    assert!(matches!(conn.recv().await, NodeFrame::Heartbeat { .. }));
    let pings_before = conn.pings();
    let started = Instant::now();
    conn.send(leased("r1", 100, 300));
    // The peer sends nothing more; only its automatic pongs answer the agent's pings.
    let r = relayed(&mut conn, "r1", false).await;
    let took = started.elapsed();
    assert!(took > Duration::from_millis(1200), "{took:?}");
    assert!(r.accepted && r.error.is_none());
    let (_, completion, reason) = r.done_usage();
    assert_eq!((completion, reason), (100, "length"));
    assert_eq!(sim.stats().generation_tokens, 100);
    // One ping per L/3 = 100 ms; allow for scheduling slack.
    let pings = conn.pings() - pings_before;
    let expected = (took.as_millis() / 100) as u64;
    assert!(
        pings >= expected / 2 && pings <= expected + 2,
        "{pings} pings in {took:?}"
    );
    assert_eq!(agent.stats.connections(), 1);
    agent.stop().await;
    sim.shutdown().await;
}

#[tokio::test]
async fn drop_accepted_swallows_only_the_next_accepted_frames() {
    let sim = sim(20.0, FaultSpec::default()).await;
    let mut peer = Peer::start().await;
    let cfg = config(&peer, &sim);
    let faults = cfg.faults.clone();
    faults.drop_accepted(1);
    let agent = start(cfg);
    let (mut conn, _) = peer.accept_registered().await;

    conn.send(assign("r1", 8));
    let r1 = relayed(&mut conn, "r1", false).await;
    assert!(!r1.accepted, "the first accepted was dropped");
    assert!(r1.error.is_none());
    assert_eq!(r1.seqs, (0..r1.seqs.len() as u64).collect::<Vec<_>>());
    assert!(!r1.seqs.is_empty() && !r1.text.is_empty());
    assert_eq!(r1.done_usage().1, 8);
    assert_eq!(faults.pending_dropped_accepted(), 0);

    conn.send(assign("r2", 8));
    let r2 = relayed(&mut conn, "r2", false).await;
    assert!(r2.accepted, "only one accepted was dropped");
    assert!(!r2.seqs.is_empty());
    assert_eq!(r2.done_usage().1, 8);
    agent.stop().await;
    sim.shutdown().await;
}
