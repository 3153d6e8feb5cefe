//! `switchyard demo`, and the [`Fleet`] behind it: a server replica with embedded storage
//! and in-process coordination, plus simulated GPU nodes — each a `switchyard sim` engine
//! with a real node agent dialing the server over WebSocket on loopback. The integration
//! tests start the same fleet on port 0.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use switchyard_actors::protocol::Location;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::node_agent::{self, AgentConfig, AgentStats};
use crate::server::Server;
use crate::sim::{Profile, SimConfig, SimServer};
use crate::store::{
    API_KEY_PREFIX, NODE_TOKEN_PREFIX, NewApiKey, Store, display_prefix, hash_secret, new_secret,
};

/// Failures while starting a fleet.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// Storage failed.
    #[error("storage: {0}")]
    Store(#[from] crate::store::StoreError),
    /// Coordination failed.
    #[error("coordination: {0}")]
    Coord(#[from] crate::coord::CoordError),
    /// The server failed to start.
    #[error("server: {0}")]
    Server(#[from] crate::server::StartError),
    /// A simulator failed to start.
    #[error("simulator: {0}")]
    Sim(#[from] crate::sim::SimError),
    /// Files or sockets.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The node list is malformed.
    #[error("{0}")]
    Nodes(String),
}

/// What a fleet is made of.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Server configuration (its `listen` is where the server binds; port 0 picks one).
    pub server: Config,
    /// Engines per model alias (`small=2,medium=1,large=1`).
    pub nodes: Vec<(String, u32)>,
    /// Speed-up of every simulated engine.
    pub time_scale: f64,
    /// Simulator settings applied to every engine (model and profile are set per node).
    pub sim: SimConfig,
    /// Agents' first reconnect delay (1 s in production; tests shorten it).
    pub agent_backoff_min: Duration,
    /// Agents' heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Credits given to the `demo` team, microcredits.
    pub credits: i64,
    /// The node protocol version the agents speak (older ones in upgrade tests).
    pub agent_protocol: u32,
    /// Replicas of the server (more than one needs PostgreSQL and Redis); nodes dial them in
    /// turn, the first node the first replica.
    pub replicas: usize,
    /// Replicas (by index) that reach Redis at another URL than `server.redis_url` (a drill
    /// puts one behind a TCP proxy to cut it off).
    pub redis_urls: BTreeMap<usize, String>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            server: Config::default(),
            nodes: vec![
                ("small".into(), 2),
                ("medium".into(), 1),
                ("large".into(), 1),
            ],
            time_scale: 1.0,
            sim: SimConfig::default(),
            agent_backoff_min: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(5),
            credits: 1_000_000_000_000,
            agent_protocol: switchyard_actors::protocol::PROTOCOL_VERSION,
            replicas: 1,
            redis_urls: BTreeMap::new(),
        }
    }
}

/// Parses `small=2,medium=1`.
pub fn parse_nodes(spec: &str) -> Result<Vec<(String, u32)>, FleetError> {
    spec.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|part| {
            let (alias, count) = part
                .split_once('=')
                .ok_or_else(|| FleetError::Nodes(format!("`{part}`: expected alias=count")))?;
            let count = count
                .trim()
                .parse()
                .map_err(|_| FleetError::Nodes(format!("`{part}`: bad count")))?;
            Ok((alias.trim().to_owned(), count))
        })
        .collect()
}

/// The GPU the simulator's profiles model.
const SIM_GPU_NAME: &str = "NVIDIA L40S";

/// The simulator profile that fits a model's size.
fn profile_for(model: &str) -> Profile {
    if model.contains("70b") {
        Profile::B70
    } else if model.contains("32b") {
        Profile::B32
    } else {
        Profile::B8
    }
}

/// One simulated node: its engine and its agent.
#[derive(Debug)]
pub struct SimNode {
    /// Node id (`small-1`).
    pub node_id: String,
    /// The model it serves.
    pub model: String,
    /// Its engine.
    pub sim: SimServer,
    /// Its agent's counters.
    pub agent_stats: Arc<AgentStats>,
    /// The agent's injected faults (for drills and tests).
    pub faults: node_agent::AgentFaults,
    agent_stop: CancellationToken,
    agent_drain: CancellationToken,
    agent_task: tokio::task::JoinHandle<()>,
}

