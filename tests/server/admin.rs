//! The admin API: teams, credits, keys (shown once, revocable), node tokens (revocation
//! closes the live socket), node listing and drain; only the admin token may use it.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{fleet, http, wait_for};

async fn admin(
    fleet: &switchyard::demo::Fleet,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = http()
        .request(method, format!("{}{path}", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teams_credits_and_keys_round_trip_and_revocation_takes_effect_within_5_s() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let (s, team) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/teams",
        Some(json!({"name": "research"})),
    )
    .await;
    assert_eq!(s, 201);
    assert_eq!(team["balance_microcredits"], 0);
    let (s, credited) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/credits",
        Some(json!({"team": "research", "amount": 5_000_000})),
    )
    .await;
    assert_eq!(
        (s, credited["balance_microcredits"].as_i64()),
        (200, Some(5_000_000))
    );
    let (s, key) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"team": team["id"], "model_allowlist": ["small"], "max_streams": 4})),
    )
    .await;
    assert_eq!(s, 201);
    let plaintext = key["key"].as_str().unwrap().to_owned();
    assert!(plaintext.starts_with("sk-sy-"));
    assert!(plaintext.starts_with(key["prefix"].as_str().unwrap()));
    let (_, keys) = admin(
        &fleet,
        reqwest::Method::GET,
        "/admin/keys?team=research",
        None,
    )
    .await;
    assert_eq!(keys["data"].as_array().unwrap().len(), 1);
    assert!(
        keys["data"][0].get("key").is_none(),
        "the plaintext is shown once only"
    );

    let url = format!("{}/chat/completions", fleet.openai_base_url());
    assert_eq!(chat_status(&url, &plaintext).await, 200);
    // The allowlist (["small"]) filters /v1/models and refuses other models.
    let models: Value = http()
        .get(format!("{}/models", fleet.openai_base_url()))
        .bearer_auth(&plaintext)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["llama-3.1-8b-instruct", "small"]);
    let other = http()
        .post(&url)
        .bearer_auth(&plaintext)
        .json(&json!({"model": "large", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 403);
    let (s, _) = admin(
        &fleet,
        reqwest::Method::DELETE,
        &format!("/admin/keys/{}", key["id"]),
        None,
    )
    .await;
    assert_eq!(s, 200);
    wait_for(
        Duration::from_secs(6),
        "revocation to take effect (cache TTL 5 s)",
        || {
            let (url, key) = (url.clone(), plaintext.clone());
            async move { chat_status(&url, &key).await == 401 }
        },
    )
    .await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

async fn chat_status(url: &str, key: &str) -> u16 {
    http()
        .post(url)
        .bearer_auth(key)
        .json(&json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_tokens_list_drain_and_revocation_closes_the_socket() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let (s, nodes) = admin(&fleet, reqwest::Method::GET, "/admin/nodes", None).await;
    assert_eq!(s, 200);
    let node = &nodes["data"][0];
    assert_eq!(
        (node["node_id"].as_str(), node["health"].as_str()),
        (Some("small-1"), Some("ready"))
    );
    // The first chat model's nodes also serve the configured embedding model.
    assert_eq!(node["models"], json!(["llama-3.1-8b-instruct", "bge-m3"]));

    let (s, issued) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/nodes",
        Some(json!({"node_id": "gpu-7", "location": "cloud"})),
    )
    .await;
    assert_eq!(s, 201);
    assert!(issued["token"].as_str().unwrap().starts_with("nt-"));
    let (s, _) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/nodes",
        Some(json!({"node_id": "bad id!", "location": "cloud"})),
    )
    .await;
    assert_eq!(s, 400);

    let (s, _) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/nodes/small-1/load_model",
        Some(json!({"name": "large"})),
    )
    .await;
    assert_eq!(s, 202, "load_model is relayed to the node");
    let (s, _) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/nodes/small-1/load_model",
        Some(json!({"name": "gpt-9"})),
    )
    .await;
    assert_eq!(s, 404);
    let (s, _) = admin(
        &fleet,
        reqwest::Method::DELETE,
        "/admin/nodes/small-1/token",
        None,
    )
    .await;
    assert_eq!(s, 200);
    let state = fleet.server.state().clone();
    wait_for(
        Duration::from_secs(5),
        "the revoked node's socket to close",
        || {
            let state = state.clone();
            async move { state.view.local_count() == 0 }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        (state.view.local_count() == 0),
        "a revoked node cannot register again"
    );
    let (s, _) = admin(
        &fleet,
        reqwest::Method::POST,
        "/admin/nodes/small-1/drain",
        None,
    )
    .await;
    assert_eq!(s, 202);
    let (_, nodes) = admin(&fleet, reqwest::Method::GET, "/admin/nodes", None).await;
    let small = nodes["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == "small-1")
        .unwrap()
        .clone();
    assert_eq!(small["health"], "drained", "{small}");
    assert_eq!(small["token_revoked"], true);

    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_admin_token_opens_admin_routes() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let url = format!("{}/admin/teams", fleet.server.base_url());
    let none = http().get(&url).send().await.unwrap();
    assert_eq!(none.status(), 401);
    let api_key = http()
        .get(&url)
        .bearer_auth(&fleet.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(api_key.status(), 403);
    let body: Value = api_key.json().await.unwrap();
    assert_eq!(body["error"]["code"], "forbidden");
    let unknown = http()
        .get(format!("{}/nope", fleet.server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    fleet.shutdown(Duration::from_secs(1)).await;
}
