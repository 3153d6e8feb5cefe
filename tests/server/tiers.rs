//! Service tiers at the API: a request's `service_tier` honoured within what its key may
//! use, echoed in the answer and every chunk, refused when it names no tier; a key's tiers
//! set and checked at creation.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{chat_body, fleet, http};

/// The `service_tier` of every chunk of a streamed chat completion.
fn chunk_tiers(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["service_tier"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_runs_at_the_tier_its_key_allows_and_every_answer_says_which() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.server.base_url();
    let admin = |body: Value| {
        http()
            .post(format!("{base}/admin/keys"))
            .bearer_auth(&fleet.admin_token)
            .json(&body)
            .send()
    };
    let created = admin(json!({
        "team": 1, "service_tiers": ["priority", "default"], "service_tier": "priority"
    }))
    .await
    .unwrap();
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.unwrap();
    assert_eq!(created["service_tiers"], json!(["priority", "default"]));
    assert_eq!(created["service_tier"], "priority");
    let premium = created["key"].as_str().unwrap().to_owned();

    let chat = |key: &str, tier: Option<&str>, stream: bool| {
        let mut body = chat_body("small", "hello", 4, stream);
        if let Some(t) = tier {
            body["service_tier"] = json!(t);
        }
        http()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    // Nothing asked, or `auto`: the key's own tier; a tier it may use: that one; one it may
    // not: its best.
    for (key, asked, ran) in [
        (&premium, None, "priority"),
        (&premium, Some("auto"), "priority"),
        (&premium, Some("default"), "default"),
        (&premium, Some("flex"), "priority"),
        (&fleet.api_key, None, "default"),
        (&fleet.api_key, Some("flex"), "flex"),
        (&fleet.api_key, Some("priority"), "default"),
    ] {
        let resp = chat(key, asked, false).await.unwrap();
        assert_eq!(resp.status(), 200, "{asked:?}");
        let doc: Value = resp.json().await.unwrap();
        assert_eq!(doc["service_tier"], ran, "{asked:?}");
        let text = chat(key, asked, true).await.unwrap().text().await.unwrap();
        let tiers = chunk_tiers(&text);
        assert!(!tiers.is_empty());
        assert!(tiers.iter().all(|t| t == ran), "{asked:?}: {tiers:?}");
    }

    // A value that names no tier changes nothing and says which field.
    for bad in [json!("turbo"), json!(3), json!(["priority"])] {
        let mut body = chat_body("small", "hello", 4, false);
        body["service_tier"] = bad.clone();
        let resp = http()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(&fleet.api_key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{bad}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["code"], "invalid_request");
        assert_eq!(err["error"]["param"], "service_tier");
    }

    // A key's tiers are checked when it is made.
    for (body, param) in [
        (
            json!({"team": 1, "service_tiers": ["gold"]}),
            "service_tiers[0]",
        ),
        (json!({"team": 1, "service_tiers": []}), "service_tiers"),
        (
            json!({"team": 1, "service_tiers": ["flex", "flex"]}),
            "service_tiers",
        ),
        (json!({"team": 1, "service_tier": "auto"}), "service_tier"),
        (
            json!({"team": 1, "service_tiers": ["flex"], "service_tier": "priority"}),
            "service_tier",
        ),
    ] {
        let resp = admin(body.clone()).await.unwrap();
        assert_eq!(resp.status(), 400, "{body}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["param"], param, "{body}");
    }
    fleet.shutdown(Duration::from_secs(1)).await;
}
