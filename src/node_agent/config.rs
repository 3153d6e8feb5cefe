//! What `switchyard node` is told at start, the server endpoint it derives from that, and the
//! only errors that make [`super::run`] give up (everything else is retried).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_actors::protocol::{Gpu, Location, PROTOCOL_VERSION};
use tokio_util::sync::CancellationToken;

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
    /// The per-node secret, or the file it is read from; never logged (the `Debug` output
    /// redacts it).
    pub token: NodeToken,
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
    /// Cancel it (keep a clone) to drain the node as on SIGTERM: the agent tells the server,
    /// refuses new assignments, lets in-flight work finish for at most [`Self::drain_timeout`],
    /// delivers its dones and stops.
    pub drain: CancellationToken,
    /// How long a drain started by [`Self::drain`] waits for in-flight work and the last acks
    /// before it cancels what still runs and closes (`--drain-timeout`, 110 s: inside
    /// Kubernetes' 120 s grace period).
    pub drain_timeout: Duration,
    /// The engine runs vLLM's `--scheduling-policy priority` (`--engine-priority`): every
    /// request carries its service tier as vLLM's `priority`. Off unless set: the body then
    /// reaches the engine exactly as the server sent it.
    pub engine_priority: bool,
}

/// Where the agent's node token comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum NodeToken {
    /// Given on the command line or in `SWITCHYARD_NODE_TOKEN`.
    Value(String),
    /// Read from this file (a mounted Kubernetes Secret), trimmed, again before every
    /// connection, so a rotated Secret takes effect at the next reconnect.
    File(PathBuf),
}

impl NodeToken {
    /// The token to register with now.
    pub(crate) fn read(&self) -> Result<String, AgentError> {
        match self {
            NodeToken::Value(v) => non_empty(v.trim(), None),
            NodeToken::File(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| AgentError::TokenFile {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                non_empty(text.trim(), Some(path))
            }
        }
    }
}

fn non_empty(token: &str, file: Option<&Path>) -> Result<String, AgentError> {
    if !token.is_empty() {
        return Ok(token.to_owned());
    }
    Err(match file {
        Some(path) => AgentError::TokenFile {
            path: path.to_owned(),
            reason: "the file is empty".into(),
        },
        None => AgentError::Config("the node token is empty".into()),
    })
}

impl fmt::Debug for NodeToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeToken::Value(_) => f.write_str("Value(<redacted>)"),
            NodeToken::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

/// `count` GPUs named `name` with `memory_mib` each, indexed from 0: what `--gpus` registers
/// where no driver is queried.
pub fn gpus(count: u32, name: &str, memory_mib: u64) -> Vec<Gpu> {
    (0..count)
        .map(|index| Gpu {
            index,
            name: name.to_owned(),
            memory_mib,
        })
        .collect()
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
            token: NodeToken::Value(token.into()),
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
            drain: CancellationToken::new(),
            drain_timeout: Duration::from_secs(110),
            engine_priority: false,
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
        // Unreadable at start is a configuration error; later (a Secret being rotated) it is
        // retried like a lost connection.
        self.token.read()?;
        Ok(())
    }
}

impl fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server", &self.server)
            .field("node_id", &self.node_id)
            .field("token", &self.token)
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
            .field("drain", &self.drain.is_cancelled())
            .field("drain_timeout", &self.drain_timeout)
            .field("engine_priority", &self.engine_priority)
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
    /// The `--token-file` could not be read or holds no token (never its contents).
    #[error("node token file {}: {reason}", path.display())]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why (an I/O error or "empty").
        reason: String,
    },
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    #[test]
    fn a_token_file_is_trimmed_and_read_again_each_time() {
        let dir = std::env::temp_dir().join(format!("sy-token-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "sy-node-first\n").unwrap();
        let token = NodeToken::File(path.clone());
        assert_eq!(token.read().unwrap(), "sy-node-first");
        // A rotated Secret: the next connection registers with the new value.
        std::fs::write(&path, "  sy-node-second \r\n").unwrap();
        assert_eq!(token.read().unwrap(), "sy-node-second");
        std::fs::write(&path, "\n").unwrap();
        let empty = token.read().unwrap_err().to_string();
        assert!(empty.contains("empty"), "{empty}");
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(token.read(), Err(AgentError::TokenFile { .. })));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(NodeToken::Value(" ".into()).read().is_err());
    }

    #[test]
    fn the_token_never_shows_in_debug_output() {
        let mut cfg = AgentConfig::new("http://x", "n", "sy-node-secret", "http://e");
        assert!(!format!("{cfg:?}").contains("sy-node-secret"));
        cfg.token = NodeToken::File("/run/secrets/node-token".into());
        assert!(format!("{cfg:?}").contains("/run/secrets/node-token"));
    }

    #[test]
    fn gpus_are_indexed_from_zero() {
        let g = gpus(2, "NVIDIA L40S", 46_068);
        assert_eq!(g.len(), 2);
        assert_eq!(
            (g[1].index, g[1].name.as_str(), g[1].memory_mib),
            (1, "NVIDIA L40S", 46_068)
        );
        assert!(gpus(0, "x", 0).is_empty());
    }
}
