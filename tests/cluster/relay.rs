//! Requests entering through every replica run on nodes held by any replica.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard::store::LedgerStatus;

use super::{Cluster, chat, cluster};
use crate::common::http;

/// What one streamed request got.
#[derive(Debug, Default)]
struct Got {
    status: u16,
    done: bool,
    text: String,
    completion_tokens: Option<u64>,
    error: Option<Value>,
}

async fn stream_through(c: &Cluster, replica: usize, key: &str, body: &Value) -> Got {
    let resp = http()
        .post(c.url(replica, "/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let mut got = Got {
        status: resp.status().as_u16(),
        ..Default::default()
    };
    let mut bytes = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(Ok(chunk)) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                got.done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if let Some(e) = v.get("error") {
                got.error = Some(e.clone());
            }
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                got.text.push_str(t);
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                got.completion_tokens = u["completion_tokens"].as_u64();
            }
        }
    }
    got
}

/// A key of the demo team with `limits`.
async fn key_with(c: &Cluster, limits: Value) -> String {
    let mut body = json!({"team": "demo"});
    body.as_object_mut()
        .unwrap()
        .extend(limits.as_object().unwrap().clone());
    let key: Value = http()
        .post(c.url(0, "/admin/keys"))
        .bearer_auth(&c.fleet.admin_token)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    key["key"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_through_three_replicas_run_on_six_nodes_and_settle_once() {
    let c = cluster(3, 6, 10.0, |_| {}).await;
    // Each replica holds two sockets and proxies the other four nodes.
    for i in 0..3 {
        let state = c.fleet.replicas()[i].state().clone();
        assert_eq!(state.view.local_count(), 2, "replica {i} sockets");
        assert_eq!(
            state.view.proxies().fences().len(),
            4,
            "replica {i} proxies"
        );
    }
    let key = c.fleet.api_key.clone();
    let got: Vec<Got> = futures::stream::iter(0..300usize)
        .map(|i| {
            let (c, key) = (&c, key.clone());
            async move { stream_through(c, i % 3, &key, &chat(24)).await }
        })
        .buffer_unordered(300)
        .collect()
        .await;
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.status, 200, "stream {i}: {g:?}");
        assert!(g.done && g.error.is_none(), "stream {i} ended: {g:?}");
        assert!(!g.text.is_empty(), "stream {i} carried text");
    }
    let streamed: u64 = got.iter().map(|g| g.completion_tokens.unwrap()).sum();

    // Every node took work: each replica's queue spread its streams over the cluster.
    for node in &c.fleet.nodes {
        let finished: u64 = node.sim.stats().success.iter().sum();
        assert!(finished > 0, "node {} took no work", node.node_id);
    }
    c.wait_reservations_closed().await;
    let rows = c.fleet.store.ledger_rows(None).await.unwrap();
    assert_eq!(rows.len(), 300, "one row per request");
    assert!(rows.iter().all(|r| r.status == LedgerStatus::Settled));
    let settled: i64 = rows.iter().map(|r| r.completion_tokens).sum();
    let engines: u64 = c
        .fleet
        .nodes
        .iter()
        .map(|n| n.sim.stats().generation_tokens)
        .sum();
    assert_eq!(
        settled as u64, streamed,
        "billed what the clients were told"
    );
    assert_eq!(engines, streamed, "billed what the engines produced");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_streams_holds_for_one_key_entering_every_replica() {
    let c = cluster(3, 3, 1.0, |_| {}).await;
    let key = key_with(&c, json!({"max_streams": 4})).await;
    // Long streams, all sent at once through the three replicas: four run, the rest wait
    // for nothing — they are refused at once.
    let got: Vec<Got> = futures::stream::iter(0..24usize)
        .map(|i| {
            let (c, key) = (&c, key.clone());
            async move { stream_through(c, i % 3, &key, &chat(200)).await }
        })
        .buffer_unordered(24)
        .collect()
        .await;
    let admitted = got.iter().filter(|g| g.status == 200).count();
    let refused = got.iter().filter(|g| g.status == 429).count();
    assert_eq!(admitted, 4, "{got:?}");
    assert_eq!(refused, 20);
    assert!(got.iter().filter(|g| g.status == 200).all(|g| g.done));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_per_minute_hold_for_one_key_entering_every_replica() {
    let c = cluster(3, 3, 10.0, |_| {}).await;
    let key = key_with(&c, json!({"rpm": 10})).await;
    assert_eq!(thirty_at_once(&c, &key).await, (10, 20));
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_per_day_hold_for_one_key_entering_every_replica() {
    // Counted at settle (prompt and completion) into one Redis counter, read at admission
    // by every replica: requests through the three in turn are admitted while the day's
    // count is under the limit, and refused by every replica once it is not.
    const LIMIT: i64 = 100;
    let c = cluster(3, 3, 10.0, |_| {}).await;
    let key = key_with(&c, json!({"tokens_per_day": LIMIT})).await;
    let mut admitted = 0;
    for i in 0..40 {
        let got = stream_through(&c, i % 3, &key, &chat(10)).await;
        match got.status {
            200 => {
                assert!(got.done, "{got:?}");
                admitted += 1;
            }
            429 => break,
            other => panic!("{other}: {got:?}"),
        }
        // The stream's settle counts its tokens just after its end.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for replica in 0..3 {
        let got = stream_through(&c, replica, &key, &chat(10)).await;
        assert_eq!(got.status, 429, "replica {replica}: {got:?}");
    }
    let mut rows = c.fleet.store.ledger_rows(None).await.unwrap();
    rows.sort_by_key(|r| r.id);
    assert_eq!(rows.len(), admitted);
    let used: Vec<i64> = rows
        .iter()
        .map(|r| r.prompt_tokens + r.completion_tokens)
        .collect();
    let before_last: i64 = used[..used.len() - 1].iter().sum();
    assert!(before_last < LIMIT, "admitted after the limit: {used:?}");
    assert!(before_last + used[used.len() - 1] >= LIMIT, "{used:?}");
    c.stop().await;
}

/// Thirty requests of one key at once, ten through each replica: what each got.
async fn thirty_at_once(c: &Cluster, key: &str) -> (usize, usize) {
    let got: Vec<Got> = futures::stream::iter(0..30usize)
        .map(|i| async move { stream_through(c, i % 3, key, &chat(4)).await })
        .buffer_unordered(30)
        .collect()
        .await;
    let admitted = got.iter().filter(|g| g.status == 200).count();
    let refused = got.iter().filter(|g| g.status == 429).count();
    assert_eq!(admitted + refused, 30, "{got:?}");
    (admitted, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn message_windows_and_bursts_hold_for_one_key_entering_every_replica() {
    // Both are decided in PostgreSQL with the request's record, whichever replica it
    // entered.
    let c = cluster(3, 3, 10.0, |_| {}).await;
    let windowed = key_with(&c, json!({"message_quota": 12, "burst_capacity": 100})).await;
    assert_eq!(thirty_at_once(&c, &windowed).await, (12, 18));
    let bursty = key_with(
        &c,
        json!({"message_quota": 1000, "burst_capacity": 7, "burst_refill_seconds": 3600}),
    )
    .await;
    assert_eq!(thirty_at_once(&c, &bursty).await, (7, 23));
    c.stop().await;
}
