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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_node_lets_its_stream_finish_and_exits_zero() {
    let fleet = fleet(&[], 1.0, |_| {}).await;
    let base = fleet.server.base_url();
    let engine = SimServer::start(SimConfig {
        model: MODEL.into(),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let issued: Value = http()
        .post(format!("{base}/admin/nodes"))
        .bearer_auth(&fleet.admin_token)
        .json(&json!({"node_id": "proc-1", "location": "cloud"}))
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
        .args(["node", "--server", &base, "--node-id", "proc-1"])
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
        .args(["--drain-timeout", "30s"])
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
    wait_for(Duration::from_secs(20), "the agent to register", || async {
        node(&fleet, "proc-1")
            .await
            .is_some_and(|n| n["health"] == "ready")
    })
    .await;
    let listed = node(&fleet, "proc-1").await.unwrap();
    let gpus = listed["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2, "{listed}");
    assert_eq!(
        (gpus[1]["index"].as_u64(), gpus[1]["name"].as_str()),
        (Some(1), Some("NVIDIA L40S"))
    );
    assert_eq!(listed["pool"], "unassigned");

    // A stream runs on the node (the only one) when the signal comes.
    let resp = post_chat(
        &fleet,
        &chat_body("small", "Tell me a long story.", 150, true),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while !text.contains("\"content\":\"") || !text.contains("\n\n") {
        let chunk = body.next().await.expect("a first chunk").unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let rest = tokio::spawn(async move {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
                Err(_) => break,
            }
        }
        text
    });
    let pid = agent.id().unwrap().to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(killed.success());
    wait_for(
        Duration::from_secs(10),
        "the server to see the node draining",
        || draining(&fleet, "proc-1"),
    )
    .await;
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
    let status = tokio::time::timeout(Duration::from_secs(30), agent.wait())
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
    let log = log.await.unwrap();
    assert!(log.contains("draining"), "{log}");
    assert!(!log.contains(&token), "the token never reaches the log");
    let _ = std::fs::remove_dir_all(&dir);
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
