//! A local cluster started for one drill: its own Redis, a fresh PostgreSQL database,
//! `switchyard serve` replicas, simulated engines and node agents — each a child process,
//! killed when the stack is dropped, so a failed drill leaves nothing behind.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use sqlx::Connection;
use tokio::process::{Child, Command};

use super::proxy::CutProxy;

/// The model every drill serves.
pub const MODEL: &str = "tiny";

/// A model a stack serves, the nodes that run it and its engines' fixed timing.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedModel {
    /// The model's name, as the replicas and its engines know it.
    pub name: String,
    /// Simulated nodes that run it (one engine and one agent each).
    pub nodes: usize,
    /// Assignments one of its nodes carries at once.
    pub node_concurrency: u32,
    /// Its engines' time to first token, engine milliseconds (`--profile fixed`).
    pub ttft_ms: u64,
    /// Its engines' time between tokens, engine milliseconds.
    pub itl_ms: u64,
}

/// What a drill's stack runs.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// `switchyard serve` replicas.
    pub replicas: usize,
    /// Simulated nodes (one engine and one agent each), spread over the replicas.
    pub nodes: usize,
    /// The engines run this many times faster than real.
    pub time_scale: f64,
    /// Assignments a node carries at once.
    pub node_concurrency: u32,
    /// Extra TOML appended to the replicas' configuration.
    pub extra_toml: String,
    /// Seconds a queue's or budget's owner lease lasts.
    pub owner_lease_secs: u64,
    /// Node 0's agent dials replica 0 only, through a proxy the drill can cut.
    pub cut_node: bool,
    /// The replicas reach PostgreSQL through a proxy the drill can cut.
    pub cut_database: bool,
    /// Every node dials this replica first (the others after it); `None`: node `n` dials
    /// replica `n % replicas` first.
    pub nodes_dial_first: Option<usize>,
}

impl StackConfig {
    /// What [`Stack::start`] serves: [`MODEL`] alone, on `nodes` nodes carrying
    /// `node_concurrency` each, its engines at 50 ms to the first token and 20 ms a token.
    pub fn one_model(&self) -> Vec<ServedModel> {
        vec![ServedModel {
            name: MODEL.to_owned(),
            nodes: self.nodes,
            node_concurrency: self.node_concurrency,
            ttft_ms: 50,
            itl_ms: 20,
        }]
    }
}

impl Default for StackConfig {
    fn default() -> Self {
        Self {
            replicas: 3,
            nodes: 3,
            time_scale: 10.0,
            node_concurrency: 64,
            extra_toml: String::new(),
            owner_lease_secs: 1,
            cut_node: false,
            cut_database: false,
            nodes_dial_first: None,
        }
    }
}

/// A `switchyard serve` process.
#[derive(Debug)]
pub struct Replica {
    /// Its replica id.
    pub id: String,
    /// Its base URL.
    pub url: String,
    pub child: Option<Child>,
}

/// The running stack.
#[derive(Debug)]
pub struct Stack {
    bin: PathBuf,
    work: PathBuf,
    maintenance_url: String,
    db_name: String,
    /// The drill's database.
    pub db_url: String,
    /// The database as the replicas reach it (through `database_proxy` when there is one).
    replica_db_url: String,
    /// Between the replicas and PostgreSQL, with [`StackConfig::cut_database`].
    pub database_proxy: Option<CutProxy>,
    /// Between node 0's agent and replica 0, with [`StackConfig::cut_node`].
    pub node_proxy: Option<CutProxy>,
    /// The drill's own Redis.
    pub redis_url: String,
    redis_port: u16,
    prefix: String,
    admin: String,
    /// Replicas, the first started first (it owns every queue at the start).
    pub replicas: Vec<Replica>,
    /// Node ids, in start order.
    pub node_ids: Vec<String>,
    /// The model each node runs, by node.
    pub node_models: Vec<ServedModel>,
    /// The engines' child processes, by node.
    pub engines: Vec<Option<Child>>,
    /// The engines' ports, by node.
    pub engine_ports: Vec<u16>,
    pub agents: Vec<Option<Child>>,
    redis: Option<Child>,
    /// An API key of the drill's team, with generous limits.
    pub key: String,
    /// The team's id.
    pub team_id: i64,
    config: StackConfig,
    /// The models served.
    models: Vec<ServedModel>,
    http: reqwest::Client,
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn log_file(work: &Path, name: &str) -> anyhow::Result<Stdio> {
    let file = std::fs::File::create(work.join(name))
        .with_context(|| format!("creating {}", work.join(name).display()))?;
    Ok(Stdio::from(file))
}

impl Stack {
    /// Starts everything and waits until every replica routes to every node.
    pub async fn start(bin: &Path, database: &str, config: StackConfig) -> anyhow::Result<Self> {
        let models = config.one_model();
        Self::start_serving(bin, database, config, models).await
    }