impl SimNode {
    /// Drains the node as SIGTERM does `switchyard node`: the agent tells the server, takes
    /// no new work, lets what runs finish (within its drain timeout) and stops.
    pub fn drain_agent(&self) {
        self.agent_drain.cancel();
    }

    /// Whether the agent has stopped (after a drain, a stop, or an unusable configuration).
    pub fn agent_stopped(&self) -> bool {
        self.agent_task.is_finished()
    }

    /// Stops the agent (the engine keeps running).
    pub async fn stop_agent(&mut self) {
        self.agent_stop.cancel();
        if !self.agent_task.is_finished() {
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.agent_task).await;
        }
    }
}

/// A running fleet.
#[derive(Debug)]
pub struct Fleet {
    /// The first server replica.
    pub server: Server,
    /// The other replicas (`FleetConfig::replicas`), sharing its storage and Redis.
    pub peers: Vec<Server>,
    /// The storage behind it.
    pub store: Arc<dyn Store>,
    /// The simulated nodes.
    pub nodes: Vec<SimNode>,
    /// A key of the `demo` team.
    pub api_key: String,
    /// The `demo` team's id.
    pub team_id: i64,
    /// The bootstrap admin token.
    pub admin_token: String,
}

impl Fleet {
    /// Starts storage, the server and every node, and waits until the nodes registered.
    pub async fn start(mut config: FleetConfig, database_url: &str) -> Result<Self, FleetError> {
        let store = crate::store::connect_store(database_url).await?;
        store.migrate().await?;
        let team = match store.team_by_name("demo").await? {
            Some(team) => team,
            None => {
                let team = store.create_team("demo").await?;
                store
                    .add_credits(team.id, config.credits, "demo credits")
                    .await?;
                team
            }
        };
        let api_key = new_secret(API_KEY_PREFIX)?;
        store
            .create_api_key(NewApiKey {
                team_id: team.id,
                hash: hash_secret(&api_key),
                prefix: display_prefix(&api_key),
                ..NewApiKey::default()
            })
            .await?;
        let admin_token = match &config.server.admin_token {
            Some(t) => t.clone(),
            None => new_secret("adm-")?,
        };
        config.server.admin_token = Some(admin_token.clone());
        let listener = TcpListener::bind(config.server.listen).await?;
        let redis_of = |i: usize| {
            config
                .redis_urls
                .get(&i)
                .map(String::as_str)
                .or(config.server.redis_url.as_deref())
        };
        let coordinator =
            crate::coord::connect_coordinator(redis_of(0), &config.server.redis_prefix).await?;
        let server =
            Server::start(config.server.clone(), store.clone(), coordinator, listener).await?;
        let mut peers = Vec::new();
        for i in 1..config.replicas {
            // Each replica with its own pools, as separate processes would have, on the
            // ports after the first one's (any free port when that one took any).
            let mut peer = config.server.clone();
            let port = match config.server.listen.port() {
                0 => 0,
                p => p.saturating_add(u16::try_from(i).unwrap_or(u16::MAX)),
            };
            peer.listen.set_port(port);
            let listener = TcpListener::bind(peer.listen).await?;
            let store = crate::store::connect_store(database_url).await?;
            let coordinator =
                crate::coord::connect_coordinator(redis_of(i), &config.server.redis_prefix).await?;
            peers.push(Server::start(peer, store, coordinator, listener).await?);
        }
        let mut fleet = Fleet {
            server,
            peers,
            store,
            nodes: Vec::new(),
            api_key,
            team_id: team.id,
            admin_token,
        };
        for (alias, count) in config.nodes.clone() {
            let model = config
                .server
                .resolve_model(&alias)
                .ok_or_else(|| FleetError::Nodes(format!("unknown model `{alias}`")))?
                .name
                .clone();
            for i in 1..=count {
                let replica = fleet.nodes.len() % fleet.replicas().len();
                let node = fleet
                    .add_node_to(&config, &format!("{alias}-{i}"), &model, replica)
                    .await?;
                fleet.nodes.push(node);
            }
        }
        fleet.wait_registered(Duration::from_secs(30)).await;
        Ok(fleet)
    }

    /// Every replica, the first one first.
    pub fn replicas(&self) -> Vec<&Server> {
        std::iter::once(&self.server).chain(&self.peers).collect()
    }

