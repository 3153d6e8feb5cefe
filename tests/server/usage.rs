//! `/v1/usage` is scoped to the caller's team; the SSRF guard refuses internal references
//! before anything is reserved.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{fleet, http};

async fn new_team_key(fleet: &switchyard::demo::Fleet, name: &str) -> String {
    let base = fleet.server.base_url();
    crate::common::new_team_key(&base, &fleet.admin_token, name).await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_of_team_a_reaches_nothing_of_team_b_on_any_route() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let a = new_team_key(&fleet, "alpha").await;
    let b = new_team_key(&fleet, "beta").await;
    assert_eq!(chat(&fleet, &b, "small", 3).await, 200);
    let base = fleet.server.base_url();
    let b_team = fleet.store.team_by_name("beta").await.unwrap().unwrap();
    let b_key_id = fleet.store.api_keys(b_team.id).await.unwrap()[0].id;
    // (method, path, body, statuses team A may get)
    let table: Vec<(reqwest::Method, String, Option<Value>, &[u16])> = vec![
        (reqwest::Method::GET, "/admin/teams".into(), None, &[403]),
        (
            reqwest::Method::GET,
            "/admin/keys?team=beta".into(),
            None,
            &[403],
        ),
        (
            reqwest::Method::DELETE,
            format!("/admin/keys/{b_key_id}"),
            None,
            &[403],
        ),
        (
            reqwest::Method::POST,
            "/admin/credits".into(),
            Some(json!({"team": "beta", "amount": -100})),
            &[403],
        ),
        (
            reqwest::Method::POST,
            "/admin/keys".into(),
            Some(json!({"team": "beta"})),
            &[403],
        ),
        (reqwest::Method::GET, "/admin/nodes".into(), None, &[403]),
        (
            reqwest::Method::POST,
            "/admin/nodes/small-1/drain".into(),
            None,
            &[403],
        ),
        (
            reqwest::Method::DELETE,
            "/admin/nodes/small-1/token".into(),
            None,
            &[403],
        ),
        (
            reqwest::Method::GET,
            format!("/v1/usage?team={}", b_team.id),
            None,
            &[200],
        ),
        (
            reqwest::Method::GET,
            "/v1/generations/anything".into(),
            None,
            &[404],
        ),
    ];
    for (method, path, body, allowed) in table {
        let mut req = http()
            .request(method.clone(), format!("{base}{path}"))
            .bearer_auth(&a);
        if let Some(b) = &body {
            req = req.json(b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        assert!(allowed.contains(&status), "{method} {path}: {status}");
        let text = resp.text().await.unwrap();
        assert!(
            !text.contains("beta") && !text.contains(&b),
            "{method} {path} leaked team B: {text}"
        );
        if path.starts_with("/v1/usage") {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert!(
                v["data"].as_array().unwrap().is_empty(),
                "a query parameter cannot widen the scope"
            );
        }
    }
    // Nothing of team B changed.
    let b_after = fleet.store.team_by_name("beta").await.unwrap().unwrap();
    assert_eq!(b_after.balance_microcredits, b_team.balance_microcredits);
    assert!(
        fleet.store.api_keys(b_team.id).await.unwrap()[0]
            .revoked_at
            .is_none()
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// `GET /admin/reports/drift`: admin only; `from` and `to` required, RFC 3339, in order,
/// each refusal a 400 `invalid_request` naming the field; the answer has per model the
/// settled tokens, the rows under review and their claims against their bills, the reviewed
/// rows themselves, and says whether the engines' own counters were compared (only once a
/// node's heartbeat carried them, which the fleet's node may or may not have sent yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_report_shows_reviewed_rows_to_admins_only() {
    use chrono::{SecondsFormat, Utc};
    use switchyard::store::conformance::{FIVE_TOKENS, bounded};
    use switchyard::store::{Reservation, Settlement};

    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.server.base_url();
    let from = Utc::now() - chrono::Duration::seconds(1);
    for (id, completion) in [("drift-ok", 5), ("drift-over", 100_000)] {
        let r = Reservation {
            model: "drift-model".to_owned(),
            ..bounded(id, fleet.team_id, FIVE_TOKENS)
        };
        fleet.store.reserve(&r).await.unwrap();
        let s = Settlement {
            request_id: id.to_owned(),
            prompt_tokens: 10,
            completion_tokens: completion,
            review: None,
            node_id: None,
        };
        fleet.store.settle(&s).await.unwrap();
    }
    let to = Utc::now() + chrono::Duration::seconds(1);
    let at = |t: chrono::DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::Millis, true);
    let range = format!("?from={}&to={}", at(from), at(to));
    let get = |query: &str, token: Option<&str>| {
        let mut req = http().get(format!("{base}/admin/reports/drift{query}"));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        req.send()
    };
    assert_eq!(get(&range, None).await.unwrap().status(), 401);
    assert_eq!(
        get(&range, Some(&fleet.api_key)).await.unwrap().status(),
        403
    );
    let admin = Some(fleet.admin_token.as_str());
    let refusals = [
        (format!("?from={}", at(from)), "to"),
        (format!("?to={}", at(to)), "from"),
        (format!("?from=yesterday&to={}", at(to)), "from"),
        (format!("?from={}&to={}", at(to), at(from)), "to"),
        (format!("?from={0}&to={0}", at(from)), "to"),
        (format!("{range}&from={}", at(from)), "from"),
    ];
    for (query, param) in refusals {
        let resp = get(&query, admin).await.unwrap();
        assert_eq!(resp.status(), 400, "{query}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_request", "{query}");
        assert_eq!(body["error"]["param"], param, "{query}");
    }
    let resp = get(&range, admin).await.unwrap();
    assert_eq!(resp.status(), 200);
    let report: Value = resp.json().await.unwrap();
    assert_eq!(report["object"], "drift_report");
    // Compared only when some node's row carries its engine's counters.
    let compared = report["engine_counters"]["compared"].as_bool().unwrap();
    let nodes = report["nodes"].as_array().unwrap();
    assert!(!compared || !nodes.is_empty(), "{report}");
    let model = report["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["model"] == "drift-model")
        .unwrap();
    assert_eq!(model["settled_requests"], 2);
    assert_eq!(
        model["settled"],
        json!({"prompt_tokens": 20, "completion_tokens": 10})
    );
    assert_eq!(
        model["under_review"],
        json!({"usage_over_bound": 1, "usage_unrepresentable": 0, "unverified_node": 0})
    );
    assert_eq!(
        model["reviewed_claimed"],
        json!({"prompt_tokens": 10, "completion_tokens": 100_000})
    );
    assert_eq!(
        model["reviewed_billed"],
        json!({"prompt_tokens": 10, "completion_tokens": 5})
    );
    assert_eq!(report["reviewed_truncated"], false);
    let reviewed = report["reviewed"].as_array().unwrap();
    assert_eq!(reviewed.len(), 1);
    let row = &reviewed[0];
    assert_eq!(
        (
            &row["request_id"],
            &row["team_id"],
            &row["model"],
            &row["review"]
        ),
        (
            &json!("drift-over"),
            &json!(fleet.team_id),
            &json!("drift-model"),
            &json!("usage_over_bound")
        )
    );
    assert_eq!(
        row["claimed"],
        json!({"prompt_tokens": 10, "completion_tokens": 100_000})
    );
    assert_eq!(
        row["billed"],
        json!({"prompt_tokens": 10, "completion_tokens": 5})
    );
    assert_eq!(
        row["bounds"],
        json!({"prompt_tokens": 100, "completion_tokens": 5})
    );
    assert!(row["settled_at"].is_string());
}
