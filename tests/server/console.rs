//! The operator's console: its page and assets (embedded, under a strict CSP, public), the
//! admin reads it draws (usage by day as JSON and CSV, credit history, the queues' last hour,
//! each key's last use), and the whole console driven in a real headless Chromium by
//! `tests/python/console_e2e.py` against a demo fleet, with screenshots of every page.

use std::time::Duration;

use serde_json::Value;

use crate::common::{chat_body, drop_pg, fresh_pg, http, post_chat, run_python};

const MODEL: &str = "llama-3.1-8b-instruct";

async fn fleet(nodes: u32) -> (switchyard::demo::Fleet, String) {
    let (url, db) = fresh_pg().await;
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), nodes)],
        time_scale: 20.0,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(250),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    let fleet = switchyard::demo::Fleet::start(config, &url).await.unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    (fleet, db)
}

async fn admin_get(fleet: &switchyard::demo::Fleet, path: &str) -> reqwest::Response {
    http()
        .get(format!("{}{path}", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token)
        .send()
        .await
        .unwrap()
}

async fn admin_json(fleet: &switchyard::demo::Fleet, path: &str) -> Value {
    let resp = admin_get(fleet, path).await;
    assert_eq!(resp.status(), 200, "{path}");
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_and_its_reads_answer_from_the_ledger_and_the_queues() {
    let (fleet, db) = fleet(1).await;
    let base = fleet.server.base_url();

    // The page and its assets: public (they hold no data), no inline code allowed.
    for (path, kind) in [
        ("/console", "text/html"),
        ("/console/app.js", "text/javascript"),
        ("/console/ui.js", "text/javascript"),
        ("/console/app.css", "text/css"),
    ] {
        let resp = http().get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let h = resp.headers();
        assert!(
            h["content-type"].to_str().unwrap().starts_with(kind),
            "{path}"
        );
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"));
        assert_eq!(h["x-content-type-options"], "nosniff");
    }
    let unknown = http()
        .get(format!("{base}/console/secrets.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let page = http().get(format!("{base}/console")).send().await.unwrap();
    let page = page.text().await.unwrap();
    assert!(page.contains("/console/app.js") && !page.contains("<script>"));

    // The reads are admin-only.
    for path in ["/admin/usage", "/admin/credits?team=demo", "/admin/queues"] {
        let resp = http().get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 401, "{path}");
        let with_key = http()
            .get(format!("{base}{path}"))
            .bearer_auth(&fleet.api_key)
            .send()
            .await
            .unwrap();
        assert_eq!(with_key.status(), 403, "{path}");
    }

    let keys = admin_json(&fleet, "/admin/keys?team=demo").await;
    assert_eq!(keys["data"][0]["last_used_at"], Value::Null, "{keys}");

    let (mut prompt, mut completion) = (0, 0);
    for i in 0..3 {
        let body = chat_body("small", &format!("Usage {i}."), 8, false);
        let resp = post_chat(&fleet, &body).await;
        assert_eq!(resp.status(), 200);
        let usage = resp.json::<Value>().await.unwrap()["usage"].clone();
        prompt += usage["prompt_tokens"].as_u64().unwrap();
        completion += usage["completion_tokens"].as_u64().unwrap();
    }

    let usage = admin_json(&fleet, "/admin/usage?team=demo").await;
    let rows = usage["data"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{usage}");
    let row = &rows[0];
    assert_eq!(row["team"], "demo");
    assert_eq!(row["model"], MODEL);
    assert_eq!(row["requests"], 3);
    assert_eq!(row["prompt_tokens"].as_u64(), Some(prompt));
    assert_eq!(row["completion_tokens"].as_u64(), Some(completion));
    assert_eq!(row["day"], chrono::Utc::now().date_naive().to_string());
    assert!(row["cost_microcredits"].as_u64().unwrap() > 0);

    let csv = admin_get(&fleet, "/admin/usage?format=csv").await;
    assert_eq!(csv.status(), 200);
    assert!(
        csv.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    assert!(
        csv.headers()["content-disposition"]
            .to_str()
            .unwrap()
            .contains("attachment")
    );
    let csv = csv.text().await.unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "day,team_id,team,model,requests,prompt_tokens,completion_tokens,cost_microcredits"
    );
    assert_eq!(lines.len(), 2, "{csv}");
    assert!(
        lines[1].contains(&format!(",demo,{MODEL},3,{prompt},{completion},")),
        "{csv}"
    );

    for (query, param) in [
        ("format=xml", "format"),
        ("from=yesterday", "from"),
        ("from=2026-01-02T00:00:00Z&to=2026-01-01T00:00:00Z", "to"),
        ("from=2020-01-01T00:00:00Z&to=2026-01-01T00:00:00Z", "from"),
        ("bogus=1", ""),
    ] {
        let resp = admin_get(&fleet, &format!("/admin/usage?{query}")).await;
        assert_eq!(resp.status(), 400, "{query}");
        let body: Value = resp.json().await.unwrap();
        if !param.is_empty() {
            assert_eq!(body["error"]["param"], param, "{query}: {body}");
        }
    }
    let unknown = admin_get(&fleet, "/admin/usage?team=nobody").await;
    assert_eq!(unknown.status(), 404);

    let credits = admin_json(&fleet, "/admin/credits?team=demo").await;
    assert_eq!(credits["data"][0]["note"], "demo credits", "{credits}");
    assert!(credits["data"][0]["amount_microcredits"].as_i64().unwrap() > 0);
    assert_eq!(admin_get(&fleet, "/admin/credits").await.status(), 400);

    let keys = admin_json(&fleet, "/admin/keys?team=demo").await;
    assert!(keys["data"][0]["last_used_at"].is_string(), "{keys}");

    // A request refused before it names a model is counted apart, by its code.
    let refused = http()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("sk-sy-not-a-key")
        .json(&chat_body("small", "x", 4, false))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);

    let queues = admin_json(&fleet, "/admin/queues").await;
    let unauthorized: u64 = queues["before_model"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["refused"]["unauthorized"].as_u64())
        .sum();
    assert!(unauthorized >= 1, "{queues}");
    assert_eq!(queues["window_seconds"], 3600);
    let small = queues["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["model"] == MODEL)
        .unwrap_or_else(|| panic!("{queues}"));
    assert_eq!(small["nodes"], 1);
    let dispatched: u64 = small["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["dispatched"].as_u64().unwrap())
        .sum();
    assert!(dispatched >= 3, "{small}");

    fleet.shutdown(Duration::from_secs(1)).await;
    drop_pg(&db).await;
}

/// The console in a real browser (Debian's Chromium, driven by Playwright): sign in with the
/// demo's admin token, create a team and a key (shown once), revoke it, add credits, drain a
/// node and see its state change, and see usage appear after traffic. Screenshots of every
/// page go to `target/console-screenshots/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_does_an_operators_day_in_a_real_browser() {
    let chromium = std::path::Path::new("/usr/bin/chromium");
    assert!(
        chromium.exists(),
        "Debian's chromium is needed (scripts/test installs it: apt-get install chromium)"
    );
    let (fleet, db) = fleet(2).await;
    let shots = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let out = run_python(
        "console_e2e.py",
        &[
            &fleet.server.base_url(),
            &fleet.admin_token,
            &fleet.api_key,
            shots.to_str().unwrap(),
        ],
    )
    .await;
    assert!(out.contains("console e2e: ok"), "{out}");
    for page in [
        "signin", "teams", "keys", "usage", "nodes", "queues", "reports",
    ] {
        let shot = shots.join(format!("{page}.png"));
        assert!(
            std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000),
            "no screenshot of {page}"
        );
    }
    fleet.shutdown(Duration::from_secs(1)).await;
    drop_pg(&db).await;
}
