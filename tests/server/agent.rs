//! `switchyard node` as a process, as the Helm chart's sidecar runs it: the token read from a
//! file (a mounted Secret), its GPUs registered, and SIGTERM draining the node — the stream
//! it runs finishes, nothing new goes to it, and it exits 0.

use std::process::Stdio;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard::sim::{SimConfig, SimServer};
use tokio::io::AsyncReadExt;

use crate::common::{chat_body, fleet, http, metric, post_chat, read_events, wait_for};

const MODEL: &str = "llama-3.1-8b-instruct";

async fn nodes(fleet: &switchyard::demo::Fleet) -> Vec<Value> {
    let body: Value = http()
        .get(format!("{}/admin/nodes", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["data"].as_array().unwrap().clone()
}

async fn node(fleet: &switchyard::demo::Fleet, id: &str) -> Option<Value> {
    nodes(fleet).await.into_iter().find(|n| n["node_id"] == id)
}

/// Whether the server's queue for the model routes nothing new to `id`.
async fn draining(fleet: &switchyard::demo::Fleet, id: &str) -> bool {
    let stats = fleet.server.state().queues[MODEL].stats().await.unwrap();
    stats.nodes.iter().any(|(n, _, d)| n == id && *d)
}

/// A `switchyard node` process for `engine`, its token in a file as a Secret is mounted.
struct Agent {
    child: tokio::process::Child,
    token: String,
    log: Option<tokio::task::JoinHandle<String>>,
    dir: std::path::PathBuf,
}

impl Agent {
    async fn start(
        fleet: &switchyard::demo::Fleet,
        engine: &SimServer,
        node_id: &str,
        drain_timeout: &str,
    ) -> Agent {
        let base = fleet.server.base_url();
        let issued: Value = http()
            .post(format!("{base}/admin/nodes"))
            .bearer_auth(&fleet.admin_token)
            .json(&json!({"node_id": node_id, "location": "cloud"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let token = issued["token"].as_str().unwrap().to_owned();
        let dir = std::env::temp_dir().join(format!("sy-agent-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let token_file = dir.join("token");
        // As a Secret is mounted: the value with a trailing newline.
        std::fs::write(&token_file, format!("{token}\n")).unwrap();
        let mut agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args(["node", "--server", &base, "--node-id", node_id])
            .arg("--token-file")
            .arg(&token_file)
            .args([
                "--gpus",
                "2",
                "--gpu-name",
                "NVIDIA L40S",
                "--gpu-memory-mib",
                "46068",
            ])
            .args(["--engine", &engine.base_url(), "--location", "cloud"])
            .args(["--drain-timeout", drain_timeout])
            .env_remove("SWITCHYARD_NODE_TOKEN")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut stderr = agent.stderr.take().unwrap();
        let log = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            text
        });
        Agent {
            child: agent,
            token,
            log: Some(log),
            dir,
        }
    }

    /// Sends SIGTERM.
    async fn signal(&self) {
        let pid = self.child.id().unwrap().to_string();
        let killed = tokio::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(killed.success());
    }

    /// Its stderr, once it has exited.
    async fn log(&mut self) -> String {
        self.log.take().unwrap().await.unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_node_lets_its_stream_finish_and_exits_zero() {
    let fleet = fleet(&[], 1.0, |_| {}).await;
    let (engine, mut agent) = ready_agent(&fleet, "proc-1", "30s").await;
    let token = agent.token.clone();
    let listed = node(&fleet, "proc-1").await.unwrap();
    let gpus = listed["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2, "{listed}");
    assert_eq!(
        (gpus[1]["index"].as_u64(), gpus[1]["name"].as_str()),
        (Some(1), Some("NVIDIA L40S"))
    );
    assert_eq!(listed["pool"], "unassigned");

    // A stream runs on the node (the only one) when the signal comes.
    let rest = running_stream(&fleet, 150).await;
    drain_by_signal(&agent, &fleet, "proc-1").await;
    assert!(
        !rest.is_finished(),
        "the stream was still running at the drain"
    );

    // New work goes to another node, never to the draining one.
    let config = switchyard::demo::FleetConfig {
        agent_backoff_min: Duration::from_millis(100),
        ..Default::default()
    };
    let other = fleet.add_node(&config, "small-b", MODEL).await.unwrap();
    wait_for(Duration::from_secs(10), "the second node", || async {
        fleet.server.state().view.local_count() >= 2
    })
    .await;
    for _ in 0..3 {
        let resp = post_chat(&fleet, &chat_body("small", "hi", 5, true)).await;
        assert_eq!(resp.status(), 200);
        let (events, done) = read_events(resp).await;
        assert!(done && events.iter().all(|e| e.get("error").is_none()));
    }
    assert_eq!(
        other.agent_stats.assignments(),
        3,
        "every new request on the other node"
    );

    // The first stream ends whole; then the agent leaves and exits 0.
    let text = rest.await.unwrap();
    assert!(
        text.contains("data: [DONE]"),
        "the stream finished during the drain"
    );
    assert!(!text.contains("\"error\""), "{text}");
    let status = tokio::time::timeout(Duration::from_secs(30), agent.child.wait())
        .await
        .expect("the agent exits after its drain")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let client = http();
    let engine_tokens = metric(&client, &engine.base_url(), "vllm:generation_tokens_total").await;
    let completion: u64 = crate::common::sse_data(&text)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())
        .unwrap();
    assert_eq!(
        engine_tokens as u64, completion,
        "the draining node's engine ran nothing but the first stream"
    );
    let log = agent.log().await;
    assert!(log.contains("draining"), "{log}");
    assert!(!log.contains(&token), "the token never reaches the log");
    engine.shutdown().await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// Starts an engine and a process agent for it on `fleet` and waits until it is ready.
/// Signals the agent and waits until the server sees node `id` draining.
async fn drain_by_signal(agent: &Agent, fleet: &switchyard::demo::Fleet, id: &str) {
    agent.signal().await;
    wait_for(
        Duration::from_secs(10),
        "the server to see the node draining",
        || draining(fleet, id),
    )
    .await;
}

/// Signals the agent and waits for it to exit with `code` within five seconds.
async fn signal_until_exit(agent: &mut Agent, code: i32, what: &str) {
    let signalled = std::time::Instant::now();
    agent.signal().await;
    let status = tokio::time::timeout(Duration::from_secs(10), agent.child.wait())
        .await
        .expect(what)
        .unwrap();
    assert_eq!(status.code(), Some(code));
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "{what}: {:?}",
        signalled.elapsed()
    );
}

async fn ready_agent(
    fleet: &switchyard::demo::Fleet,
    node_id: &str,
    drain_timeout: &str,
) -> (SimServer, Agent) {
    let engine = SimServer::start(SimConfig {
        model: MODEL.into(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let agent = Agent::start(fleet, &engine, node_id, drain_timeout).await;
    wait_for(Duration::from_secs(20), "the agent to register", || async {
        node(fleet, node_id)
            .await
            .is_some_and(|n| n["health"] == "ready")
    })
    .await;
    (engine, agent)
}

/// Sends a stream of `max_tokens` and returns once its first content arrived, with the task
/// reading the rest.
async fn running_stream(
    fleet: &switchyard::demo::Fleet,
    max_tokens: u32,
) -> tokio::task::JoinHandle<String> {
    let resp = post_chat(
        fleet,
        &chat_body("small", "Tell me a long story.", max_tokens, true),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while !text.contains("\"content\":\"") || !text.contains("\n\n") {
        let chunk = body.next().await.expect("a first chunk").unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    tokio::spawn(async move {
        while let Some(Ok(c)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        text
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_still_running_at_the_drain_timeout_is_stopped_and_billed_and_the_agent_exits_zero() {
    let fleet = fleet(&[], 1.0, |_| {}).await;
    let (engine, mut agent) = ready_agent(&fleet, "proc-2", "1s").await;
    // About 8.5 s of decoding: far past the drain timeout.
    let rest = running_stream(&fleet, 400).await;
    signal_until_exit(&mut agent, 0, "the agent exits at its drain timeout").await;
    let text = rest.await.unwrap();
    assert!(
        !text.contains("data: [DONE]"),
        "the stream was stopped, not finished"
    );
    assert!(text.contains("model_backend_error"), "{text}");
    let id = crate::common::completion_id(&text);
    let row = crate::common::settled_row(&fleet.store, &id).await;
    assert!(row.completion_tokens > 0, "billed for what it got: {row:?}");
    assert!(row.completion_tokens < 400, "{row:?}");
    engine.shutdown().await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_the_agent_at_once() {
    let fleet = fleet(&[], 1.0, |_| {}).await;
    let (engine, mut agent) = ready_agent(&fleet, "proc-3", "60s").await;
    let rest = running_stream(&fleet, 400).await;
    drain_by_signal(&agent, &fleet, "proc-3").await;
    assert!(!rest.is_finished());
    signal_until_exit(&mut agent, 1, "the agent stops at the second signal").await;
    let log = agent.log().await;
    assert!(log.contains("second signal"), "{log}");
    let text = rest.await.unwrap();
    assert!(!text.contains("data: [DONE]"));
    engine.shutdown().await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_token_and_a_token_file_together_or_neither_are_refused() {
    let bin = env!("CARGO_BIN_EXE_switchyard");
    let dir = std::env::temp_dir().join(format!("sy-agent-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "sy-node-secret-from-file\n").unwrap();
    let empty = dir.join("empty");
    std::fs::write(&empty, "  \n").unwrap();
    let base = ["node", "--server", "http://127.0.0.1:9", "--node-id", "n1"];
    let run = |extra: Vec<String>, env_token: Option<&str>| {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(base)
            .args(extra)
            .env_remove("SWITCHYARD_NODE_TOKEN");
        if let Some(t) = env_token {
            cmd.env("SWITCHYARD_NODE_TOKEN", t);
        }
        cmd.output().unwrap()
    };
    let path = file.display().to_string();
    for (extra, env_token, expect) in [
        (
            vec![
                "--token".into(),
                "sy-node-secret-flag".into(),
                "--token-file".into(),
                path.clone(),
            ],
            None,
            "both",
        ),
        (
            vec!["--token-file".into(), path.clone()],
            Some("sy-node-secret-env"),
            "both",
        ),
        (vec![], None, "no node token"),
        (
            vec!["--token-file".into(), empty.display().to_string()],
            None,
            "empty",
        ),
        (
            vec![
                "--token-file".into(),
                dir.join("missing").display().to_string(),
            ],
            None,
            "node token file",
        ),
    ] {
        let out = run(extra.clone(), env_token);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}: {stderr}");
        assert!(stderr.contains(expect), "{extra:?}: {stderr}");
        assert!(
            !stderr.contains("sy-node-secret"),
            "{extra:?}: a token in {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
