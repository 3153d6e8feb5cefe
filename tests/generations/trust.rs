//! Trust no node (SPEC section 7), on PostgreSQL and Redis with scripted nodes: a registered
//! node's frames for another node's request change nothing the client sees or the ledger
//! holds, on both dialects; a node that keeps doing it is disconnected; a report beyond the
//! request's bounds is billed at the bounds and marked for review, and the client sees what
//! was billed; counts no ledger can hold end the generation with a typed error and a final
//! row within seconds; a NUL in a node's output is kept as streamed.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard::store::{LedgerStatus, ReviewReason, hash_secret};

use crate::common::{http, read_events};
use crate::harness::{
    Events, PgFleet, Ws, body, fake_node, fake_node_serving, metric, pg_fleet, recv, recv_within,
    send, send_raw, until,
};

const LARGE: &str = "llama-3.3-70b-instruct";

/// A registered node the server may route nothing to (it serves only the large model, which
/// no request in these tests asks for) but which can write frames.
async fn rogue(f: &PgFleet) -> Ws {
    f.store
        .create_node("rogue-1", "onprem", &hash_secret("nt-rogue"))
        .await
        .unwrap();
    fake_node_serving(f, "rogue-1", "nt-rogue", LARGE).await
}

/// Forged frames for attempt 1 of `id`: acceptance, text, and a done claiming a fortune.
async fn forge(ws: &mut Ws, id: &str) {
    send(
        ws,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    send(
        ws,
        json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": 0, "delta": "FORGED"}),
    )
    .await;
    send(
        ws,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 1,
               "completion_tokens": 100000, "finish_reason": "stop"}),
    )
    .await;
}

fn chat(max_tokens: u64, stream: bool) -> Value {
    json!({"model": "small", "messages": [{"role": "user", "content": "hello there"}],
           "max_tokens": max_tokens, "stream": stream, "stream_options": {"include_usage": true}})
}

