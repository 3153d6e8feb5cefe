//! `/v1/usage` is scoped to the caller's team; the SSRF guard refuses internal references
//! before anything is reserved.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{fleet, http};

async fn new_team_key(fleet: &switchyard::demo::Fleet, name: &str) -> String {
    let base = fleet.server.base_url();
    let admin = |path: &str, body: Value| {
        http()
            .post(format!("{base}{path}"))
            .bearer_auth(&fleet.admin_token)
            .json(&body)
            .send()
    };
    admin("/admin/teams", json!({"name": name})).await.unwrap();
    admin(
        "/admin/credits",
        json!({"team": name, "amount": 1_000_000_000}),
    )
    .await
    .unwrap();
    let key: Value = admin("/admin/keys", json!({"team": name}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    key["key"].as_str().unwrap().to_owned()
}

async fn chat(fleet: &switchyard::demo::Fleet, key: &str, model: &str, max_tokens: u32) -> u16 {
    http()
        .post(format!("{}/chat/completions", fleet.openai_base_url()))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn usage(fleet: &switchyard::demo::Fleet, key: &str, query: &str) -> Value {
    http()
        .get(format!("{}/usage{query}", fleet.openai_base_url()))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_shows_only_the_callers_team() {
    let fleet = fleet(&[("small", 1), ("large", 1)], 20.0, |_| {}).await;
    let a = new_team_key(&fleet, "team-a").await;
    let b = new_team_key(&fleet, "team-b").await;
    assert_eq!(chat(&fleet, &a, "small", 3).await, 200);
    assert_eq!(chat(&fleet, &a, "small", 4).await, 200);
    assert_eq!(chat(&fleet, &a, "large", 5).await, 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ua = usage(&fleet, &a, "").await;
    let rows = ua["data"].as_array().unwrap();
    let small = rows
        .iter()
        .find(|r| r["model"] == "llama-3.1-8b-instruct")
        .unwrap();
    assert_eq!(
        (
            small["requests"].as_u64(),
            small["completion_tokens"].as_i64()
        ),
        (Some(2), Some(7))
    );
    let large = rows
        .iter()
        .find(|r| r["model"] == "llama-3.3-70b-instruct")
        .unwrap();
    assert_eq!(large["completion_tokens"], 5);
    assert!(small["cost_microcredits"].as_i64().unwrap() > 0);
    let ub = usage(&fleet, &b, "").await;
    assert!(
        ub["data"].as_array().unwrap().is_empty(),
        "team B sees nothing of team A: {ub}"
    );
    assert_ne!(ua["team_id"], ub["team_id"]);
    // The query cannot widen the scope, and bounds filter.
    let future = usage(&fleet, &a, "?from=2999-01-01T00:00:00Z").await;
    assert!(future["data"].as_array().unwrap().is_empty());
    let bad = http()
        .get(format!("{}/usage?from=yesterday", fleet.openai_base_url()))
        .bearer_auth(&a)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_references_get_422_before_anything_is_reserved() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let body = json!({
        "model": "small",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}
        ]}],
    });
    let resp = http()
        .post(format!("{}/chat/completions", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "unsafe_reference");
    assert!(fleet.store.ledger_rows(None).await.unwrap().is_empty());
    fleet.shutdown(Duration::from_secs(1)).await;
}
