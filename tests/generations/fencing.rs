//! Attempt fencing: a node lost before its `accepted` arrived is fenced by its lease before a
//! second attempt runs, and when it comes back its chunks and usage are rejected, counted,
//! and never billed.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::store::{LedgerStatus, hash_secret};

use crate::harness::{body, fake_node, metric, pg_fleet, recv, send, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_attempt_that_comes_back_is_rejected_and_never_billed() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    for (id, token) in [("fake-a", "nt-a"), ("fake-b", "nt-b")] {
        f.store
            .create_node(id, "onprem", &hash_secret(token))
            .await
            .unwrap();
    }
    let mut a = fake_node(&f, "fake-a", "nt-a").await;
    let request = tokio::spawn({
        let (base, key) = (f.server.base_url(), f.api_key.clone());
        async move {
            crate::common::http()
                .post(format!("{base}/v1/generations"))
                .bearer_auth(key)
                .header("idempotency-key", "k1")
                .json(&body("hello", 50, false))
                .send()
                .await
                .unwrap()
        }
    });
    let assign = recv(&mut a).await;
    assert_eq!(
        (assign["type"].as_str(), assign["attempt"].as_u64()),
        (Some("assign"), Some(1))
    );
    assert_eq!(assign["lease_ms"], 500, "the attempt carries its lease");
    let id = assign["request_id"].as_str().unwrap().to_owned();
    // Node A starts but its `accepted` is lost, and then the node is lost.
    let mut b = fake_node(&f, "fake-b", "nt-b").await;
    let lost_at = std::time::Instant::now();
    drop(a);
    let assign = recv(&mut b).await;
    assert_eq!(
        (assign["request_id"].as_str(), assign["attempt"].as_u64()),
        (Some(id.as_str()), Some(2))
    );
    assert!(
        lost_at.elapsed() >= Duration::from_millis(450),
        "attempt 1 was fenced by its lease first"
    );
    send(
        &mut b,
        json!({"type": "accepted", "request_id": id, "attempt": 2}),
    )
    .await;
    send(
        &mut b,
        json!({"type": "chunk", "request_id": id, "attempt": 2, "seq": 0, "delta": "fresh"}),
    )
    .await;

    // Node A comes back while attempt 2 runs and reports its attempt.
    let stale_before = metric(&f, "switchyard_stale_frames_total", "").await;
    let mut a = fake_node(&f, "fake-a", "nt-a").await;
    send(
        &mut a,
        json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": 0, "delta": "stale"}),
    )
    .await;
    send(
        &mut a,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 9,
        "completion_tokens": 999, "finish_reason": "abort"}),
    )
    .await;
    let ack = recv(&mut a).await;
    assert_eq!(
        (ack["type"].as_str(), ack["attempt"].as_u64()),
        (Some("ack"), Some(1)),
        "forgotten, not billed"
    );
    until(
        Duration::from_secs(5),
        "the stale frames to be counted",
        || async { metric(&f, "switchyard_stale_frames_total", "").await >= stale_before + 2.0 },
    )
    .await;

    send(
        &mut b,
        json!({"type": "done", "request_id": id, "attempt": 2, "prompt_tokens": 9,
        "completion_tokens": 1, "finish_reason": "stop"}),
    )
    .await;
    assert_eq!(recv(&mut b).await["type"], "ack");
    let resp = request.await.unwrap();
    assert_eq!(resp.status(), 200);
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(doc["output"][0]["text"], "fresh", "only attempt 2's output");
    assert_eq!(doc["usage"]["output_tokens"], 1);

    // After the generation ended, the old attempt's usage is still refused.
    send(
        &mut a,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 9,
        "completion_tokens": 999, "finish_reason": "abort"}),
    )
    .await;
    assert_eq!(recv(&mut a).await["attempt"], 1);
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.completion_tokens),
        (LedgerStatus::Settled, 1),
        "billed once, for attempt 2"
    );
    let w = f.window().await;
    assert_eq!((w.used, w.reserved), (1, 0));
    let (_, doc) = f.get(&id).await;
    assert_eq!(doc["status"], "completed");
    f.stop().await;
}

/// A generation admitted again after a rejection has a ledger row of its own; when its actor
/// is gone (a replica stopping mid-flight) the node's `done` settles that row, not the first
/// admission's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_done_without_its_actor_settles_the_current_admissions_row() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let first = f.submit("again", &body("hello", 50, false)).await;
    assert_eq!(first.status(), 503, "no node yet: rejected");
    let id = first.json::<Value>().await.unwrap()["error"]["details"]["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();

    f.store
        .create_node("fake-a", "onprem", &hash_secret("nt-a"))
        .await
        .unwrap();
    let mut a = fake_node(&f, "fake-a", "nt-a").await;
    let request = tokio::spawn({
        let (base, key) = (f.server.base_url(), f.api_key.clone());
        async move {
            crate::common::http()
                .post(format!("{base}/v1/generations"))
                .bearer_auth(key)
                .header("idempotency-key", "again")
                .json(&body("hello", 50, false))
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let assign = recv(&mut a).await;
    assert_eq!(
        (assign["request_id"].as_str(), assign["attempt"].as_u64()),
        (Some(id.as_str()), Some(1))
    );
    send(
        &mut a,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    send(
        &mut a,
        json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": 0, "delta": "hi"}),
    )
    .await;
    until(Duration::from_secs(5), "the record to run", || async {
        f.get(&id).await.1["status"] == "running"
    })
    .await;
    // The replica's generations stop mid-flight; the node's done arrives afterwards.
    f.server.state().launcher.generations.stop();
    let _ = request.await;
    send(
        &mut a,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 9,
        "completion_tokens": 7, "finish_reason": "stop"}),
    )
    .await;
    // A chunk that reached the node actor after the generation stopped has already told the
    // node to stop (nobody reads it); the done is then settled and acked.
    let mut next = recv(&mut a).await;
    if next["type"] == "cancel" {
        assert_eq!(next["attempt"], 1);
        next = recv(&mut a).await;
    }
    assert_eq!(next["type"], "ack");

    let rec = f.store.get_generation(&id).await.unwrap().unwrap();
    assert_ne!(rec.ledger_id, id, "the readmission has a row of its own");
    let old = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(old.status, LedgerStatus::Cancelled);
    let row = f.store.ledger_row(&rec.ledger_id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.completion_tokens),
        (LedgerStatus::Settled, 7),
        "billed"
    );
    assert_eq!((rec.status.as_str(), rec.output_tokens), ("completed", 7));
    f.stop().await;
}