    /// Starts one more simulated node serving `model`, dialing the first replica.
    pub async fn add_node(
        &self,
        config: &FleetConfig,
        node_id: &str,
        model: &str,
    ) -> Result<SimNode, FleetError> {
        self.add_node_to(config, node_id, model, 0).await
    }

    /// Starts one more simulated node serving `model`, dialing replica `replica`.
    pub async fn add_node_to(
        &self,
        config: &FleetConfig,
        node_id: &str,
        model: &str,
        replica: usize,
    ) -> Result<SimNode, FleetError> {
        // Its replica first, then the others: the agent fails over to them in turn.
        let replicas = self.replicas();
        let servers: Vec<String> = (0..replicas.len())
            .map(|i| replicas[(replica + i) % replicas.len()].base_url())
            .collect();
        self.add_node_at(config, node_id, model, &servers).await
    }

    /// Starts one more simulated node serving `model`, dialing `servers` in turn (base URLs;
    /// a drill puts a replica outside this fleet first).
    pub async fn add_node_at(
        &self,
        config: &FleetConfig,
        node_id: &str,
        model: &str,
        servers: &[String],
    ) -> Result<SimNode, FleetError> {
        let server = servers.join(",");
        // The configured embedding model runs beside the first chat model, as a small
        // embedding model shares a GPU node in production.
        let models = &config.server.models;
        let first_chat = models
            .iter()
            .find(|m| !m.embedding)
            .map(|m| m.name.as_str());
        let embedding_model = config.sim.embedding_model.clone().or_else(|| {
            (first_chat == Some(model))
                .then(|| models.iter().find(|m| m.embedding).map(|m| m.name.clone()))
                .flatten()
        });
        let profile = profile_for(model);
        let sim_config = SimConfig {
            model: model.to_owned(),
            profile,
            time_scale: config.time_scale,
            embedding_model,
            ..config.sim.clone()
        };
        let sim = SimServer::start(sim_config).await?;
        let token = new_secret(NODE_TOKEN_PREFIX)?;
        let _ = self.store.revoke_node_token(node_id).await;
        self.store
            .create_node(node_id, "onprem", &hash_secret(&token))
            .await?;
        let mut agent = AgentConfig::new(server, node_id, token, sim.base_url());
        agent.location = Location::Onprem;
        agent.backoff_min = config.agent_backoff_min;
        agent.heartbeat_interval = config.heartbeat_interval;
        agent.protocol = config.agent_protocol;
        // The GPUs the simulated replica stands for (one L40S for 8B, two for 32B, four for
        // 70B), so the cost report counts their hours.
        let hardware = profile.spec();
        agent.gpus = node_agent::gpus(
            u32::try_from(hardware.gpus).unwrap_or(1),
            SIM_GPU_NAME,
            (hardware.gpu_memory_gib * 1024.0) as u64,
        );
        let faults = agent.faults.clone();
        let drain = agent.drain.clone();
        let stats = Arc::new(AgentStats::default());
        let stop = CancellationToken::new();
        let task = {
            let (stop, stats) = (stop.clone(), stats.clone());
            tokio::spawn(async move {
                if let Err(e) = node_agent::run_with_stats(agent, stop, stats).await {
                    tracing::error!(error = %e, "node agent stopped");
                }
            })
        };
        Ok(SimNode {
            node_id: node_id.to_owned(),
            model: model.to_owned(),
            sim,
            agent_stats: stats,
            faults,
            agent_stop: stop,
            agent_drain: drain,
            agent_task: task,
        })
    }

