//! What `switchyard node` is told at start, the server endpoint it derives from that, and the
//! only errors that make [`super::run`] give up (everything else is retried).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use switchyard_actors::protocol::{Gpu, Location, PROTOCOL_VERSION};

use super::faults::AgentFaults;

/// Path of the node control plane on the server (SPEC section 7).
pub const CONNECT_PATH: &str = "/v1/nodes/connect";

/// Everything the agent needs; [`AgentConfig::new`] fills in the documented defaults.
#[derive(Clone)]
pub struct AgentConfig {
    /// The server's base URL, `http://host:port` or `https://host:port` (a path prefix is kept).
    pub server: String,
    /// The node's id, as issued with its token.
    pub node_id: String,
    /// The per-node secret; never logged (the `Debug` output redacts it).
    pub token: String,
    /// PEM file of CAs trusted for a `wss://` server besides the web PKI roots (`--ca-file`):
    /// an on-premises server's own CA.
    pub ca_file: Option<PathBuf>,
    /// Base URL of the local engine, e.g. `http://127.0.0.1:8000`.
    pub engine: String,
    /// On premises or cloud.
    pub location: Location,
    /// GPUs reported at registration (may be empty where no driver is queried).
    pub gpus: Vec<Gpu>,
    /// How often load is reported while connected (SPEC: 5 s).
    pub heartbeat_interval: Duration,
    /// First reconnect ceiling; doubles per failed attempt (SPEC: 1 s).
    pub backoff_min: Duration,
    /// Largest reconnect ceiling (SPEC: 60 s).
    pub backoff_max: Duration,
    /// Agent version sent at registration.
    pub version: String,
    /// The newest node protocol version the agent speaks ([`PROTOCOL_VERSION`]; lower only
    /// to act as an older agent, in compatibility tests).
    pub protocol: u32,
    /// How often `/health` is polled while the engine loads (1 s).
    pub health_poll_interval: Duration,
    /// Seed of the backoff jitter; `None` draws one from the OS (tests and simulations pass one).
    pub seed: Option<u64>,
    /// Injected faults, none armed by default; keep a clone to arm them while the agent runs
    /// (tests and drills only).
    pub faults: AgentFaults,
}

impl AgentConfig {
    /// A configuration with the defaults of SPEC section 7.
    pub fn new(
        server: impl Into<String>,
        node_id: impl Into<String>,
        token: impl Into<String>,
        engine: impl Into<String>,
    ) -> Self {
        Self {
            server: server.into(),
            node_id: node_id.into(),
            token: token.into(),
            ca_file: None,
            engine: engine.into(),
            location: Location::Onprem,
            gpus: Vec::new(),
            heartbeat_interval: Duration::from_secs(5),
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol: PROTOCOL_VERSION,
            health_poll_interval: Duration::from_secs(1),
            seed: None,
            faults: AgentFaults::default(),
        }
    }

    /// Rejects settings no retry can fix.
    pub(crate) fn validate(&self) -> Result<(), AgentError> {
        if self.node_id.is_empty() {
            return Err(AgentError::Config("node_id is empty".into()));
        }
        if self.heartbeat_interval.is_zero() || self.health_poll_interval.is_zero() {
            return Err(AgentError::Config(
                "heartbeat and health poll intervals must be positive".into(),
            ));
        }
        if self.backoff_min.is_zero() || self.backoff_min > self.backoff_max {
            return Err(AgentError::Config(
                "backoff_min must be positive and at most backoff_max".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server", &self.server)
            .field("node_id", &self.node_id)
            .field("token", &"<redacted>")
            .field("ca_file", &self.ca_file)
            .field("engine", &self.engine)
            .field("location", &self.location)
            .field("gpus", &self.gpus)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("backoff_min", &self.backoff_min)
            .field("backoff_max", &self.backoff_max)
            .field("version", &self.version)
            .field("protocol", &self.protocol)
            .field("health_poll_interval", &self.health_poll_interval)
            .field("seed", &self.seed)
            .field("faults", &self.faults)
            .finish()
    }
}

/// Why [`super::run`] gave up: only configuration no retry can fix.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// `--server` is not an `http(s)://` URL with a host.
    #[error("invalid server URL: {0}")]
    ServerUrl(String),
    /// `--engine` is not an `http://` URL with a host.
    #[error("invalid engine URL: {0}")]
    EngineUrl(String),
    /// `https://` servers need `wss://`, and the dialer given to [`super::run_with`] has no TLS.
    #[error("wss:// needs TLS support, which this dialer lacks")]
    TlsUnsupported,
    /// The `--ca-file` could not be loaded.
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// A setting is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The HTTP client for the engine could not be built.
    #[error("engine HTTP client: {0}")]
    HttpClient(String),
}

/// WebSocket scheme of the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Plain `ws://` (from `http://`).
    Ws,
    /// `wss://` (from `https://`); the dialer must wrap the TCP stream in TLS.
    Wss,
}

/// Where the agent dials: the TCP address and the WebSocket URL on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `ws` or `wss`.
    pub scheme: Scheme,
    /// Host name or IP address, without IPv6 brackets (what a TCP connect takes).
    pub host: String,
    /// TCP port (80 or 443 when the URL names none).
    pub port: u16,
    /// `ws(s)://host[:port][/prefix]/v1/nodes/connect`, for the handshake.
    pub url: String,
}

impl Endpoint {
    /// Maps the server's base URL to its control-plane endpoint (`http` → `ws`, `https` → `wss`).
    pub fn from_server_url(server: &str) -> Result<Self, AgentError> {
        let url = reqwest::Url::parse(server.trim())
            .map_err(|e| AgentError::ServerUrl(format!("{e}")))?;
        let (scheme, ws) = match url.scheme() {
            "http" => (Scheme::Ws, "ws"),
            "https" => (Scheme::Wss, "wss"),
            other => {
                return Err(AgentError::ServerUrl(format!(
                    "scheme {other:?}: expected http or https"
                )));
            }
        };
        if !url.username().is_empty() || url.password().is_some() {
            return Err(AgentError::ServerUrl(
                "credentials in the URL are not supported; use --token".into(),
            ));
        }
        let authority_host = url
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| AgentError::ServerUrl("no host".into()))?;
        // An IPv6 literal keeps its brackets in the URL but not in a TCP connect.
        let host = authority_host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(authority_host)
            .to_owned();
        let port = url
            .port_or_known_default()
            .ok_or_else(|| AgentError::ServerUrl("no port".into()))?;
        let authority = match url.port() {
            Some(p) => format!("{authority_host}:{p}"),
            None => authority_host.to_owned(),
        };
        let prefix = url.path().trim_end_matches('/');
        Ok(Self {
            scheme,
            host,
            port,
            url: format!("{ws}://{authority}{prefix}{CONNECT_PATH}"),
        })
    }
}

/// The engine's base URL without a trailing slash; only `http://` (the engine is local).
pub(crate) fn engine_base(engine: &str) -> Result<String, AgentError> {
    let url =
        reqwest::Url::parse(engine.trim()).map_err(|e| AgentError::EngineUrl(format!("{e}")))?;
    if url.scheme() != "http" {
        return Err(AgentError::EngineUrl(format!(
            "scheme {:?}: the local engine is reached over http://",
            url.scheme()
        )));
    }
    if url.host().is_none() {
        return Err(AgentError::EngineUrl("no host".into()));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}