/// The scripted node accepts attempt 1 of `id` and streams `text` as its first chunk.
async fn accept_and_say(ws: &mut Ws, id: &str, text: &str) {
    send(
        ws,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    send(
        ws,
        json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": 0, "delta": text}),
    )
    .await;
}

/// A non-streaming `max_tokens: 5` chat request, sent in the background; its id is read from
/// the `assign` the scripted node receives.
async fn chat_on(
    f: &PgFleet,
    node: &mut Ws,
) -> (tokio::task::JoinHandle<reqwest::Response>, String) {
    let request = tokio::spawn({
        let (url, key) = (f.url("/v1/chat/completions"), f.api_key.clone());
        async move {
            http()
                .post(url)
                .bearer_auth(key)
                .json(&chat(5, false))
                .send()
                .await
                .unwrap()
        }
    });
    let assign = recv(node).await;
    let id = assign["request_id"].as_str().unwrap().to_owned();
    (request, id)
}

/// The completion id in a chat stream's first event (the rest of the stream is left unread).
async fn first_completion_id(resp: &mut reqwest::Response) -> String {
    let mut text = String::new();
    while !(text.contains("chatcmpl-") && text.ends_with("\n\n")) {
        text.push_str(&String::from_utf8_lossy(
            &resp.chunk().await.unwrap().unwrap(),
        ));
    }
    crate::common::completion_id(&text)
}

async fn post_chat(f: &PgFleet, body: &Value) -> reqwest::Response {
    http()
        .post(f.url("/v1/chat/completions"))
        .bearer_auth(&f.api_key)
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_nodes_frames_are_refused_on_both_dialects_and_change_nothing() {
    let f = pg_fleet(&[("small", 1)], 1.0, |_| {}).await;
    let mut rogue = rogue(&f).await;

    // Chat completions: the rogue writes into the request while the real node streams it.
    let mut resp = post_chat(&f, &chat(60, true)).await;
    assert_eq!(resp.status(), 200);
    let id = first_completion_id(&mut resp).await;
    forge(&mut rogue, &id).await;
    let (events, done) = read_events(resp).await;
    assert!(done, "the real node's stream ended normally");
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.contains("FORGED"), "{text}");
    let usage = &events.last().unwrap()["usage"];
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.review
        ),
        (
            LedgerStatus::Settled,
            usage["prompt_tokens"].as_i64().unwrap(),
            usage["completion_tokens"].as_i64().unwrap(),
            None
        ),
        "billed as the real node reported"
    );
    assert_eq!(usage["completion_tokens"], 60);

    // The Generations API, the same way.
    let mut events = Events::new(f.submit("trust-1", &body("hello there", 60, true)).await);
    let (name, created) = events.next().await.unwrap();
    assert_eq!(name, "generation.created");
    let gid = created["generation_id"].as_str().unwrap().to_owned();
    forge(&mut rogue, &gid).await;
    let rest = events.rest().await;
    let text: String = rest
        .iter()
        .filter(|(n, _)| n == "generation.text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect();
    assert!(!text.contains("FORGED"));
    let (name, completed) = rest.last().unwrap();
    assert_eq!(name, "generation.completed");
    assert_eq!(completed["usage"]["output_tokens"], 60);
    let row = f.store.ledger_row(&gid).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.completion_tokens),
        (LedgerStatus::Settled, 60)
    );

    assert_eq!(
        recv_within(&mut rogue, Duration::from_millis(500)).await,
        None,
        "nothing the rogue sent was acked"
    );
    let violations = metric(
        &f,
        "switchyard_node_protocol_violations_total",
        "node=\"rogue-1\"",
    )
    .await;
    assert!(violations >= 6.0, "{violations}");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_keeps_violating_is_disconnected() {
    let f = pg_fleet(&[("small", 1)], 1.0, |c| {
        c.server.trust.max_violations = 3;
    })
    .await;
    let mut rogue = rogue(&f).await;
    let mut resp = post_chat(&f, &chat(60, true)).await;
    let id = first_completion_id(&mut resp).await;
    for seq in 0..4 {
        send(
            &mut rogue,
            json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": seq, "delta": "x"}),
        )
        .await;
    }
    // The server closes the socket: the stream ends (a close frame, then nothing).
    let closed_at = Instant::now();
    while recv_within(&mut rogue, Duration::from_secs(5))
        .await
        .is_some()
    {}
    assert!(closed_at.elapsed() < Duration::from_secs(5), "disconnected");
    let (_, done) = read_events(resp).await;
    assert!(done, "the real stream was not disturbed");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_beyond_the_requests_bounds_is_billed_at_the_bounds_and_marked() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    f.store
        .create_node("liar", "onprem", &hash_secret("nt-liar"))
        .await
        .unwrap();
    let mut liar = fake_node(&f, "liar", "nt-liar").await;
    let balance = |f: &PgFleet| {
        let (store, team) = (f.store.clone(), f.team_id);
        async move {
            store
                .team(team)
                .await
                .unwrap()
                .unwrap()
                .balance_microcredits
        }
    };

    // max_tokens 5, and the node claims 100,000 completion tokens.
    let before = balance(&f).await;
    let (request, id) = chat_on(&f, &mut liar).await;
    accept_and_say(&mut liar, &id, "hi").await;
    send(
        &mut liar,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
               "completion_tokens": 100000, "finish_reason": "length"}),
    )
    .await;
    assert_eq!(recv(&mut liar).await["type"], "ack", "settled, so acked");
    let resp = request.await.unwrap();
    assert_eq!(resp.status(), 200);
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(
        (
            doc["usage"]["prompt_tokens"].as_u64(),
            doc["usage"]["completion_tokens"].as_u64()
        ),
        (Some(3), Some(5)),
        "the client sees what the ledger bills"
    );
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.completion_tokens,
            row.review,
            row.claimed_completion_tokens
        ),
        (
            LedgerStatus::Settled,
            3,
            5,
            Some(ReviewReason::UsageOverBound),
            Some(100_000)
        )
    );
    assert_eq!(balance(&f).await, before - row.cost_microcredits);

    // A prompt claim of 2^62 is billed at the gateway's count plus its margin.
    let (request, id) = chat_on(&f, &mut liar).await;
    send(
        &mut liar,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 1u64 << 62,
               "completion_tokens": 2, "finish_reason": "stop"}),
    )
    .await;
    assert_eq!(recv(&mut liar).await["type"], "ack");
    let doc: Value = request.await.unwrap().json().await.unwrap();
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    let bound = row.prompt_token_bound.unwrap();
    assert!(
        (64..200).contains(&bound),
        "a short prompt's bound is its count plus the 64-token margin: {bound}"
    );
    assert_eq!(
        (row.prompt_tokens, row.completion_tokens, row.review),
        (bound, 2, Some(ReviewReason::UsageOverBound))
    );
    assert_eq!(doc["usage"]["prompt_tokens"].as_i64(), Some(bound));
    let team = f.store.team(f.team_id).await.unwrap().unwrap();
    assert!(
        team.balance_microcredits > 0,
        "no balance driven to -3.69e18"
    );
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_no_ledger_can_hold_end_the_generation_with_an_error_and_a_final_row() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    f.store
        .create_node("liar", "onprem", &hash_secret("nt-liar"))
        .await
        .unwrap();
    let mut liar = fake_node(&f, "liar", "nt-liar").await;
    // 2^64-1 fits the frame's u64 but no ledger; 2^64 does not even fit the frame.
    for (key, count) in [
        ("huge-1", "18446744073709551615"),
        ("huge-2", "18446744073709551616"),
    ] {
        let started = Instant::now();
        let mut events = Events::new(f.submit(key, &body("hello", 50, true)).await);
        let assign = recv(&mut liar).await;
        let id = assign["request_id"].as_str().unwrap().to_owned();
        accept_and_say(&mut liar, &id, "hi").await;
        send_raw(
            &mut liar,
            &format!(
                r#"{{"type":"done","request_id":"{id}","attempt":1,"prompt_tokens":3,"completion_tokens":{count},"finish_reason":"stop"}}"#
            ),
        )
        .await;
        assert_eq!(recv(&mut liar).await["type"], "ack");
        let all = events.rest().await;
        let (name, error) = all.last().unwrap();
        assert_eq!(name, "generation.error", "{all:?}");
        assert_eq!(error["code"], "model_backend_error");
        assert!(
            all.iter().all(|(n, _)| n != "generation.completed"),
            "never success with usage the ledger did not record"
        );
        let row = f.store.ledger_row(&id).await.unwrap().unwrap();
        assert_eq!(
            (
                row.status,
                row.prompt_tokens,
                row.completion_tokens,
                row.review
            ),
            (
                LedgerStatus::Settled,
                3,
                50,
                Some(ReviewReason::UsageUnrepresentable)
            ),
            "settled at the bound"
        );
        let (_, doc) = f.get(&id).await;
        assert_eq!(doc["status"], "failed", "{doc}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "final within seconds"
        );
    }
    // Both slots were released: the key may run another generation at once.
    let w = f.window().await;
    assert_eq!(w.reserved, 0);
    let out = metric(
        &f,
        "switchyard_node_protocol_violations_total",
        "kind=\"usage_out_of_range\"",
    )
    .await;
    assert!(out >= 2.0);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_nodes_output_is_kept_as_streamed() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    f.store
        .create_node("n", "onprem", &hash_secret("nt-n"))
        .await
        .unwrap();
    let mut node = fake_node(&f, "n", "nt-n").await;
    let mut events = Events::new(f.submit("nul-1", &body("hello", 50, true)).await);
    let assign = recv(&mut node).await;
    let id = assign["request_id"].as_str().unwrap().to_owned();
    accept_and_say(&mut node, &id, "a\u{0}b").await;
    send(
        &mut node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
               "completion_tokens": 2, "finish_reason": "stop"}),
    )
    .await;
    let all = events.rest().await;
    let live: String = all
        .iter()
        .filter(|(n, _)| n == "generation.text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect();
    assert_eq!(live, "a\u{0}b");
    until(Duration::from_secs(5), "the record to complete", || async {
        f.get(&id).await.1["status"] == "completed"
    })
    .await;
    let (_, doc) = f.get(&id).await;
    assert_eq!(doc["output"][0]["text"], "a\u{0}b", "stored as streamed");
    let replay: Value = f
        .submit("nul-1", &body("hello", 50, false))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        replay["output"][0]["text"], "a\u{0}b",
        "replayed as streamed"
    );
    f.stop().await;
}
