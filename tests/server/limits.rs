//! Per-key limits at admission: concurrent streams (`max_streams`) and requests per minute,
//! kept in Redis here, with Retry-After and the `x-ratelimit-*` headers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use crate::common::{clean_redis, drop_pg, fresh_pg, http, redis_url};

async fn key_with(fleet: &switchyard::demo::Fleet, limits: Value) -> (String, i64) {
    let mut body = json!({"team": "demo"});
    if let (Some(b), Some(l)) = (body.as_object_mut(), limits.as_object()) {
        b.extend(l.clone());
    }
    let key: Value = http()
        .post(format!("{}/admin/keys", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        key["key"].as_str().unwrap().to_owned(),
        key["id"].as_i64().unwrap(),
    )
}

/// What one request of a burst got back.
#[derive(Debug)]
struct Outcome {
    status: u16,
    /// The value of the header asked for.
    header: Option<String>,
    /// `error.code` of an error body.
    code: Option<String>,
}

/// Sends `n` copies of `body` at once with `key`, reading every answer to the end.
async fn burst(url: &str, key: &str, body: &Value, n: usize, header: &'static str) -> Vec<Outcome> {
    futures::stream::iter(0..n)
        .map(|_| async move {
            let resp = http()
                .post(url)
                .bearer_auth(key)
                .json(body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let header = resp
                .headers()
                .get(header)
                .map(|v| v.to_str().unwrap().to_owned());
            let text = resp.text().await.unwrap();
            let code = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(String::from));
            Outcome {
                status,
                header,
                code,
            }
        })
        .buffer_unordered(n)
        .collect()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_streams_holds_under_500_concurrent_streams_and_places_come_back() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swtest:{:08x}:", rand::random::<u32>());
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 2)],
        time_scale: 10.0,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    let fleet = switchyard::demo::Fleet::start(config, &db_url)
        .await
        .unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    let (key, key_id) = key_with(&fleet, json!({"max_streams": 10})).await;

    // Sample the engines and Redis while the load runs.
    let stop = Arc::new(AtomicBool::new(false));
    let peak_engines = Arc::new(AtomicU64::new(0));
    let peak_redis = Arc::new(AtomicU64::new(0));
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let slots_key = format!("{prefix}k:streams:{key_id}");
    let sampler = {
        let (stop, pe, pr, key, mut conn) = (
            stop.clone(),
            peak_engines.clone(),
            peak_redis.clone(),
            slots_key.clone(),
            conn.clone(),
        );
        let sims: Vec<_> = fleet.nodes.iter().map(|n| n.sim.base_url()).collect();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let mut running = 0u64;
                for base in &sims {
                    let page = http()
                        .get(format!("{base}/metrics"))
                        .send()
                        .await
                        .unwrap()
                        .text()
                        .await
                        .unwrap();
                    running += page
                        .lines()
                        .find(|l| l.starts_with("vllm:num_requests_running{"))
                        .and_then(|l| l.rsplit(' ').next())
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(0.0) as u64;
                }
                pe.fetch_max(running, Ordering::Relaxed);
                let held: u64 = redis::cmd("ZCARD")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(0);
                pr.fetch_max(held, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "stream": true});
    let outcomes = burst(&url, &key, &body, 500, "retry-after").await;
    stop.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    let ok = outcomes.iter().filter(|o| o.status == 200).count();
    let limited: Vec<_> = outcomes.iter().filter(|o| o.status == 429).collect();
    assert!(ok >= 10, "at least the first ten ran: {ok}");
    assert_eq!(ok + limited.len(), 500);
    assert!(
        limited
            .iter()
            .all(|o| o.header.is_some() && o.code.as_deref() == Some("concurrency_limited"))
    );
    assert!(
        peak_engines.load(Ordering::Relaxed) <= 10,
        "engines saw {}",
        peak_engines.load(Ordering::Relaxed)
    );
    assert!(
        peak_redis.load(Ordering::Relaxed) <= 10,
        "redis held {}",
        peak_redis.load(Ordering::Relaxed)
    );

    // Every place comes back once the streams end.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held: u64 = redis::cmd("ZCARD")
        .arg(&slots_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(held, 0);
    let again = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    again.text().await.unwrap();

    fleet.shutdown(Duration::from_secs(1)).await;
    clean_redis(&prefix).await;
    drop_pg(&db_name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpm_refuses_the_sixth_request_with_retry_after_and_counts_down_in_headers() {
    let fleet = crate::common::fleet(&[("small", 1)], 20.0, |_| {}).await;
    let (key, _) = key_with(&fleet, json!({"rpm": 5})).await;
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let body =
        json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let r = http()
            .post(&url)
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-ratelimit-limit-requests"], "5");
        remaining.push(
            r.headers()["x-ratelimit-remaining-requests"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        r.text().await.unwrap();
    }
    assert_eq!(remaining, ["4", "3", "2", "1", "0"]);
    let sixth = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(sixth.status(), 429);
    let wait: u64 = sixth.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (55..=60).contains(&wait),
        "the oldest leaves the window in about a minute: {wait}"
    );
    assert_eq!(sixth.headers()["x-ratelimit-remaining-requests"], "0");
    let err: Value = sixth.json().await.unwrap();
    assert_eq!(err["error"]["code"], "rate_limited");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_covering_ten_estimates_admits_at_most_ten_of_200_concurrent_requests() {
    let fleet = crate::common::fleet(&[("small", 2)], 1.0, |_| {}).await;
    let base = fleet.server.base_url();
    let post = |path: &'static str, body: Value| {
        http()
            .post(format!("{base}{path}"))
            .bearer_auth(&fleet.admin_token)
            .json(&body)
            .send()
    };
    post("/admin/teams", json!({"name": "frugal"}))
        .await
        .unwrap();
    // "hi" is estimated at 4 + 1 prompt tokens; with max_tokens 100 at 0.1/0.2 credits per
    // million tokens the estimate is ceil((5 x 100,000 + 100 x 200,000) / 1e6) = 21.
    post("/admin/credits", json!({"team": "frugal", "amount": 210}))
        .await
        .unwrap();
    let key: Value = post("/admin/keys", json!({"team": "frugal"}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let key = key["key"].as_str().unwrap().to_owned();
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": true});
    let outcomes = burst(&url, &key, &body, 200, "x-should-retry").await;
    let admitted = outcomes.iter().filter(|o| o.status == 200).count();
    assert!((1..=10).contains(&admitted), "admitted {admitted}");
    let refused: Vec<_> = outcomes.iter().filter(|o| o.status == 402).collect();
    assert_eq!(admitted + refused.len(), 200);
    assert!(
        refused.iter().all(|o| o.header.as_deref() == Some("false")),
        "402 says do not retry"
    );
    let team = fleet.store.team_by_name("frugal").await.unwrap().unwrap();
    assert!(
        team.balance_microcredits >= 0,
        "never overspent: {}",
        team.balance_microcredits
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_is_refused() {
    let fleet = crate::common::fleet(&[("small", 1)], 20.0, |_| {}).await;
    let soon = (chrono::Utc::now() + chrono::Duration::seconds(1)).to_rfc3339();
    let (key, _) = key_with(&fleet, json!({"expires_at": soon})).await;
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let body =
        json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    assert_eq!(
        http()
            .post(&url)
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let late = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 401);
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_day_is_counted_at_settle_and_the_sdk_does_not_retry_quota_exhausted() {
    let fleet = crate::common::fleet(&[("small", 1)], 20.0, |_| {}).await;
    let (key, _) = key_with(&fleet, json!({"tokens_per_day": 25})).await;
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20});
    let first = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-ratelimit-limit-tokens"], "25");
    first.text().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // the settle counts the day's tokens
    let spent = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(spent.status(), 429);
    assert_eq!(spent.headers()["x-should-retry"], "false");
    assert_eq!(spent.headers()["x-ratelimit-remaining-tokens"], "0");
    let err: Value = spent.json().await.unwrap();
    assert_eq!(err["error"]["code"], "quota_exhausted");
    assert_eq!(err["error"]["retryable"], false);
    assert!(
        err["error"]["details"]["reset_at"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00+00:00")
    );

    let metric = |page: &str| {
        page.lines()
            .filter(|l| l.starts_with("switchyard_requests_total") && l.contains("quota_exhausted"))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .sum::<f64>()
    };
    let metrics_url = format!("{}/metrics", fleet.server.base_url());
    let before = metric(&page(&metrics_url).await);
    let out =
        crate::common::run_python("server_sdk.py", &[&fleet.openai_base_url(), &key, "quota"])
            .await;
    let seen: Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["quota"]["error"], "RateLimitError");
    assert_eq!(seen["quota"]["code"], "quota_exhausted");
    let after = metric(&page(&metrics_url).await);
    assert_eq!(
        after - before,
        1.0,
        "the SDK sent the request once: no retry"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_place_comes_back_after_a_client_drop_and_an_engine_crash() {
    let fleet = crate::common::fleet(&[("small", 1)], 10.0, |c| {
        c.server.timeouts.cancel_grace_ms = 100
    })
    .await;
    let (key, _) = key_with(&fleet, json!({"max_streams": 1})).await;
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let long = json!({"model": "small", "messages": [{"role": "user", "content": "go"}], "max_tokens": 500, "stream": true});
    let status = |r: &reqwest::Response| r.status().as_u16();

    // A client drops: its place returns once the node confirms the stop.
    let first = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(status(&first), 200);
    let busy = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(status(&busy), 429, "the one place is taken");
    drop(first);
    crate::common::wait_for(Duration::from_secs(5), "the place after a drop", || {
        let (url, key) = (url.clone(), key.clone());
        async move {
            let body = json!({"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1});
            let r = http().post(url).bearer_auth(key).json(&body).send().await.unwrap();
            r.status().as_u16() == 200
        }
    })
    .await;

    // The engine crashes mid-stream: the place returns too.
    fleet.nodes[0].sim.set_faults(&switchyard::sim::FaultSpec {
        crash_after_tokens: Some(2),
        ..Default::default()
    });
    let crashed = http()
        .post(&url)
        .bearer_auth(&key)
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(status(&crashed), 200);
    let text = crashed.text().await.unwrap();
    assert!(text.contains("model_backend_error"));
    crate::common::wait_for(Duration::from_secs(5), "the place after a crash", || {
        let (url, key) = (url.clone(), key.clone());
        async move {
            let body = json!({"model": "small", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1});
            let r = http().post(url).bearer_auth(key).json(&body).send().await.unwrap();
            r.status().as_u16() == 200 || r.status().as_u16() == 502
        }
    })
    .await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// The body of a GET.
async fn page(url: &str) -> String {
    http().get(url).send().await.unwrap().text().await.unwrap()
}
