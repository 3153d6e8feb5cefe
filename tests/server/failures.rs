//! Every way a stream can end early: the client leaves, the engine crashes, the server
//! restarts under a running request. Each must end the stream, free the engine and settle
//! the ledger row exactly once with what was produced.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard::sim::FaultSpec;
use switchyard::store::LedgerStatus;

use crate::common::{fleet, post_chat, read_events, settled_row, wait_for};

fn long_chat(max_tokens: u32) -> Value {
    json!({
        "model": "small",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": max_tokens,
        "stream": true,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_drops_mid_stream_frees_the_engine_at_once_and_settles_partial_tokens() {
    let fleet = fleet(&[("small", 1)], 1.0, |_| {}).await;
    let resp = post_chat(&fleet, &long_chat(2000)).await;
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    while seen.matches("\"content\"").count() < 4 {
        seen.push_str(&String::from_utf8_lossy(
            &body.next().await.unwrap().unwrap(),
        ));
    }
    let request_id = crate::common::completion_id(&seen);
    let sim = &fleet.nodes[0].sim;
    assert_eq!(sim.stats().running, 1);
    let dropped = std::time::Instant::now();
    drop(body);
    wait_for(
        Duration::from_secs(3),
        "the engine to stop the sequence",
        || async { sim.stats().running == 0 },
    )
    .await;
    // Nobody can come back to a chat completion without Idempotency-Key: no grace (2 s).
    assert!(
        dropped.elapsed() < Duration::from_millis(1500),
        "stopped without waiting out the grace: {:?}",
        dropped.elapsed()
    );
    let row = settled_row(&fleet.store, &request_id).await;
    let generated = sim.stats().generation_tokens as i64;
    assert!(
        row.completion_tokens > 0 && row.completion_tokens < 2000,
        "partial: {}",
        row.completion_tokens
    );
    // The engine may have produced a token after the agent's last read and before the abort
    // reached it (vLLM has the same race): the settle is the last usage the agent saw.
    assert!(
        (0..=2).contains(&(generated - row.completion_tokens)),
        "settled {} of {generated}",
        row.completion_tokens
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_crash_mid_stream_gives_an_error_event_and_a_partial_settle() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    fleet.nodes[0].sim.set_faults(&FaultSpec {
        crash_after_tokens: Some(3),
        ..FaultSpec::default()
    });
    let resp = post_chat(&fleet, &long_chat(50)).await;
    assert_eq!(resp.status(), 200);
    let (events, done) = tokio::time::timeout(Duration::from_secs(10), read_events(resp))
        .await
        .expect("no hang");
    let request_id = events[0]["id"].as_str().unwrap().to_owned();
    assert!(!done, "no [DONE] after a failure");
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "model_backend_error");
    let deltas = events
        .iter()
        .filter(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
        })
        .count();
    assert!(deltas <= 3);
    let row = settled_row(&fleet.store, &request_id).await;
    assert_eq!(
        row.completion_tokens, 3,
        "the 3 tokens the engine produced before crashing"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_reconnects_after_a_server_restart_and_resends_its_unacked_done() {
    let mut fleet = fleet(&[("small", 1)], 2.0, |_| {}).await;
    let resp = post_chat(&fleet, &long_chat(1000)).await;
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    let request_id = crate::common::completion_id(&String::from_utf8_lossy(&first));
    body.next().await.unwrap().unwrap();
    let stats = fleet.nodes[0].agent_stats.clone();
    assert_eq!(stats.registrations(), 1);

    // The server goes away under the running request; the agent keeps the done it could not
    // deliver (the engine request is cancelled with the connection).
    let addr = fleet.server.addr();
    let config = fleet.server.state().config.clone();
    let store = fleet.store.clone();
    let old = std::mem::replace(
        &mut fleet.server,
        switchyard::server::Server::start(
            config.clone(),
            store.clone(),
            std::sync::Arc::new(switchyard::coord::MemoryCoordinator::new()),
            tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        )
        .await
        .unwrap(),
    );
    old.shutdown(Duration::from_millis(100)).await;
    drop(body);
    wait_for(
        Duration::from_secs(5),
        "an unacked done at the agent",
        || async { stats.unacked_dones() == 1 },
    )
    .await;
    assert_eq!(
        store.ledger_row(&request_id).await.unwrap().unwrap().status,
        LedgerStatus::Reserved
    );

    // A new server on the same address: the agent reconnects with backoff and resends.
    let placeholder = std::mem::replace(
        &mut fleet.server,
        switchyard::server::Server::start(
            config,
            store.clone(),
            std::sync::Arc::new(switchyard::coord::MemoryCoordinator::new()),
            tokio::net::TcpListener::bind(addr).await.unwrap(),
        )
        .await
        .unwrap(),
    );
    placeholder.shutdown(Duration::from_millis(10)).await;
    wait_for(Duration::from_secs(15), "re-registration", || async {
        stats.registrations() >= 2
    })
    .await;
    wait_for(
        Duration::from_secs(5),
        "the resent done to be acked",
        || async { stats.unacked_dones() == 0 },
    )
    .await;
    let row = store.ledger_row(&request_id).await.unwrap().unwrap();
    assert_eq!(row.status, LedgerStatus::Settled);
    let generated = fleet.nodes[0].sim.stats().generation_tokens as i64;
    assert!(
        row.completion_tokens > 0,
        "the resent done carried the usage"
    );
    assert!(
        (0..=2).contains(&(generated - row.completion_tokens)),
        "settled {} of {generated}",
        row.completion_tokens
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_shutting_down_lets_running_streams_finish() {
    let fleet = fleet(&[("small", 1)], 10.0, |_| {}).await;
    let resp = post_chat(&fleet, &long_chat(60)).await;
    assert_eq!(resp.status(), 200);
    let reading = tokio::spawn(read_events(resp));
    tokio::time::sleep(Duration::from_millis(100)).await;
    fleet.shutdown(Duration::from_secs(10)).await;
    let (events, done) = reading.await.unwrap();
    assert!(done, "the stream completed during the drain");
    assert!(events.iter().all(|e| e.get("error").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_cancels_reservations_that_outlived_every_deadline_and_nothing_else() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let reservation = |id: &str| switchyard::store::Reservation {
        request_id: id.into(),
        team_id: fleet.team_id,
        key_id: None,
        model: "llama-3.1-8b-instruct".into(),
        estimated_prompt_tokens: 10,
        max_tokens: 10,
        estimated_cost: 3,
        price_input_per_mtok: 100_000,
        price_output_per_mtok: 200_000,
        bounds: switchyard::store::UsageBounds::UNBOUNDED,
    };
    // A replica died under this one: nobody will ever settle it.
    fleet.store.reserve(&reservation("orphaned")).await.unwrap();
    fleet.store.reserve(&reservation("finished")).await.unwrap();
    let done = switchyard::store::Settlement {
        request_id: "finished".into(),
        prompt_tokens: 10,
        completion_tokens: 10,
        review: None,
        node_id: None,
    };
    fleet.store.settle(&done).await.unwrap();
    let before_cutoff = chrono::Utc::now() - chrono::Duration::seconds(60);
    assert_eq!(
        switchyard::sweeper::sweep(fleet.store.as_ref(), before_cutoff)
            .await
            .unwrap(),
        0,
        "too young"
    );
    let after = chrono::Utc::now() + chrono::Duration::seconds(1);
    assert_eq!(
        switchyard::sweeper::sweep(fleet.store.as_ref(), after)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        fleet
            .store
            .ledger_row("orphaned")
            .await
            .unwrap()
            .unwrap()
            .status,
        LedgerStatus::Cancelled
    );
    assert_eq!(
        fleet
            .store
            .ledger_row("finished")
            .await
            .unwrap()
            .unwrap()
            .status,
        LedgerStatus::Settled
    );
    assert_eq!(fleet.store.open_reservations().await.unwrap(), 0);
    fleet.shutdown(Duration::from_secs(1)).await;
}
