//! What a node can make the gateway hold, on PostgreSQL and Redis with scripted nodes: every
//! answer the gateway assembles in memory (an embeddings list, a non-streamed chat completion,
//! a legacy completion, tool call arguments, a non-streamed generation) is capped by its
//! request; past the cap the client gets `model_backend_error`, the node is told to stop, the
//! violation is counted, and the row settles within the request's bounds. Relayed JSON nested
//! too deep never reaches a client.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::store::{LedgerStatus, hash_secret};

use crate::common::http;
use crate::harness::{
    Events, PgFleet, Ws, body, fake_node_serving, metric, pg_fleet, recv, send, until,
};

const SMALL: &str = "llama-3.1-8b-instruct";

/// A registered scripted node serving `model`.
async fn scripted(f: &PgFleet, node_id: &str, model: &str) -> Ws {
    let token = format!("nt-{node_id}");
    f.store
        .create_node(node_id, "onprem", &hash_secret(&token))
        .await
        .unwrap();
    fake_node_serving(f, node_id, &token, model).await
}

/// Sends `path` with `body` in the background; the request's id is read from the `assign`
/// the scripted node receives.
async fn request_on(
    f: &PgFleet,
    node: &mut Ws,
    path: &str,
    body: Value,
    key: Option<&str>,
) -> (tokio::task::JoinHandle<reqwest::Response>, String) {
    let mut req = http().post(f.url(path)).bearer_auth(&f.api_key).json(&body);
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let request = tokio::spawn(async move { req.send().await.unwrap() });
    let assign = recv(node).await;
    assert_eq!(assign["type"], "assign", "{assign}");
    let id = assign["request_id"].as_str().unwrap().to_owned();
    (request, id)
}

/// The node accepts `id` and sends `slices` chunks, each `delta(seq)`, then waits for the
/// server's `cancel`, answers it with a `done` claiming far more than the request allows, and
/// waits for its `ack`.
async fn flood(node: &mut Ws, id: &str, slices: u64, delta: impl Fn(u64) -> Value) {
    send(
        node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    for seq in 0..slices {
        send(
            node,
            json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": seq,
                   "delta": delta(seq)}),
        )
        .await;
    }
    let cancel = next_of(node, "cancel").await;
    assert_eq!(cancel["request_id"], id);
    send(
        node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
               "completion_tokens": 100000, "finish_reason": "abort"}),
    )
    .await;
    assert_eq!(next_of(node, "ack").await["request_id"], id);
}

/// The next frame of `kind` the server sends the node (others skipped; 10 s at most each).
async fn next_of(node: &mut Ws, kind: &str) -> Value {
    loop {
        let frame = recv(node).await;
        if frame["type"] == kind {
            return frame;
        }
    }
}

/// The client's answer is `model_backend_error`, and the row settled within its bounds.
async fn refused_and_settled(
    f: &PgFleet,
    request: tokio::task::JoinHandle<reqwest::Response>,
    id: &str,
    completion_bound: i64,
) -> Value {
    let resp = request.await.unwrap();
    assert_eq!(resp.status(), 502);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "model_backend_error", "{err}");
    let row = f.store.ledger_row(id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (LedgerStatus::Settled, 3, completion_bound),
        "billed within the request's bounds, never the claim"
    );
    let over = metric(
        f,
        "switchyard_node_protocol_violations_total",
        "kind=\"completion_over_bound\"",
    )
    .await;
    assert!(over >= 1.0, "counted: {over}");
    err
}

/// 16 KiB of text.
fn slice() -> String {
    "x".repeat(16 << 10)
}