    /// [`Self::start`] serving `models` on their nodes (`config.nodes` and
    /// `config.node_concurrency` unused).
    pub async fn start_serving(
        bin: &Path,
        database: &str,
        config: StackConfig,
        models: Vec<ServedModel>,
    ) -> anyhow::Result<Self> {
        let tag = format!("{:08x}", rand_u32());
        let work = std::env::temp_dir().join(format!("switchyard-drill-{tag}"));
        std::fs::create_dir_all(&work)?;
        let redis_port = free_port()?;
        let redis = spawn_redis(&work, redis_port)?;
        let db_name = format!("sydrill_{tag}");
        let maintenance_url = database.to_owned();
        let db_url = match maintenance_url.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{db_name}"),
            None => bail!("DATABASE must name a database: {maintenance_url}"),
        };
        let mut conn = sqlx::PgConnection::connect(&maintenance_url)
            .await
            .with_context(|| format!("connecting to {maintenance_url}"))?;
        // The name is ours: a fixed prefix and hex digits.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db_name}")))
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        let (database_proxy, replica_db_url) = if config.cut_database {
            let mut url = reqwest::Url::parse(&db_url).context("the database URL")?;
            let target = format!(
                "{}:{}",
                url.host_str().unwrap_or("127.0.0.1"),
                url.port().unwrap_or(5432)
            );
            let proxy = CutProxy::start(target).await?;
            url.set_host(Some("127.0.0.1"))?;
            url.set_port(Some(proxy.port))
                .map_err(|()| anyhow::anyhow!("the database URL takes no port"))?;
            (Some(proxy), url.to_string())
        } else {
            (None, db_url.clone())
        };
        let mut stack = Self {
            bin: bin.to_owned(),
            work,
            maintenance_url,
            db_name,
            db_url,
            replica_db_url,
            database_proxy,
            node_proxy: None,
            redis_url: format!("redis://127.0.0.1:{redis_port}"),
            redis_port,
            prefix: format!("drill-{tag}:"),
            admin: format!("adm-drill-{tag}"),
            replicas: Vec::new(),
            node_ids: Vec::new(),
            node_models: Vec::new(),
            engines: Vec::new(),
            engine_ports: Vec::new(),
            agents: Vec::new(),
            redis: Some(redis),
            key: String::new(),
            team_id: 0,
            config,
            models,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        };
        // From here on a failure stops what started and drops the database (the logs stay).
        match stack.bring_up().await {
            Ok(()) => Ok(stack),
            Err(e) => {
                let logs = stack.work_dir().display().to_string();
                if let Err(cleanup) = stack.stop(true).await {
                    eprintln!("drill: could not clean up after a failed start: {cleanup:#}");
                }
                Err(e.context(format!("starting the drill's cluster (logs in {logs})")))
            }
        }
    }