    /// Waits until every node's agent has registered (or `limit` passes).
    pub async fn wait_registered(&self, limit: Duration) -> bool {
        let start = tokio::time::Instant::now();
        while start.elapsed() < limit {
            let connected: usize = self
                .replicas()
                .iter()
                .map(|r| r.state().view.local_count())
                .sum();
            if connected >= self.nodes.len() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// `http://ADDR/v1`.
    pub fn openai_base_url(&self) -> String {
        format!("{}/v1", self.server.base_url())
    }

    /// Stops the server (draining in-flight requests for `grace`), the agents and engines.
    pub async fn shutdown(mut self, grace: Duration) {
        for peer in std::mem::take(&mut self.peers) {
            peer.shutdown(grace).await;
        }
        self.server.shutdown(grace).await;
        for node in &mut self.nodes {
            node.stop_agent().await;
        }
        for node in self.nodes {
            node.sim.shutdown().await;
        }
    }
}

/// The demo's files: `.switchyard/demo.env` and the SQLite database next to it.
pub fn write_env_file(dir: &Path, fleet: &Fleet) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("demo.env");
    let contents = format!(
        "OPENAI_BASE_URL={}\nOPENAI_API_KEY={}\nSWITCHYARD_ADMIN_TOKEN={}\n",
        fleet.openai_base_url(),
        fleet.api_key,
        fleet.admin_token
    );
    std::fs::write(&path, contents)?;
    Ok(path)
}

/// What `switchyard demo` prints once the fleet is up.
pub fn banner(fleet: &Fleet, env_file: &Path) -> String {
    let base = fleet.openai_base_url();
    let mut by_model: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &fleet.nodes {
        *by_model.entry(n.model.as_str()).or_default() += 1;
    }
    let nodes: Vec<String> = by_model.iter().map(|(m, n)| format!("{m} ×{n}")).collect();
    format!(
        "Switchyard demo is up: {nodes}\n\nWritten to {env}:\n  OPENAI_BASE_URL={base}\n  OPENAI_API_KEY={key}\n  SWITCHYARD_ADMIN_TOKEN={admin}\n\n\
Try it:\n  curl -N {base}/chat/completions -H \"Authorization: Bearer {key}\" -H 'Content-Type: application/json' \\\n    \
-d '{{\"model\":\"small\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":32,\"stream\":true}}'\n\n  \
set -a; . {env}; set +a\n  python3 -c 'import openai; c=openai.OpenAI(); print(c.chat.completions.create(model=\"small\", messages=[{{\"role\":\"user\",\"content\":\"Hello\"}}], max_tokens=32).choices[0].message.content)'\n\n\
Console: {server}/console (sign in with SWITCHYARD_ADMIN_TOKEN)\n\n{cluster}Ctrl-C stops the demo.",
        server = fleet.server.base_url(),
        cluster = cluster_lines(fleet),
        nodes = nodes.join(", "),
        env = env_file.display(),
        key = fleet.api_key,
        admin = fleet.admin_token,
    )
}

/// With several replicas: where each is, and how to watch who holds which node.
fn cluster_lines(fleet: &Fleet) -> String {
    let replicas = fleet.replicas();
    if replicas.len() < 2 {
        return String::new();
    }
    let mut out = String::from("Replicas (every one routes to every node):\n");
    for r in &replicas {
        out.push_str(&format!("  {}  {}\n", r.state().replica_id, r.base_url()));
    }
    out.push_str(&format!(
        "Who holds each node:\n  curl -s -H \"Authorization: Bearer {admin}\" {base}/admin/nodes | jq '.data[] | {{node_id, owner_replica, in_flight}}'\n\n",
        admin = fleet.admin_token,
        base = fleet.server.base_url(),
    ));
    out
}

/// The PostgreSQL database of `demo --replicas N`: `DATABASE_URL`, or `switchyard_demo` on
/// the local server (created when missing).
pub async fn cluster_database_url() -> Result<String, FleetError> {
    if let Ok(url) = std::env::var(crate::env_names::DATABASE_URL) {
        return Ok(url);
    }
    let server = "postgres://postgres@127.0.0.1:5432";
    let admin = sqlx::PgPool::connect(&format!("{server}/postgres"))
        .await
        .map_err(|e| {
            FleetError::Nodes(format!(
                "no DATABASE_URL and no PostgreSQL at {server} ({e}); set DATABASE_URL"
            ))
        })?;
    let exists: Option<i32> =
        sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = 'switchyard_demo'")
            .fetch_optional(&admin)
            .await
            .map_err(|e| FleetError::Nodes(format!("reading PostgreSQL's databases: {e}")))?;
    if exists.is_none() {
        sqlx::query("CREATE DATABASE switchyard_demo")
            .execute(&admin)
            .await
            .map_err(|e| FleetError::Nodes(format!("creating switchyard_demo: {e}")))?;
    }
    admin.close().await;
    Ok(format!("{server}/switchyard_demo"))
}

/// Addresses the demo binds.
pub fn demo_database_url(dir: &Path) -> String {
    format!("sqlite://{}?mode=rwc", dir.join("switchyard.db").display())
}

/// Parses `--listen`.
pub fn listen_addr(s: &str) -> Result<SocketAddr, FleetError> {
    s.parse()
        .map_err(|_| FleetError::Nodes(format!("bad address {s}")))
}
