//! Trust no node and no client, through the embedded fleet: a retry goes away from a dead
//! engine, a prompt that fills the context is refused before any GPU work, output ceilings
//! beyond the context and repeated Idempotency-Key headers are refused with the envelope.
//! (Scripted lying nodes are in tests/generations/trust.rs, on PostgreSQL and Redis.)

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::sim::FaultSpec;

use crate::common::{fleet, http, post_chat};

fn chat(max_tokens: Value) -> Value {
    json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": max_tokens})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_of_two_engines_dead_every_request_succeeds_on_the_other() {
    let fleet = fleet(&[("small", 2)], 20.0, |_| {}).await;
    // small-1's engine dies; its agent stays connected (no heartbeats from now on, so the
    // server would only drop it after 15 s).
    fleet.nodes[0].sim.set_faults(&FaultSpec {
        exit_after_ms: Some(0),
        ..Default::default()
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..12 {
        let resp = post_chat(&fleet, &chat(json!(3))).await;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(status, 200, "request {i}: {body}");
    }
    let queue = fleet.server.state().queues["llama-3.1-8b-instruct"].clone();
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        stats.suspended,
        ["small-1"],
        "two refusals in a row took it out of routing"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_fills_the_context_is_refused_before_any_gpu_work() {
    let fleet = fleet(&[("small", 1)], 20.0, |c| {
        for m in &mut c.server.models {
            m.max_context_tokens = 256;
        }
    })
    .await;
    let rows_before = fleet.store.ledger_rows(None).await.unwrap().len();
    let long = "word ".repeat(400);
    let resp = post_chat(
        &fleet,
        &json!({"model": "small", "messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    assert_eq!(body["error"]["param"], "messages");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(
        fleet.store.ledger_rows(None).await.unwrap().len(),
        rows_before,
        "nothing reserved"
    );
    assert_eq!(
        fleet.nodes[0].sim.stats().prompt_tokens,
        0,
        "no engine saw it"
    );
    // Just under the context it runs.
    let resp = post_chat(&fleet, &chat(json!(3))).await;
    assert_eq!(resp.status(), 200);
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_ceilings_beyond_the_context_and_repeated_keys_are_refused_cleanly() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let rows_before = fleet.store.ledger_rows(None).await.unwrap().len();
    for (field, value) in [
        ("max_tokens", json!(1u64 << 58)),
        ("max_tokens", json!(8193)),
        ("max_tokens", json!(0)),
        ("max_tokens", json!(-1)),
        ("max_tokens", json!("5")),
        ("max_completion_tokens", json!(u64::MAX)),
    ] {
        let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                          field: value});
        let resp = post_chat(&fleet, &body).await;
        assert_eq!(resp.status(), 400, "{field}={value}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["code"], "invalid_request", "{err}");
        assert_eq!(err["error"]["param"], field);
    }
    let generation = |key_headers: &[&str], max: Value| {
        let mut req = http()
            .post(format!("{}/v1/generations", fleet.server.base_url()))
            .bearer_auth(&fleet.api_key);
        for k in key_headers {
            req = req.header("idempotency-key", *k);
        }
        req.json(
            &json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                         "max_output_tokens": max}),
        )
        .send()
    };
    let resp = generation(&["k1"], json!(1u64 << 58)).await.unwrap();
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["param"], "max_output_tokens", "{err}");
    let resp = generation(&["k2", "k3"], json!(5)).await.unwrap();
    assert_eq!(resp.status(), 400, "two Idempotency-Key headers");
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_request");
    assert_eq!(err["error"]["param"], "Idempotency-Key");
    let resp = http()
        .post(format!("{}/chat/completions", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .header("idempotency-key", "a")
        .header("idempotency-key", "a")
        .json(&chat(json!(3)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(
        fleet.store.ledger_rows(None).await.unwrap().len(),
        rows_before,
        "no refusal reserved anything"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}
