//! The happy path and admission answers: OpenAI shapes, exact usage, one settle per row.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::store::LedgerStatus;

use crate::common::{fixture, fleet, http, post_chat, read_events, shape};

fn openai_fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/openai")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn chat(model: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_has_openai_shapes_exact_usage_and_one_settled_row() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let resp = post_chat(&fleet, &chat("small", 12, true)).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let (events, done) = read_events(resp).await;
    let request_id = events[0]["id"].as_str().unwrap().to_owned();
    assert!(done, "ends with [DONE]");
    assert_eq!(shape(&events[0]), shape(&openai_fixture("chunk_role.json")));
    for e in &events[1..events.len() - 2] {
        assert_eq!(shape(e), shape(&openai_fixture("chunk_content.json")));
    }
    assert_eq!(
        shape(&events[events.len() - 2]),
        shape(&openai_fixture("chunk_finish.json"))
    );
    assert_eq!(
        shape(&events[events.len() - 1]),
        shape(&openai_fixture("chunk_usage.json"))
    );
    assert!(events.iter().all(|e| e["id"] == request_id.as_str()));
    assert_eq!(
        events[0]["model"], "llama-3.1-8b-instruct",
        "the alias resolved to one version"
    );

    // Usage is the engine's own: prompt tokens as its tokenizer counts them, completion
    // tokens as its generation counter moved.
    let usage = &events[events.len() - 1]["usage"];
    let sim = &fleet.nodes[0].sim;
    let tokenized: Value = http()
        .post(format!("{}/tokenize", sim.base_url()))
        .json(&json!({"messages": [{"role": "user", "content": "Say hello in five words."}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(usage["prompt_tokens"], tokenized["count"]);
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(sim.stats().generation_tokens, 12);

    // One ledger row, settled with those counts; settling again changes nothing.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let row = fleet.store.ledger_row(&request_id).await.unwrap().unwrap();
    assert_eq!(row.status, LedgerStatus::Settled);
    assert_eq!(
        (row.prompt_tokens, row.completion_tokens),
        (usage["prompt_tokens"].as_i64().unwrap(), 12)
    );
    let before = fleet
        .store
        .team(fleet.team_id)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    let again = switchyard::store::Settlement {
        request_id: request_id.clone(),
        prompt_tokens: 1,
        completion_tokens: 1,
        review: None,
        node_id: None,
    };
    let outcome = fleet.store.settle(&again).await.unwrap();
    assert_eq!(outcome, switchyard::store::SettleOutcome::AlreadyFinal);
    let after = fleet
        .store
        .team(fleet.team_id)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    assert_eq!(before, after, "a retried settle is a no-op");
    assert_eq!(fleet.store.open_reservations().await.unwrap(), 0);
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_has_the_completion_shape() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let resp = post_chat(&fleet, &chat("small", 7, false)).await;
    assert_eq!(resp.status(), 200);
    // A key without limits of its own gets the configured defaults, and their headers.
    for h in [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
    ] {
        assert!(resp.headers().contains_key(h), "{h} missing");
    }
    assert_eq!(resp.headers()["x-ratelimit-limit-requests"], "10000");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(shape(&body), shape(&openai_fixture("completion.json")));
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_for_a_model_is_503_no_healthy_node() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let resp = post_chat(&fleet, &chat("large", 5, true)).await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let body: Value = resp.json().await.unwrap();
    assert_eq!(shape(&body), shape(&openai_fixture("error.json")));
    assert_eq!(body["error"]["code"], "no_healthy_node");
    assert_eq!(
        fleet.store.open_reservations().await.unwrap(),
        0,
        "nothing stays reserved"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429_queue_full_with_retry_after() {
    let fleet = fleet(&[("small", 1)], 2.0, |c| {
        c.server.queue.max_waiting = 1;
        c.server.models[0].node_concurrency = 1;
    })
    .await;
    let long = chat("small", 200, true);
    let first = post_chat(&fleet, &long).await; // runs
    let second = post_chat(&fleet, &long).await; // waits
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let third = post_chat(&fleet, &long).await;
    assert_eq!(third.status(), 429);
    let retry_after: u64 = third.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after));
    let body: Value = third.json().await.unwrap();
    assert_eq!(body["error"]["code"], "queue_full");
    drop((first, second));
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_unknown_models_and_bad_bodies_are_refused_before_any_work() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let no_key = http()
        .post(&url)
        .json(&chat("small", 5, false))
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 401);
    let bad_key = http()
        .post(&url)
        .bearer_auth("sk-sy-nope")
        .json(&chat("small", 5, false))
        .send()
        .await
        .unwrap();
    assert_eq!(bad_key.status(), 401);
    assert_eq!(bad_key.headers()["x-should-retry"], "false");
    let unknown = post_chat(&fleet, &chat("gpt-9", 5, false)).await;
    assert_eq!(unknown.status(), 404);
    let body: Value = unknown.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_not_found");
    let n2 = post_chat(
        &fleet,
        &json!({"model": "small", "messages": [{"role": "user", "content": "x"}], "n": 2}),
    )
    .await;
    assert_eq!(n2.status(), 400);
    let garbage = http()
        .post(&url)
        .bearer_auth(&fleet.api_key)
        .header("content-type", "application/json")
        .body("\u{0}{{{")
        .send()
        .await
        .unwrap();
    assert_eq!(garbage.status(), 400);
    let body: Value = garbage.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_request");
    assert!(
        fleet.store.ledger_rows(None).await.unwrap().is_empty(),
        "nothing reached the ledger"
    );
    assert_eq!(
        fleet.nodes[0].sim.stats().generation_tokens,
        0,
        "nor an engine"
    );
    let models: Value = http()
        .get(format!("{}/models", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(ids.contains(&"small") && ids.contains(&"llama-3.1-8b-instruct"));
    let _ = fixture("README.md");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.server.base_url();
    assert_eq!(
        http()
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http()
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    post_chat(&fleet, &chat("small", 3, false))
        .await
        .text()
        .await
        .unwrap();
    let page = http()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "switchyard_ttft_seconds",
        "switchyard_queue_wait_seconds",
        "switchyard_queue_depth",
        "switchyard_requests_total",
        "switchyard_active_streams",
        "switchyard_ledger_open_reservations",
        "switchyard_nodes",
        "switchyard_tasks_alive",
    ] {
        assert!(page.contains(name), "{name} missing from /metrics");
    }
    // Counters whose first event an alert must see exist before it (at 0, unless another test
    // in this process already moved them).
    for series in [
        "switchyard_actor_restarts_total{kind=\"model_queue\"}",
        "switchyard_actor_restarts_total{kind=\"supervisor\"}",
        "switchyard_queue_fenced_total{model=\"llama-3.1-8b-instruct\"}",
        "switchyard_requests_total{model=\"\",code=\"quota_service_unavailable\"}",
        "switchyard_nodes_lost_total{node=\"small-1\"}",
    ] {
        assert!(page.contains(series), "{series} missing from /metrics");
    }
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_stream_receives_keep_alive_comments_until_a_node_frees_up() {
    let fleet = fleet(&[("small", 1)], 1.0, |c| {
        c.server.models[0].node_concurrency = 1
    })
    .await;
    let _running = post_chat(&fleet, &chat("small", 400, true)).await;
    let queued = post_chat(&fleet, &chat("small", 4, true)).await;
    assert_eq!(
        queued.status(),
        200,
        "admitted to the queue: headers go out at once"
    );
    let mut body = futures::StreamExt::boxed(queued.bytes_stream());
    let first = tokio::time::timeout(Duration::from_secs(8), futures::StreamExt::next(&mut body))
        .await
        .expect("something within the keep-alive interval")
        .unwrap()
        .unwrap();
    assert_eq!(
        &first[..],
        b": keep-alive\n\n",
        "a comment, not data, while queued"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_routing_can_be_chosen_in_configuration() {
    let fleet = fleet(&[("small", 2)], 20.0, |c| {
        c.server.routing = switchyard_actors::model_queue::RoutingStrategy::RoundRobin;
    })
    .await;
    for _ in 0..4 {
        let r = post_chat(&fleet, &chat("small", 2, false)).await;
        assert_eq!(r.status(), 200);
    }
    let per_node: Vec<u64> = fleet
        .nodes
        .iter()
        .map(|n| n.sim.stats().generation_tokens)
        .collect();
    assert_eq!(
        per_node,
        [4, 4],
        "sequential requests alternate between the two nodes"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}
