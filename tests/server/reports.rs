//! The cost and drift reports end to end: the real server over real PostgreSQL, a simulated
//! node whose agent registers its GPU and reports its engine's counters. After some requests,
//! the cost report shows the node's GPU hours priced at its pool's configured price and USD
//! per million tokens consistent with them, and the drift report's row for the node and today
//! has the ledger's tokens equal to the engine's own counters.

use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{chat_body, drop_pg, fresh_pg, http, post_chat, read_events};

const MODEL: &str = "llama-3.1-8b-instruct";
const POOL: &str = "gpu-l40s";
const USD_PER_GPU_HOUR: f64 = 2.0;

async fn admin_get(fleet: &switchyard::demo::Fleet, path: &str) -> Value {
    let resp = http()
        .get(format!("{}{path}", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    resp.json().await.unwrap()
}

/// Polls `read` every 50 ms until it gives a value or `limit` passes (then panics with
/// `what` and the last answer).
async fn poll<F, Fut>(limit: Duration, what: &str, mut read: F) -> Value
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (bool, Value)>,
{
    let start = std::time::Instant::now();
    loop {
        let (ready, value) = read().await;
        if ready {
            return value;
        }
        assert!(
            start.elapsed() < limit,
            "timed out waiting for {what}: {value}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn range() -> String {
    let now = chrono::Utc::now();
    let at = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%dT%H:%M:%SZ").to_string();
    format!(
        "from={}&to={}",
        at(now - chrono::Duration::hours(1)),
        at(now + chrono::Duration::hours(1))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cost_and_drift_reports_count_a_real_nodes_gpu_hours_and_engine_tokens() {
    let (url, db) = fresh_pg().await;
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 1)],
        time_scale: 20.0,
        agent_backoff_min: Duration::from_millis(100),
        // Heartbeats are what the node's hours and engine counters are counted from.
        heartbeat_interval: Duration::from_millis(250),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.costs.pools = [(POOL.to_owned(), USD_PER_GPU_HOUR)].into();
    let fleet = switchyard::demo::Fleet::start(config, &url).await.unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    let node_id = fleet.nodes[0].node_id.clone();
    let base = fleet.server.base_url();
    let put = http()
        .put(format!("{base}/admin/nodes/{node_id}/pool"))
        .bearer_auth(&fleet.admin_token)
        .json(&json!({"pool": POOL}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let listed = admin_get(&fleet, "/admin/nodes").await;
    let listed = &listed["data"][0];
    assert_eq!(
        (listed["node_id"].as_str(), listed["pool"].as_str()),
        (Some(node_id.as_str()), Some(POOL))
    );
    assert_eq!(
        listed["gpus"].as_array().unwrap().len(),
        1,
        "the demo's 8B node registers its one L40S"
    );

    let (mut prompt, mut completion) = (0, 0);
    for i in 0..6 {
        let body = chat_body(
            "small",
            &format!("Request {i}: say something."),
            20 + i,
            i % 2 == 0,
        );
        let resp = post_chat(&fleet, &body).await;
        assert_eq!(resp.status(), 200);
        let usage = if i % 2 == 0 {
            let (events, done) = read_events(resp).await;
            assert!(done);
            events
                .iter()
                .rev()
                .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
                .unwrap()
        } else {
            resp.json::<Value>().await.unwrap()["usage"].clone()
        };
        prompt += usage["prompt_tokens"].as_u64().unwrap();
        completion += usage["completion_tokens"].as_u64().unwrap();
    }
    assert!(completion > 0);

    // Drift: the node's row for today, once a heartbeat has carried the engine's counters
    // past the last request.
    let today = chrono::Utc::now().date_naive().to_string();
    let drift_path = format!("/admin/reports/drift?{}", range());
    let row = poll(
        Duration::from_secs(20),
        "the engine's counters to catch up",
        || async {
            let report = admin_get(&fleet, &drift_path).await;
            let row = report["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["node_id"] == node_id.as_str() && r["day"] == today.as_str())
                .cloned()
                .unwrap_or(report);
            (
                row["engine_generation_tokens"].as_u64() >= Some(completion),
                row,
            )
        },
    )
    .await;
    assert_eq!(row["model"], MODEL);
    assert_eq!(
        row["ledger_completion_tokens"].as_u64(),
        Some(completion),
        "{row}"
    );
    assert_eq!(row["ledger_prompt_tokens"].as_u64(), Some(prompt), "{row}");
    assert_eq!(
        row["engine_generation_tokens"].as_u64(),
        Some(completion),
        "{row}"
    );
    assert_eq!(row["engine_prompt_tokens"].as_u64(), Some(prompt), "{row}");
    assert_eq!(row["difference"].as_i64(), Some(0), "{row}");

    // Cost: the node's hours in its pool, at its price; USD per million tokens from both.
    let cost_path = format!("/admin/reports/cost?{}", range());
    let report = poll(
        Duration::from_secs(20),
        "GPU hours to be counted",
        || async {
            let report = admin_get(&fleet, &cost_path).await;
            let counted = report["data"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["pool"] == POOL && p["gpu_hours"].as_f64() > Some(0.0));
            (counted, report)
        },
    )
    .await;
    let pool = report["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pool"] == POOL && p["model"] == MODEL)
        .cloned()
        .unwrap_or_else(|| panic!("no row for {POOL}/{MODEL}: {report}"));
    let hours = pool["gpu_hours"].as_f64().unwrap();
    let usd = pool["usd"].as_f64().unwrap();
    assert_eq!(pool["usd_per_gpu_hour"].as_f64(), Some(USD_PER_GPU_HOUR));
    assert!(hours > 0.0 && hours < 1.0, "{pool}");
    assert!((usd - hours * USD_PER_GPU_HOUR).abs() <= 1e-6, "{pool}");
    let model = report["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["model"] == MODEL)
        .cloned()
        .unwrap();
    assert_eq!(
        model["tokens"].as_u64(),
        Some(prompt + completion),
        "{model}"
    );
    assert_eq!(model["completion_tokens"].as_u64(), Some(completion));
    let per_million = model["usd_per_million_tokens"].as_f64().unwrap();
    let expected = model["usd"].as_f64().unwrap() * 1e6 / (prompt + completion) as f64;
    assert!(per_million > 0.0, "{model}");
    assert!(
        (per_million - expected).abs() <= expected * 1e-6 + 1e-9,
        "{per_million} vs {expected}"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
    drop_pg(&db).await;
}
