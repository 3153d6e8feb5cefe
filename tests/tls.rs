//! TLS on every edge, against real peers: a node agent dialing `wss://` to a `serve` that
//! terminates TLS, Redis over `rediss://`, PostgreSQL with `sslmode=verify-full`, the Python
//! `openai` SDK over `https://`, and a silent TLS client. Every certificate comes from a CA
//! made here with rcgen; nothing is skipped.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "tls/agent.rs"]
mod agent;
#[path = "tls/backends.rs"]
mod backends;
#[path = "tls/listener.rs"]
mod listener;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use switchyard::demo::{Fleet, FleetConfig};
use switchyard::node_agent::{AgentConfig, AgentStats};
use switchyard::sim::{SimConfig, SimServer};
use switchyard::store::{NODE_TOKEN_PREFIX, hash_secret, new_secret};
use tokio_util::sync::CancellationToken;

/// A throwaway directory, removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "switchyard-tls-{what}-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A test CA and one server certificate it signed, as PEM files.
#[derive(Debug)]
pub struct Pki {
    pub dir: TempDir,
    /// The CA's certificate: what a client trusts.
    pub ca: PathBuf,
    /// The server's certificate (leaf only).
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
}

impl Pki {
    /// A CA named `name` and a server certificate for `sans` (IP addresses or DNS names).
    pub fn new(name: &str, sans: &[&str]) -> Self {
        let dir = TempDir::new(name);
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let mut leaf_params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        leaf_params.distinguished_name.push(
            DnType::CommonName,
            sans.first().copied().unwrap_or("server"),
        );
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = leaf_params.signed_by(&leaf_key, &ca).unwrap();
        let write = |file: &str, pem: String| {
            let path = dir.path().join(file);
            std::fs::write(&path, pem).unwrap();
            path
        };
        Self {
            ca: write("ca.pem", ca.pem()),
            cert: write("server.pem", leaf.pem()),
            key: write("server.key", leaf_key.serialize_pem()),
            dir,
        }
    }
}

/// A reqwest client trusting the web PKI roots and `ca`.
pub fn https_client(ca: &Path) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_backend_preconfigured(switchyard::tls::client_config(Some(ca)).unwrap())
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// A server with no nodes yet that terminates TLS with `pki`'s certificate, over a fresh
/// SQLite file.
pub async fn tls_fleet(pki: &Pki, tweak: impl FnOnce(&mut FleetConfig)) -> Fleet {
    switchyard::tls::install_provider();
    let mut config = FleetConfig {
        nodes: Vec::new(),
        time_scale: 50.0,
        agent_backoff_min: Duration::from_millis(100),
        ..FleetConfig::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.listener.tls_cert = Some(pki.cert.clone());
    config.server.listener.tls_key = Some(pki.key.clone());
    tweak(&mut config);
    let db = pki.dir.path().join("switchyard.db");
    let url = format!("sqlite://{}?mode=rwc", db.display());
    let fleet = Fleet::start(config, &url).await.unwrap();
    assert!(fleet.server.base_url().starts_with("https://"));
    fleet
}

/// A simulated engine for `small` and a node id with its token, registered in the store.
pub async fn engine_and_node(fleet: &Fleet, node_id: &str) -> (SimServer, String) {
    let sim = SimServer::start(SimConfig {
        model: "llama-3.1-8b-instruct".into(),
        time_scale: 50.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let token = new_secret(NODE_TOKEN_PREFIX).unwrap();
    fleet
        .store
        .create_node(node_id, "onprem", &hash_secret(&token))
        .await
        .unwrap();
    (sim, token)
}

/// Whether `node_id` is registered with the fleet's server.
pub fn registered(fleet: &Fleet, node_id: &str) -> bool {
    fleet
        .server
        .state()
        .view
        .local_nodes()
        .iter()
        .any(|n| n.node_id() == node_id)
}

/// An in-process agent dialing the fleet; stop it with the returned token.
pub fn in_process_agent(
    fleet: &Fleet,
    node_id: &str,
    token: &str,
    sim: &SimServer,
    ca: Option<&Path>,
) -> (
    CancellationToken,
    Arc<AgentStats>,
    tokio::task::JoinHandle<Result<(), switchyard::node_agent::AgentError>>,
) {
    let mut cfg = AgentConfig::new(fleet.server.base_url(), node_id, token, sim.base_url());
    cfg.ca_file = ca.map(Path::to_owned);
    cfg.backoff_min = Duration::from_millis(100);
    cfg.backoff_max = Duration::from_millis(400);
    let stop = CancellationToken::new();
    let stats = Arc::new(AgentStats::default());
    let task = tokio::spawn(switchyard::node_agent::run_with_stats(
        cfg,
        stop.clone(),
        stats.clone(),
    ));
    (stop, stats, task)
}