    /// Redis, the replicas, the team and key, the nodes: everything after the database.
    async fn bring_up(&mut self) -> anyhow::Result<()> {
        let stack = self;
        wait_port(stack.redis_port).await?;
        stack.write_config()?;
        for i in 0..stack.config.replicas {
            let replica = stack.spawn_replica(&format!("drill-{i}"), free_port()?)?;
            wait_healthy(&stack.http, &replica.url).await?;
            stack.replicas.push(replica);
        }
        let team = stack
            .admin_post("/admin/teams", json!({"name": "drill"}))
            .await?;
        stack.team_id = team["id"].as_i64().context("team id")?;
        stack
            .admin_post(
                "/admin/credits",
                json!({"team": stack.team_id, "amount": 1_000_000_000_000_i64}),
            )
            .await?;
        let key = stack
            .admin_post(
                "/admin/keys",
                json!({"team": stack.team_id, "rpm": 1_000_000, "tokens_per_day": 1_000_000_000_000_i64, "max_streams": 100_000}),
            )
            .await?;
        stack.key = key["key"].as_str().context("key")?.to_owned();
        for model in &stack.models {
            for _ in 0..model.nodes {
                stack.node_models.push(model.clone());
            }
        }
        for n in 0..stack.node_models.len() {
            stack.add_node(n).await?;
        }
        stack.wait_nodes_ready(Duration::from_secs(60)).await?;
        Ok(())
    }

    fn write_config(&self) -> anyhow::Result<()> {
        let mut toml = String::new();
        for m in &self.models {
            toml.push_str(&format!(
                "[[models]]\nname = \"{}\"\nprice_input_per_mtok = 1000\nprice_output_per_mtok = 2000\n\
                 node_concurrency = {}\nmax_context_tokens = 8192\n",
                m.name, m.node_concurrency
            ));
        }
        toml.push_str(&format!(
            "[listener]\nmax_connections_per_client = 0\n{}\n",
            self.config.extra_toml
        ));
        std::fs::write(self.work.join("switchyard.toml"), toml)?;
        Ok(())
    }

    fn spawn_replica(&self, id: &str, port: u16) -> anyhow::Result<Replica> {
        let child = Command::new(&self.bin)
            .arg("serve")
            .arg("--config")
            .arg(self.work.join("switchyard.toml"))
            .env("DATABASE_URL", &self.replica_db_url)
            .env("REDIS_URL", &self.redis_url)
            .env("SWITCHYARD_REDIS_PREFIX", &self.prefix)
            .env("SWITCHYARD_LISTEN", format!("127.0.0.1:{port}"))
            .env("SWITCHYARD_ADMIN_TOKEN", &self.admin)
            .env("SWITCHYARD_REPLICA_ID", id)
            .env(
                "SWITCHYARD_OWNER_LEASE_SECS",
                self.config.owner_lease_secs.to_string(),
            )
            .env("RUST_LOG", process_log_filter())
            .stdout(Stdio::null())
            .stderr(log_file(&self.work, &format!("{id}.log"))?)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        Ok(Replica {
            id: id.to_owned(),
            url: format!("http://127.0.0.1:{port}"),
            child: Some(child),
        })
    }

