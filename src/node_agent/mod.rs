//! `switchyard node`: the agent on a GPU node. It waits for the local engine (vLLM or
//! `switchyard sim`) to be ready, dials the server's node control plane over WebSocket,
//! registers the engine's models, and relays assignments to the engine and their streams back
//! (SPEC section 7). It owns the node's side of exact metering: every `done` is kept until the
//! server acks it and is resent after a reconnect.
//!
//! ```text
//! run ─ loop ─┬─ wait for engine /health 200, read /v1/models
//!             ├─ session (one connection)
//!             │   ├─ writer task      ◀── bounded channel ◀─┬─ heartbeat task (/metrics)
//!             │   ├─ reader loop: assign/cancel/ack/drain   ├─ assignment tasks (engine SSE)
//!             │   ├─ in-flight map (cancel tokens)          ├─ lease pings (reader loop)
//!             │   └─ leases (renewed by every message)      └─ resent unacked dones (first)
//!             └─ full-jitter backoff, then again
//! ```
//!
//! Decisions the server relies on are documented where they are made: no heartbeat when the
//! engine's metrics cannot be read (see `heartbeat.rs`), `load_model` is logged and ignored (vLLM
//! serves one model per process), a lost connection cancels in-flight work and keeps its
//! `done` (`finish_reason: "abort"`, usage so far) for resending, and drain waits for in-flight
//! work and then at most 60 s for the last acks. The agent's own drain ([`AgentConfig::drain`],
//! SIGTERM in `switchyard node`) also tells the server (`draining`, again after a reconnect)
//! and ends at [`AgentConfig::drain_timeout`], stopping what still runs; the token
//! ([`NodeToken`]) is read again before every connection, so a rotated file takes effect.
//!
//! Attempt leases (`lease.rs`): an `assign` carrying `lease_ms = L` runs only while the server
//! is heard from. Any inbound message on the connection that carried it (a frame, a ping, a
//! pong) renews the lease; once the agent has heard nothing for L, it stops that attempt exactly
//! as a `cancel` would (closes the engine request, keeps a `done` with `finish_reason: "abort"`
//! and the usage so far, resent until acked), because the server may already have fenced the
//! attempt and dispatched another. This holds on a half-open connection the agent has not yet
//! given up on (that takes `max(3 heartbeat intervals, 2 s)` of silence). While a leased
//! attempt runs the agent pings at least every L/3 of the shortest lease, so a healthy but
//! quiet server renews it with its automatic pongs. Assignments without `lease_ms` run until
//! they finish, are cancelled, or the connection is lost.

mod assignment;
mod backoff;
mod config;
mod engine;
mod faults;
mod heartbeat;
mod lease;
mod ledger;
mod metrics;
mod session;
mod sse;
mod stats;
mod transport;
mod writer;

#[cfg(test)]
mod test_peer;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::{AgentConfig, AgentError, CONNECT_PATH, Endpoint, NodeToken, Scheme, gpus};
pub use faults::AgentFaults;
pub use stats::AgentStats;
pub use transport::{BoxIo, Dialer, Io, TcpDialer};

use backoff::FullJitter;
use engine::EngineClient;
use ledger::Ledger;
use session::{Drain, SessionEnd, Shared};

/// Runs the agent until `shutdown` is cancelled, or the server or [`AgentConfig::drain`]
/// drains the node (all `Ok`).
/// Connection and engine failures are retried forever; `Err` means the configuration is
/// unusable (a bad URL, an unreadable `--ca-file`, out-of-range settings).
pub async fn run(cfg: AgentConfig, shutdown: CancellationToken) -> Result<(), AgentError> {
    run_with_stats(cfg, shutdown, Arc::new(AgentStats::default())).await
}

/// [`run`], updating `stats` as it goes.
pub async fn run_with_stats(
    cfg: AgentConfig,
    shutdown: CancellationToken,
    stats: Arc<AgentStats>,
) -> Result<(), AgentError> {
    let dialer = TcpDialer::new(cfg.ca_file.as_deref())?;
    run_with(cfg, shutdown, stats, Arc::new(dialer)).await
}

