//! Test harness shared by the integration tests: simulators on port 0, a small SSE reader,
//! and the throwaway Python environment with the real `openai` package.

#![allow(dead_code)]

pub mod routing;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use switchyard::sim::{SimConfig, SimServer};

/// The captures of the real vLLM server, copied into the repository.
pub fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

/// A captured request body as JSON.
pub fn fixture_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&fixture(name)).unwrap()
}

/// The `data:` payloads of a captured or received SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_owned)
        })
        .collect()
}

/// The first chat completion id (`chatcmpl-…`) in a response's text: the id its generation
/// and ledger row are keyed by (`x-request-id` names the HTTP request, not the completion).
pub fn completion_id(text: &str) -> String {
    let start = text.find("chatcmpl-").expect("a chat completion id");
    text[start..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect()
}

/// Starts a simulator serving `model` with the captures' context limit (1,024 tokens).
pub async fn tiny_sim(time_scale: f64) -> SimServer {
    SimServer::start(SimConfig {
        model: "tiny".into(),
        time_scale,
        max_model_len: Some(1024),
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A new team `name` with ample credits and a key of its own, made through the admin API of
/// the server at `base`; the key.
pub async fn new_team_key(base: &str, admin_token: &str, name: &str) -> String {
    let admin = |path: &str, body: serde_json::Value| {
        http()
            .post(format!("{base}{path}"))
            .bearer_auth(admin_token)
            .json(&body)
            .send()
    };
    let made = admin("/admin/teams", serde_json::json!({"name": name}))
        .await
        .unwrap();
    assert_eq!(made.status(), 201, "team {name}");
    let credits = serde_json::json!({"team": name, "amount": 1_000_000_000_000_i64});
    assert!(
        admin("/admin/credits", credits)
            .await
            .unwrap()
            .status()
            .is_success()
    );
    let key: serde_json::Value = admin("/admin/keys", serde_json::json!({"team": name}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    key["key"].as_str().unwrap().to_owned()
}

pub fn http() -> reqwest::Client {
    // One client, cloned: building one loads the platform's root certificates (tens of
    // milliseconds of CPU), which hundreds of concurrent requests must not each pay. No
    // pooled connections, so every request still opens its own.
    static CLIENT: std::sync::LazyLock<reqwest::Client> = std::sync::LazyLock::new(|| {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    });
    CLIENT.clone()
}

/// A chat request of `prompt` as the single user message.
pub fn chat_body(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// One streamed response as the client saw it.
#[derive(Debug, Default)]
pub struct Streamed {
    pub status: u16,
    /// Arrival time of each non-empty content delta.
    pub content_times: Vec<Instant>,
    /// Content chunks, empty deltas included.
    pub content_chunks: usize,
    pub completion_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub done: bool,
    /// The body ended with a transport error (a cut connection).
    pub cut: bool,
    pub sent: Option<Instant>,
}

impl Streamed {
    /// (completion_tokens − 1) / (last − first content), as the load harness defines it.
    pub fn per_stream_rate(&self) -> f64 {
        let n = self
            .completion_tokens
            .unwrap_or(self.content_times.len() as u64);
        let (first, last) = (
            self.content_times[0],
            self.content_times[self.content_times.len() - 1],
        );
        (n - 1) as f64 / last.duration_since(first).as_secs_f64()
    }
}

/// Sends a streaming request and reads it to the end.
pub async fn stream(client: &reqwest::Client, base: &str, body: &serde_json::Value) -> Streamed {
    let mut out = Streamed {
        sent: Some(Instant::now()),
        ..Default::default()
    };
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    out.status = resp.status().as_u16();
    let mut bytes = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(chunk) = bytes.next().await {
        let Ok(chunk) = chunk else {
            out.cut = true;
            break;
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim_end().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                out.done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if v["choices"][0]["delta"].get("role").is_none() {
                    out.content_chunks += 1;
                }
                if !c.is_empty() {
                    out.content_times.push(Instant::now());
                }
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                out.completion_tokens = u["completion_tokens"].as_u64();
                out.prompt_tokens = u["prompt_tokens"].as_u64();
            }
        }
    }
    out
}

/// The text of `{base}/metrics`.
pub async fn metrics_page(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Reads one sample of the simulator's `/metrics` (labels ignored beyond the name).
pub async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let page = metrics_page(client, base).await;
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Sum of the samples of metric `name` whose line contains `label` (0 when none).
pub async fn metric_sum(base: &str, name: &str, label: &str) -> f64 {
    let page = metrics_page(&http(), base).await;
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `cond` every 10 ms until it holds or `limit` passes; returns the time it took.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// The Python interpreter of a throwaway venv that has the real `openai` package (and
/// `playwright`, which drives Debian's Chromium in the console's browser test).
/// `scripts/test` prepares it; run on its own, a test makes it under `target/` (once, locked).
pub fn python_with_openai() -> PathBuf {
    if let Ok(p) = std::env::var("SWITCHYARD_TEST_PYTHON") {
        return PathBuf::from(p);
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let venv = target.join("test-venv");
    let python = venv.join("bin/python");
    let ready = venv.join(".openai-playwright-ready");
    let lock = target.join("test-venv.lock");
    let deadline = Instant::now() + Duration::from_secs(600);
    while !ready.exists() {
        if std::fs::create_dir(&lock).is_ok() {
            let ok = (python.exists()
                || Command::new("python3")
                    .args(["-m", "venv"])
                    .arg(&venv)
                    .status()
                    .is_ok_and(|s| s.success()))
                && Command::new(&python)
                    .args(["-m", "pip", "install", "-q", "openai>=1.50", "playwright"])
                    .status()
                    .is_ok_and(|s| s.success());
            if ok {
                std::fs::write(&ready, b"").unwrap();
            }
            let _ = std::fs::remove_dir(&lock);
            assert!(ok, "could not prepare a venv with the openai package");
        } else {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for another test to prepare the venv"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    python
}

/// Runs a Python test script with the `openai` package; panics with its output on failure.
pub async fn run_python(script: &str, args: &[&str]) -> String {
    let python = tokio::task::spawn_blocking(python_with_openai)
        .await
        .unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let out = tokio::process::Command::new(python)
        .arg(path)
        .args(args)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs a Node script of `tests/node/` with the real `openai` npm package (installed by
/// `scripts/test` with `npm ci`); panics with its output on failure.
pub async fn run_node(script: &str, args: &[&str]) -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/node");
    assert!(
        dir.join("node_modules/openai/package.json").exists(),
        "{}/node_modules has no `openai` package: run scripts/test, or `npm ci` in tests/node",
        dir.display()
    );
    let out = tokio::process::Command::new("node")
        .arg(dir.join(script))
        .args(args)
        .current_dir(&dir)
        .output()
        .await
        .unwrap_or_else(|e| panic!("could not run node (Node 20 or later is required): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A fleet (server + simulated nodes with real agents) on port 0 over a fresh SQLite file.
pub async fn fleet(
    nodes: &[(&str, u32)],
    time_scale: f64,
    tweak: impl FnOnce(&mut switchyard::demo::FleetConfig),
) -> switchyard::demo::Fleet {
    let mut config = switchyard::demo::FleetConfig {
        nodes: nodes.iter().map(|(a, n)| ((*a).to_owned(), *n)).collect(),
        time_scale,
        agent_backoff_min: Duration::from_millis(100),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    tweak(&mut config);
    let db = std::env::temp_dir().join(format!(
        "switchyard-test-{}-{:016x}.db",
        std::process::id(),
        rand::random::<u64>()
    ));
    let url = format!("sqlite://{}?mode=rwc", db.display());
    let fleet = switchyard::demo::Fleet::start(config, &url).await.unwrap();
    assert!(
        fleet.wait_registered(Duration::from_secs(10)).await,
        "nodes registered"
    );
    fleet
}

/// A chat request to the server with the fleet's key.
pub async fn post_chat(
    fleet: &switchyard::demo::Fleet,
    body: &serde_json::Value,
) -> reqwest::Response {
    http()
        .post(format!("{}/chat/completions", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The `data:` events of a streamed server response, read to the end (error → cut).
pub async fn read_events(resp: reqwest::Response) -> (Vec<serde_json::Value>, bool) {
    let text = resp.text().await.unwrap_or_default();
    let mut done = false;
    let mut events = Vec::new();
    for data in sse_data(&text) {
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(&data).unwrap());
        }
    }
    (events, done)
}

/// Polls until `cond` holds or `limit` passes; panics with `what` otherwise.
pub async fn wait_for<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if eventually(limit, &mut cond).await.is_none() {
        panic!("timed out waiting for {what}");
    }
}

/// A fresh PostgreSQL database for one test (dropped by the caller with [`drop_pg`]).
pub async fn fresh_pg() -> (String, String) {
    let base = std::env::var("SWITCHYARD_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let name = format!("sy_test_{:016x}", rand::random::<u64>());
    let admin = sqlx::PgPool::connect(&base).await.unwrap_or_else(|e| {
        panic!("PostgreSQL at {base} is required ({e}); scripts/test starts one")
    });
    // The name is generated here from hex digits only.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    let url = match base.rsplit_once('/') {
        Some((server, _)) => format!("{server}/{name}"),
        None => panic!("bad SWITCHYARD_TEST_DATABASE_URL {base}"),
    };
    (url, name)
}

/// Drops a database made by [`fresh_pg`], best effort.
pub async fn drop_pg(name: &str) {
    let base = std::env::var("SWITCHYARD_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    if let Ok(admin) = sqlx::PgPool::connect(&base).await {
        let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&admin).await;
        admin.close().await;
    }
}

/// The Redis URL of the test environment.
pub fn redis_url() -> String {
    std::env::var("SWITCHYARD_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Deletes every Redis key under `prefix` (a test's own namespace), best effort.
pub async fn clean_redis(prefix: &str) {
    let Ok(client) = redis::Client::open(redis_url()) else {
        return;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap_or_default();
    for k in keys {
        let _: Result<(), _> = redis::cmd("DEL").arg(k).query_async(&mut conn).await;
    }
}

/// Waits until the ledger row of `request_id` is settled and returns it.
pub async fn settled_row(
    store: &std::sync::Arc<dyn switchyard::store::Store>,
    request_id: &str,
) -> switchyard::store::LedgerRow {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(row) = store.ledger_row(request_id).await.unwrap()
            && row.status == switchyard::store::LedgerStatus::Settled
        {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "the row of {request_id} did not settle"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The JSON's shape: same keys in the same order, leaves replaced by their type.
pub fn shape(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
        Value::Array(a) => Value::Array(a.iter().take(1).map(shape).collect()),
        Value::String(_) => "string".into(),
        Value::Number(_) => "number".into(),
        Value::Bool(_) => "bool".into(),
        Value::Null => "null".into(),
    }
}