    /// Node `n`: a token, an engine and an agent dialing replica `n % replicas` first.
    async fn add_node(&mut self, n: usize) -> anyhow::Result<()> {
        let node_id = format!("drill-node-{n}");
        let token = self
            .admin_post(
                "/admin/nodes",
                json!({"node_id": node_id, "location": "cloud"}),
            )
            .await?;
        let token = token["token"].as_str().context("node token")?.to_owned();
        let port = free_port()?;
        self.engine_ports.push(port);
        let engine = self.spawn_engine(n, port)?;
        self.engines.push(Some(engine));
        wait_port(port).await?;
        let first = self.config.nodes_dial_first.unwrap_or(n);
        let mut servers: Vec<String> = (0..self.replicas.len())
            .map(|i| self.replicas[(first + i) % self.replicas.len()].url.clone())
            .collect();
        if n == 0 && self.config.cut_node {
            let target = self.replicas[0]
                .url
                .trim_start_matches("http://")
                .to_owned();
            let proxy = CutProxy::start(target).await?;
            servers = vec![format!("http://127.0.0.1:{}", proxy.port)];
            self.node_proxy = Some(proxy);
        }
        let agent = Command::new(&self.bin)
            .args([
                "node",
                "--server",
                &servers.join(","),
                "--node-id",
                &node_id,
            ])
            .args(["--engine", &format!("http://127.0.0.1:{port}")])
            .args(["--location", "cloud"])
            // One GPU per simulated engine, so the cost report has hours to count.
            .args(["--gpus", "1", "--gpu-name", "NVIDIA L40S"])
            .env("SWITCHYARD_NODE_TOKEN", token)
            .env("RUST_LOG", process_log_filter())
            .stdout(Stdio::null())
            .stderr(log_file(&self.work, &format!("{node_id}.log"))?)
            .kill_on_drop(true)
            .spawn()?;
        self.agents.push(Some(agent));
        self.node_ids.push(node_id);
        Ok(())
    }

    fn spawn_engine(&self, n: usize, port: u16) -> anyhow::Result<Child> {
        let model = self.node_models.get(n).context("no such node")?;
        Command::new(&self.bin)
            .args([
                "sim",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--model",
                &model.name,
            ])
            .args(["--profile", "fixed"])
            .args(["--ttft-ms", &model.ttft_ms.to_string()])
            .args(["--itl-ms", &model.itl_ms.to_string()])
            .args(["--time-scale", &self.config.time_scale.to_string()])
            .env("RUST_LOG", process_log_filter())
            .stdout(Stdio::null())
            .stderr(log_file(&self.work, &format!("engine-{n}.log"))?)
            .kill_on_drop(true)
            .spawn()
            .context("starting a simulated engine")
    }

    /// A new team with `credits` microcredits and a key of it with generous limits.
    pub async fn add_team(&self, name: &str, credits: i64) -> anyhow::Result<(i64, String)> {
        let team = self
            .admin_post("/admin/teams", json!({"name": name}))
            .await?;
        let team_id = team["id"].as_i64().context("team id")?;
        if credits > 0 {
            self.admin_post(
                "/admin/credits",
                json!({"team": team_id, "amount": credits}),
            )
            .await?;
        }
        let key = self
            .admin_post(
                "/admin/keys",
                json!({"team": team_id, "rpm": 1_000_000, "tokens_per_day": 1_000_000_000_000_i64, "max_streams": 100_000}),
            )
            .await?;
        Ok((team_id, key["key"].as_str().context("key")?.to_owned()))
    }

    /// A new key of the drill's team with at most `max_streams` streams at once.
    pub async fn key_with_max_streams(&self, max_streams: u32) -> anyhow::Result<String> {
        let key = self
            .admin_post(
                "/admin/keys",
                json!({"team": self.team_id, "rpm": 1_000_000, "tokens_per_day": 1_000_000_000_000_i64, "max_streams": max_streams}),
            )
            .await?;
        Ok(key["key"].as_str().context("key")?.to_owned())
    }

    /// Node `n`'s engine's `/metrics` value of `name` (summed over its labels; 0 when the
    /// engine is down).
    pub async fn engine_metric(&self, n: usize, name: &str) -> f64 {
        self.engine_metric_read(n, name).await.unwrap_or(0.0)
    }

    /// As [`Self::engine_metric`], failing when the engine cannot be read.
    pub async fn engine_metric_read(&self, n: usize, name: &str) -> anyhow::Result<f64> {
        let url = format!("http://127.0.0.1:{}", self.engine_ports[n]);
        self.metric(&url, name).await
    }