/// [`run_with_stats`] over a caller's transport (an in-memory or simulated network).
pub async fn run_with(
    cfg: AgentConfig,
    shutdown: CancellationToken,
    stats: Arc<AgentStats>,
    dialer: Arc<dyn Dialer>,
) -> Result<(), AgentError> {
    cfg.validate()?;
    // Several replicas without a load balancer in front: a comma-separated list, tried in
    // turn.
    let endpoints = cfg
        .server
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(Endpoint::from_server_url)
        .collect::<Result<Vec<_>, _>>()?;
    if endpoints.is_empty() {
        return Err(AgentError::ServerUrl("no server URL".into()));
    }
    if endpoints.iter().any(|e| e.scheme == Scheme::Wss) && !dialer.supports_tls() {
        return Err(AgentError::TlsUnsupported);
    }
    let engine = EngineClient::new(&cfg.engine)?;
    let span = tracing::info_span!("node_agent", node_id = %cfg.node_id);
    let shared = Shared {
        ledger: Arc::new(Ledger::new(stats.clone())),
        cfg,
        endpoints,
        next: std::sync::atomic::AtomicUsize::new(0),
        dialer,
        engine,
        stats,
    };
    agent_loop(shared, shutdown).instrument(span).await;
    Ok(())
}

async fn agent_loop(sh: Shared, shutdown: CancellationToken) {
    tracing::info!(server = %sh.endpoint().url, engine = %sh.cfg.engine, "node agent starting");
    let mut backoff = FullJitter::new(sh.cfg.backoff_min, sh.cfg.backoff_max, sh.cfg.seed);
    // Survives reconnects: a drained node only reconnects to deliver its last dones.
    let mut drain = Drain::default();
    loop {
        if drain.own() && sh.ledger.unacked_len() == 0 {
            tracing::info!("drained: nothing left to deliver; agent stopping");
            return;
        }
        let models = tokio::select! {
            models = wait_for_engine(&sh, &shutdown) => models,
            () = drain_over(&sh, &mut drain) => None,
        };
        let Some(models) = models else {
            break;
        };
        let outcome = session::serve(&sh, models, &mut drain, &shutdown).await;
        if outcome.registered {
            backoff.reset();
        }
        let delay = match outcome.end {
            SessionEnd::Shutdown => break,
            SessionEnd::Drained => {
                tracing::info!("node drained; agent stopping");
                return;
            }
            SessionEnd::Lost(reason) => {
                sh.rotate();
                let delay = backoff.next_delay();
                tracing::warn!(%reason, delay_ms = delay.as_millis() as u64, "disconnected; reconnecting");
                delay
            }
            SessionEnd::Rejected {
                reason,
                retry_after,
            } => {
                sh.stats.rejected();
                sh.rotate();
                let delay = backoff.next_delay().max(retry_after.unwrap_or_default());
                tracing::warn!(%reason, delay_ms = delay.as_millis() as u64, "registration rejected; retrying");
                delay
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = drain_over(&sh, &mut drain) => break,
            () = tokio::time::sleep(delay) => {}
        }
    }
    let unacked = sh.ledger.unacked_len();
    if unacked > 0 {
        tracing::warn!(unacked, "shutting down with dones the server never acked");
    }
    tracing::info!("node agent stopped");
}

/// Between connections: resolves once the agent's own drain has begun and has nothing left
/// to do here — no unacked done to deliver (only a connection could change that), or its
/// deadline has passed.
async fn drain_over(sh: &Shared, drain: &mut Drain) {
    sh.cfg.drain.cancelled().await;
    if !drain.own() {
        tracing::info!("draining on request while disconnected");
    }
    drain.begin(sh.cfg.drain_timeout);
    if sh.ledger.unacked_len() > 0
        && let Some(deadline) = drain.deadline
    {
        tokio::time::sleep_until(deadline).await;
        tracing::warn!(
            unacked = sh.ledger.unacked_len(),
            "drain timeout while disconnected"
        );
    }
}

/// Polls `/health` until it answers 200, then reads the served models; `None` on shutdown.
async fn wait_for_engine(sh: &Shared, shutdown: &CancellationToken) -> Option<Vec<String>> {
    let mut logged = false;
    loop {
        let probe = async {
            sh.engine.healthy().await?;
            sh.engine.models().await
        };
        let result = tokio::select! {
            () = shutdown.cancelled() => return None,
            r = probe => r,
        };
        match result {
            Ok(models) if !models.is_empty() => return Some(models),
            Ok(_) => tracing::warn!("engine is healthy but lists no models; waiting"),
            Err(e) if !logged => {
                tracing::info!(error = %e, "waiting for the engine to become ready");
                logged = true;
            }
            Err(e) => tracing::debug!(error = %e, "engine not ready yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return None,
            () = tokio::time::sleep(sh.cfg.health_poll_interval) => {}
        }
    }
}
