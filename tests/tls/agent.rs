//! The node agent over `wss://`: it trusts the server's CA only when told (`--ca-file`), and
//! an untrusted server is refused, logged and retried like any failed connection.

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::{chat_body, wait_for};
use crate::{Pki, engine_and_node, https_client, in_process_agent, registered, tls_fleet};

/// `switchyard node` as a process, its stderr collected line by line.
struct CliAgent {
    /// Killed on drop.
    _child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl CliAgent {
    fn spawn(server: &str, node_id: &str, token: &str, engine: &str, ca: &Path) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args([
                "node",
                "--server",
                server,
                "--node-id",
                node_id,
                "--engine",
                engine,
            ])
            .arg("--ca-file")
            .arg(ca)
            .env("SWITCHYARD_NODE_TOKEN", token)
            .env("RUST_LOG", "info")
            .env_remove("SWITCHYARD_LOG_FORMAT")
            .env_remove("SWITCHYARD_NODE_CA_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        Self {
            _child: child,
            lines,
        }
    }

    fn lines_with(&self, needle: &str) -> Vec<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }

    fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_with_ca_file_registers_over_wss_and_serves_a_chat() {
    let pki = Pki::new("agent-ok", &["127.0.0.1"]);
    let fleet = tls_fleet(&pki, |_| {}).await;
    let (sim, token) = engine_and_node(&fleet, "tls-node-1").await;
    let agent = CliAgent::spawn(
        &fleet.server.base_url(),
        "tls-node-1",
        &token,
        &sim.base_url(),
        &pki.ca,
    );
    wait_for(Duration::from_secs(15), "the agent to register", || async {
        registered(&fleet, "tls-node-1")
    })
    .await;

    let resp = https_client(&pki.ca)
        .post(format!("{}/chat/completions", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .json(&chat_body("small", "Say hello over TLS.", 6, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", agent.log());
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    assert!(
        agent.lines_with("certificate").is_empty(),
        "no certificate complaint:\n{}",
        agent.log()
    );
    drop(agent);
    fleet.shutdown(Duration::from_secs(1)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_trusting_another_ca_refuses_the_server_logs_why_and_retries() {
    let pki = Pki::new("agent-server", &["127.0.0.1"]);
    let stranger = Pki::new("agent-stranger", &["127.0.0.1"]);
    let fleet = tls_fleet(&pki, |_| {}).await;
    let (sim, token) = engine_and_node(&fleet, "tls-node-2").await;
    let agent = CliAgent::spawn(
        &fleet.server.base_url(),
        "tls-node-2",
        &token,
        &sim.base_url(),
        &stranger.ca,
    );
    // The agent's first backoff is 1 s, jittered: a second attempt comes within about 3 s.
    wait_for(
        Duration::from_secs(10),
        "two refused handshakes",
        || async { agent.lines_with("server certificate refused").len() >= 2 },
    )
    .await;
    let refused = agent.lines_with("server certificate refused");
    assert!(
        refused.iter().all(|l| l.contains("UnknownIssuer")
            && l.contains("reconnecting")
            && !l.contains(&token)),
        "{refused:#?}"
    );
    assert!(!registered(&fleet, "tls-node-2"));
    drop(agent);
    fleet.shutdown(Duration::from_secs(1)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_ca_file_never_registers() {
    let pki = Pki::new("agent-noca", &["127.0.0.1"]);
    let fleet = tls_fleet(&pki, |_| {}).await;
    let (sim, token) = engine_and_node(&fleet, "tls-node-3").await;
    let (stop, stats, task) = in_process_agent(&fleet, "tls-node-3", &token, &sim, None);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Backoff is 100–400 ms here: several attempts were made, none got past the handshake.
    assert!(!task.is_finished(), "the agent keeps retrying");
    assert_eq!(stats.connections(), 0);
    assert_eq!(stats.registrations(), 0);
    assert!(!registered(&fleet, "tls-node-3"));

    // The same agent with the CA gets in, so the refusal was the certificate's alone.
    stop.cancel();
    task.await.unwrap().unwrap();
    let (stop, stats, task) = in_process_agent(&fleet, "tls-node-3", &token, &sim, Some(&pki.ca));
    // The server lists the node a moment before the agent has read its `registered`.
    wait_for(Duration::from_secs(10), "the agent to register", || async {
        registered(&fleet, "tls-node-3") && stats.registrations() == 1
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    fleet.shutdown(Duration::from_secs(1)).await;
    sim.shutdown().await;
}