    /// Kills replica `i` with SIGKILL (no shutdown of any kind).
    pub async fn kill_replica(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.replicas[i].child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Kills node `n`'s engine with SIGKILL.
    pub async fn kill_engine(&mut self, n: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.engines[n].take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Starts node `n`'s engine again, on its port.
    pub async fn restart_engine(&mut self, n: usize) -> anyhow::Result<()> {
        let port = self.engine_ports[n];
        let engine = self.spawn_engine(n, port)?;
        self.engines[n] = Some(engine);
        wait_port(port).await
    }

    /// Kills the drill's Redis with SIGKILL (everything in it is lost).
    pub async fn kill_redis(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.redis.take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Starts an empty Redis again on the same port.
    pub async fn restart_redis(&mut self) -> anyhow::Result<()> {
        self.redis = Some(spawn_redis(&self.work, self.redis_port)?);
        wait_port(self.redis_port).await
    }

    /// Starts replica `i` again on its port, under a new replica id; waits until healthy.
    pub async fn restart_replica(&mut self, i: usize, id: &str) -> anyhow::Result<()> {
        let port = self.replicas[i]
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .context("the replica's port")?;
        let replica = self.spawn_replica(id, port)?;
        wait_healthy(&self.http, &replica.url).await?;
        self.replicas[i] = replica;
        Ok(())
    }

    /// Stops replica `i` with SIGSTOP (a VM stall, a long pause): its sockets stay open and
    /// silent until [`Self::resume_replica`].
    pub async fn pause_replica(&self, i: usize) -> anyhow::Result<()> {
        self.signal_replica(i, "STOP").await
    }

    /// Lets a paused replica run again (SIGCONT).
    pub async fn resume_replica(&self, i: usize) -> anyhow::Result<()> {
        self.signal_replica(i, "CONT").await
    }

    async fn signal_replica(&self, i: usize, signal: &str) -> anyhow::Result<()> {
        let pid = self.replicas[i]
            .child
            .as_ref()
            .and_then(Child::id)
            .context("the replica is not running")?;
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .await?;
        if !status.success() {
            bail!("kill -{signal} {pid}: {status}");
        }
        Ok(())
    }

    /// The index of the replica whose id is `id`.
    pub fn replica_index(&self, id: &str) -> Option<usize> {
        self.replicas.iter().position(|r| r.id == id)
    }

    /// `GET path` on replica `url` with the admin token.
    pub async fn admin_get(&self, url: &str, path: &str) -> anyhow::Result<Value> {
        Ok(self
            .http
            .get(format!("{url}{path}"))
            .bearer_auth(&self.admin)
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// The replica owning `model`'s queue, as replica `url` knows it (`GET /admin/queues`).
    pub async fn queue_owner(&self, url: &str, model: &str) -> anyhow::Result<Option<String>> {
        let queues = self.admin_get(url, "/admin/queues").await?;
        Ok(queues["data"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|q| q["model"] == model)
            .and_then(|q| q["owner"].as_str().map(str::to_owned)))
    }

    /// The replica holding each node's socket, as replica `url` knows it (`GET /admin/nodes`).
    pub async fn socket_holders(
        &self,
        url: &str,
    ) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
        let nodes = self.admin_get(url, "/admin/nodes").await?;
        Ok(nodes["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| {
                Some((
                    n["node_id"].as_str()?.to_owned(),
                    n["owner_replica"].as_str()?.to_owned(),
                ))
            })
            .collect())
    }

    /// `POST /admin/nodes/{id}/drain` through the first live replica.
    pub async fn drain(&self, node_id: &str) -> anyhow::Result<()> {
        self.admin_post(&format!("/admin/nodes/{node_id}/drain"), json!({}))
            .await
            .map(|_| ())
    }

    /// A replica's `/metrics` value of the unlabelled series `name` (0 when absent).
    pub async fn metric(&self, url: &str, name: &str) -> anyhow::Result<f64> {
        let text = self
            .http
            .get(format!("{url}/metrics"))
            .send()
            .await?
            .text()
            .await?;
        Ok(text
            .lines()
            .filter(|l| l.split([' ', '{']).next() == Some(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }

    /// Resident memory of replica `i` now, bytes (`VmRSS` in /proc; `None` elsewhere or when
    /// it is not running).
    pub fn replica_rss(&self, i: usize) -> Option<u64> {
        rss_bytes(self.replicas.get(i)?.child.as_ref()?.id()?)
    }

    /// The HTTP client the stack uses.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// The replicas still running.
    pub fn live_replicas(&self) -> Vec<&Replica> {
        self.replicas.iter().filter(|r| r.child.is_some()).collect()
    }

    /// Node ids ready on replica `url` (`GET /admin/nodes`).
    pub async fn ready_nodes(&self, url: &str) -> anyhow::Result<Vec<String>> {
        let nodes: Value = self
            .http
            .get(format!("{url}/admin/nodes"))
            .bearer_auth(&self.admin)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(nodes["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["health"] == "ready")
            .filter_map(|n| n["node_id"].as_str().map(str::to_owned))
            .collect())
    }

    /// Waits until every live replica routes to every node; the time it took.
    pub async fn wait_nodes_ready(&self, within: Duration) -> anyhow::Result<Duration> {
        let started = tokio::time::Instant::now();
        loop {
            let mut all = true;
            for r in self.live_replicas() {
                let ready = self.ready_nodes(&r.url).await.unwrap_or_default();
                all &= self.node_ids.iter().all(|id| ready.contains(id));
            }
            if all {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!("the nodes were not ready on every replica within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn admin_post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let url = &self.live_replicas().first().context("no replica")?.url;
        let resp = self
            .http
            .post(format!("{url}{path}"))
            .bearer_auth(&self.admin)
            .json(&body)
            .send()
            .await?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("POST {path}: {status} {body}");
        }
        Ok(body)
    }

    /// Stops every process and drops the database; logs stay in the work directory when
    /// `keep_logs`.
    pub async fn stop(mut self, keep_logs: bool) -> anyhow::Result<()> {
        for a in self.agents.iter_mut().filter_map(Option::take) {
            kill(a).await;
        }
        for e in self.engines.iter_mut().filter_map(Option::take) {
            kill(e).await;
        }
        for r in &mut self.replicas {
            if let Some(c) = r.child.take() {
                kill(c).await;
            }
        }
        if let Some(r) = self.redis.take() {
            kill(r).await;
        }
        if !keep_logs {
            let _ = std::fs::remove_dir_all(&self.work);
        }
        let mut conn = sqlx::PgConnection::connect(&self.maintenance_url).await?;
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db_name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut conn)
            .await?;
        Ok(())
    }

    /// Where the processes' logs are.
    pub fn work_dir(&self) -> &Path {
        &self.work
    }
}

/// A throwaway Redis on `port`, nothing persisted.
fn spawn_redis(work: &Path, port: u16) -> anyhow::Result<Child> {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(log_file(work, &format!("redis-{port}.log"))?)
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting redis-server (is it installed?)")
}

async fn kill(mut child: Child) {
    let _ = child.kill().await;
}

fn rand_u32() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    nanos ^ std::process::id().rotate_left(16)
}

async fn wait_port(port: u16) -> anyhow::Result<()> {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("nothing listens on port {port}")
}

async fn wait_healthy(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    for _ in 0..240 {
        if let Ok(resp) = http.get(format!("{url}/healthz")).send().await
            && resp.status().is_success()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("{url} did not become healthy")
}

/// `VmRSS` of `pid` now, bytes; `None` when it is gone (or off Linux).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// What the drill's processes log: `warn`, or `SWITCHYARD_DRILL_LOG` (a `RUST_LOG` filter,
/// e.g. `info,sqlx=warn` to follow a failing drill's requests in its kept logs).
fn process_log_filter() -> String {
    std::env::var("SWITCHYARD_DRILL_LOG").unwrap_or_else(|_| "warn".to_owned())
}
