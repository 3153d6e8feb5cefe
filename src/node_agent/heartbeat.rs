//! Load reports while connected: every `heartbeat_interval` the engine's `/metrics` is scraped
//! into a `heartbeat` frame, and a ping goes out so the session can tell a dead server apart
//! from a quiet one.
//!
//! When the scrape fails no heartbeat is sent (only a warning is logged): stale figures would
//! keep a node with a dead engine in routing, whereas missing heartbeats let the server expire
//! the node after 15 s, which is right when the engine is gone. The socket stays up, so unacked
//! dones still flow, and heartbeats resume as soon as the engine answers again.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use switchyard_actors::protocol::{EngineCounters, Held, MAX_HEARTBEAT_ASSIGNMENTS, NodeFrame};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use super::engine::EngineClient;
use super::ledger::Key;
use super::stats::AgentStats;
use super::writer::Outgoing;

/// The assignments a session holds, as its heartbeats list them (`heartbeat.assignments`).
/// The server gives back the slot of any assignment a heartbeat leaves out once it knows the
/// agent had it (server `node::squared`), which is right only if an assignment is added
/// before anything about it is sent (the session adds it before spawning its task) and taken
/// out only after its `done` or final `error` is queued on the socket (the session removes it
/// when its task has ended, and a task queues its last frame before it ends).
#[derive(Debug, Default)]
pub(crate) struct Holding(Mutex<BTreeSet<Key>>);

impl Holding {
    /// The assignment is taken.
    pub(crate) fn hold(&self, key: Key) {
        self.keys().insert(key);
    }

    /// The assignment ended (its last frame is queued, or it never will send one).
    pub(crate) fn release(&self, key: &Key) {
        self.keys().remove(key);
    }

    /// What a heartbeat lists now; `None` past [`MAX_HEARTBEAT_ASSIGNMENTS`], never a list
    /// cut short (the server would give back the slots of running work).
    pub(crate) fn listing(&self) -> Option<Vec<Held>> {
        let keys = self.keys();
        if keys.len() > MAX_HEARTBEAT_ASSIGNMENTS {
            return None;
        }
        Some(
            keys.iter()
                .map(|(request_id, attempt)| Held {
                    request_id: request_id.clone(),
                    attempt: *attempt,
                })
                .collect(),
        )
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, BTreeSet<Key>> {
        // Nothing panics while holding it; a poisoned set is still the truth.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The protocol version from which a heartbeat carries `engine_counters`.
const COUNTERS_PROTOCOL: u32 = 2;

/// The counters a heartbeat on a connection of version `protocol` carries: none for a server
/// that speaks version 1 (it would not read them).
fn counters_for(protocol: u32, counters: Option<EngineCounters>) -> Option<EngineCounters> {
    counters.filter(|_| protocol >= COUNTERS_PROTOCOL)
}

/// Sends a heartbeat at once, then one per `interval`, until the writer is gone. Each
/// lists what `holding` holds when it is built, which is after the previous one was queued.
pub(crate) async fn heartbeat_loop(
    engine: EngineClient,
    out: mpsc::Sender<Outgoing>,
    models: Vec<String>,
    interval: Duration,
    stats: Arc<AgentStats>,
    protocol: u32,
    holding: Arc<Holding>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticker.tick().await;
        if out.send(Outgoing::Ping).await.is_err() {
            return;
        }
        // A scrape slower than the interval is as good as a failed one.
        let load = match tokio::time::timeout(interval, engine.load()).await {
            Ok(Ok(load)) => load,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "engine metrics scrape failed; no heartbeat sent");
                failing = true;
                continue;
            }
            Err(_) => {
                tracing::warn!("engine metrics scrape timed out; no heartbeat sent");
                failing = true;
                continue;
            }
        };
        if std::mem::take(&mut failing) {
            tracing::info!("engine metrics readable again; heartbeats resume");
        }
        let frame = NodeFrame::Heartbeat {
            queue_depth: load.waiting,
            running: load.running,
            kv_cache_usage: load.kv_cache_usage,
            // Unknown without DCGM; the server routes on KV use and its own in-flight count.
            gpu_util: 0.0,
            models: models.clone(),
            engine_counters: counters_for(protocol, load.counters),
            // Listed after the scrape: the later the list, the fresher.
            assignments: holding.listing(),
        };
        if out.send(Outgoing::Frame(frame)).await.is_err() {
            return;
        }
        stats.heartbeat_sent();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_go_only_to_a_server_of_version_two() {
        let c = Some(EngineCounters {
            prompt_tokens: 1,
            generation_tokens: 2,
        });
        assert_eq!(counters_for(1, c), None);
        assert_eq!(counters_for(2, c), c);
        assert_eq!(counters_for(2, None), None);
    }

    #[test]
    fn a_holding_lists_what_it_holds_or_nothing_past_the_bound() {
        let holding = Holding::default();
        assert_eq!(holding.listing(), Some(Vec::new()));
        holding.hold(("b".into(), 1));
        holding.hold(("a".into(), 2));
        holding.release(&("b".into(), 1));
        let a = Held {
            request_id: "a".into(),
            attempt: 2,
        };
        assert_eq!(holding.listing(), Some(vec![a]));
        for n in 0..MAX_HEARTBEAT_ASSIGNMENTS {
            holding.hold((format!("r{n}"), 1));
        }
        assert_eq!(holding.listing(), None, "never a list cut short");
    }
}