/// A bge-m3 node answers one input's embeddings request with `slices` vectors of `values`
/// values each: the gateway refuses it as over its bound and settles the row for nothing.
async fn embeddings_past_the_bound(values: usize, slices: u64) {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "embedder", "bge-m3").await;
    let (request, id) = request_on(
        &f,
        &mut node,
        "/v1/embeddings",
        json!({"model": "embed", "input": "hello"}),
        None,
    )
    .await;
    let item = json!({"object": "embedding", "index": 0, "embedding": vec![0.125; values]});
    flood(&mut node, &id, slices, |_| json!({"data": [item.clone()]})).await;
    refused_and_settled(&f, request, &id, 0).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embeddings_answer_past_its_inputs_bound_is_refused_and_never_held() {
    // One input of bge-m3 (1,024 dimensions) allows about 96 KiB; the node sends about
    // 48 KiB slices, 32 of them (1.5 MiB: the gateway once kept every one and answered 200).
    embeddings_past_the_bound(8000, 32).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_longer_than_the_models_dimensions_is_refused() {
    // One vector of 20,000 values (about 120 KiB): within the bound of a model of unknown
    // length (8,192 dimensions, 320 KiB), past bge-m3's own 1,024.
    embeddings_past_the_bound(20_000, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_chat_answer_past_its_max_tokens_bound_is_refused() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "chatty", SMALL).await;
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5});
    let (request, id) = request_on(&f, &mut node, "/v1/chat/completions", body, None).await;
    // Five tokens allow 5 KiB plus 64 KiB; 16 slices of 16 KiB are 256 KiB.
    flood(&mut node, &id, 16, |_| json!({"content": slice()})).await;
    refused_and_settled(&f, request, &id, 5).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_legacy_completion_past_its_bound_is_refused() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "legacy", SMALL).await;
    let body = json!({"model": "small", "prompt": "hi", "max_tokens": 5});
    let (request, id) = request_on(&f, &mut node, "/v1/completions", body, None).await;
    flood(&mut node, &id, 16, |_| json!({"text": slice()})).await;
    refused_and_settled(&f, request, &id, 5).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_arguments_past_the_bound_are_refused() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "tooly", SMALL).await;
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5});
    let (request, id) = request_on(&f, &mut node, "/v1/chat/completions", body, None).await;
    // Endless argument fragments of one call, as an assembled message would join them.
    flood(&mut node, &id, 16, |seq| {
        let head = (seq == 0).then(|| json!({"id": "call_1", "type": "function", "name": "f"}));
        let mut call = json!({"index": 0, "function": {"arguments": slice()}});
        if let Some(head) = head {
            call["id"] = head["id"].clone();
            call["type"] = head["type"].clone();
            call["function"]["name"] = head["name"].clone();
        }
        json!({"tool_calls": [call]})
    })
    .await;
    refused_and_settled(&f, request, &id, 5).await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_generation_past_its_bound_fails_and_its_record_says_so() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "gen", SMALL).await;
    let (request, id) = request_on(
        &f,
        &mut node,
        "/v1/generations",
        body("hello", 5, false),
        Some("bound-1"),
    )
    .await;
    flood(&mut node, &id, 16, |_| json!({"content": slice()})).await;
    let err = refused_and_settled(&f, request, &id, 5).await;
    assert_eq!(err["error"]["details"]["generation_id"], id);
    until(Duration::from_secs(5), "the record to fail", || async {
        f.get(&id).await.1["status"] == "failed"
    })
    .await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_nested_past_the_depth_limit_never_reaches_a_client() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "deep", SMALL).await;
    let chat = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5, "stream": true});
    let (request, id) = request_on(&f, &mut node, "/v1/chat/completions", chat, None).await;
    send(
        &mut node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    // 10^5 levels, then a lone surrogate: both refused as malformed frames, and the same
    // `seq` then carries real text.
    let deep = format!(
        r#"{{"type":"chunk","request_id":"{id}","attempt":1,"seq":0,"delta":{{"content":"a","x":{}1{}}}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    crate::harness::send_raw(&mut node, &deep).await;
    let lone = format!(
        r#"{{"type":"chunk","request_id":"{id}","attempt":1,"seq":0,"delta":{{"content":"a","x":"\ud800"}}}}"#
    );
    crate::harness::send_raw(&mut node, &lone).await;
    send(
        &mut node,
        json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": 0,
               "delta": {"content": "fine"}}),
    )
    .await;
    send(
        &mut node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
               "completion_tokens": 1, "finish_reason": "stop"}),
    )
    .await;
    let resp = request.await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert!(!text.contains("[[["), "nothing nested reached the client");
    assert!(!text.contains("\\ud800"));
    assert!(text.contains(r#""content":"fine""#), "{text}");
    assert!(text.contains("data: [DONE]"));
    let malformed = metric(
        &f,
        "switchyard_node_protocol_violations_total",
        "kind=\"malformed_frame\"",
    )
    .await;
    assert!(malformed >= 2.0, "{malformed}");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_within_its_bound_is_untouched() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scripted(&f, "honest", SMALL).await;
    let mut events = Events::new(f.submit("fits-1", &body("hello", 5, true)).await);
    let assign = recv(&mut node).await;
    let id = assign["request_id"].as_str().unwrap().to_owned();
    send(
        &mut node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    // 60 KiB in four chunks: under 5 × 1 KiB + 64 KiB.
    for seq in 0..4 {
        send(
            &mut node,
            json!({"type": "chunk", "request_id": id, "attempt": 1, "seq": seq,
                   "delta": {"content": "y".repeat(15 << 10)}}),
        )
        .await;
    }
    send(
        &mut node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
               "completion_tokens": 5, "finish_reason": "length"}),
    )
    .await;
    let all = events.rest().await;
    let text: usize = all
        .iter()
        .filter(|(n, _)| n == "generation.text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .map(str::len)
        .sum();
    assert_eq!(text, 4 * (15 << 10));
    assert_eq!(all.last().unwrap().0, "generation.completed");
    f.stop().await;
}
