//! LiteLLM's proxy, the gateway most teams would pick instead, measured against the same
//! engine as Switchyard: installed by `loadtest/peers/setup.sh` (embedded here) into a
//! virtualenv under the build directory, started with `loadtest/peers/litellm.yaml`, and
//! stopped with its worker processes (it runs in a process group of its own).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use crate::drill::free_port;

/// Makes the virtualenv and prints LiteLLM's version.
const SETUP: &str = include_str!("../../peers/setup.sh");
/// The proxy's configuration: model `tiny` → `BENCH_ENGINE_URL`.
const CONFIG: &str = include_str!("../../peers/litellm.yaml");

/// Installs LiteLLM's proxy under `peers` (once; later runs find it); its version. The
/// installer's output goes to `out/litellm-setup.log`.
pub async fn setup(peers: &Path, out: &Path) -> anyhow::Result<String> {
    let log = out.join("litellm-setup.log");
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let done = Command::new("bash")
        .arg("-c")
        .arg(SETUP)
        .arg("setup.sh")
        .arg(peers)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(file))
        .output()
        .await
        .context("running bash")?;
    if !done.status.success() {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
        bail!(
            "its setup failed ({}; {}): {}",
            done.status,
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    let stdout = String::from_utf8_lossy(&done.stdout);
    Ok(stdout.lines().last().unwrap_or("?").trim().to_owned())
}

/// A running LiteLLM proxy.
#[derive(Debug)]
pub struct LiteLlm {
    child: Option<Child>,
    /// Its OpenAI base URL (`…/v1`).
    pub url: String,
    /// Its master key, the only key it takes.
    pub key: String,
}

impl LiteLlm {
    /// Starts the proxy with `workers` worker processes in front of `engine_url` (an OpenAI
    /// base URL ending in `/v1`) and waits until it answers a completion.
    pub async fn start(
        peers: &Path,
        work: &Path,
        engine_url: &str,
        workers: u32,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(work)?;
        let config = work.join("litellm.yaml");
        std::fs::write(&config, CONFIG)?;
        let port = free_port()?;
        let key = format!(
            "sk-bench-{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let log = std::fs::File::create(work.join("litellm.log"))?;
        let bin: PathBuf = peers.join("litellm-venv/bin/litellm");
        let child = Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--num_workers", &workers.to_string()])
            .current_dir(work)
            .env_remove("DATABASE_URL")
            .env("BENCH_ENGINE_URL", engine_url)
            .env("LITELLM_MASTER_KEY", &key)
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("LITELLM_LOG", "ERROR")
            .env("LITELLM_TELEMETRY", "False")
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let proxy = Self {
            child: Some(child),
            url: format!("http://127.0.0.1:{port}/v1"),
            key,
        };
        proxy.wait_ready(Duration::from_secs(180)).await?;
        Ok(proxy)
    }

    /// Its pid (the workers are its descendants).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    /// Waits for a completed chat completion (the first one imports lazily: slow).
    async fn wait_ready(&self, within: Duration) -> anyhow::Result<()> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        let started = tokio::time::Instant::now();
        let body = serde_json::json!({
            "model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]
        });
        loop {
            let answer = http
                .post(format!("{}/chat/completions", self.url))
                .bearer_auth(&self.key)
                .json(&body)
                .send()
                .await;
            if answer.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            if started.elapsed() > within {
                bail!("LiteLLM did not answer within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops the proxy and its workers: SIGTERM to the group, SIGKILL after 5 s.
    pub async fn stop(mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            signal_group(pid, "TERM");
            let exited = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
            if exited.is_err() {
                signal_group(pid, "KILL");
            }
        }
        let _ = child.kill().await;
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        // A failed scenario drops the proxy without `stop`: its workers must not outlive it.
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            signal_group(pid, "KILL");
        }
    }
}

/// `kill -SIG -- -PGID`: the proxy leads its own group, so this reaches its workers too.
fn signal_group(pgid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}
