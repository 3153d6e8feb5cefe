//! A node agent and its engine as one simulated host, speaking the node protocol's frames
//! (length-prefixed JSON here instead of WebSocket text frames) to a replica over the
//! simulated network. It behaves as `switchyard node` does where the control plane can
//! tell: it registers (trying the replicas in turn, with jittered backoff), accepts each
//! assignment, streams one token per inter-token interval, ends an attempt on `cancel`, on
//! a silent server past the attempt's lease and on a lost connection (its `done` says
//! `abort` with what was produced), keeps every `done` until it is acked and resends them
//! after reconnecting and, while connected, once they waited too long for their ack, and
//! heartbeats its load, pinging the server, and ends a connection on which nothing (pongs
//! included) came for three heartbeats. A crash of the host is the node dying with
//! its engine: its work and unacked `done`s are gone.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use switchyard_actors::output::WireDelta;
use switchyard_actors::protocol::{Held, Location, NodeFrame, ServerFrame};
use tokio::sync::mpsc;
use tokio::time::Instant;
use turmoil::net::TcpStream;

use super::net::{Control, read_frame, write_frame};
use super::world::World;

/// The port replicas take node connections on.
pub const PORT: u16 = 9000;
/// One token per this.
const INTER_TOKEN: Duration = Duration::from_millis(40);
/// Load reports.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// An unacked `done` goes again on the same connection after this (the agent's
/// `RESEND_AFTER`, shortened with the simulation's other deadlines).
const RESEND_AFTER: Duration = Duration::from_secs(10);
/// Nothing from the server (pongs included) for this long ends the connection, as the
/// agent's three heartbeat intervals do: a partition can leave TCP half-open.
const IDLE: Duration = Duration::from_secs(3);

/// One node of the simulation.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    /// Its id.
    pub node_id: String,
    /// The model it serves.
    pub model: String,
    /// The replica hosts it may dial, in its order of preference.
    pub replicas: Vec<String>,
    /// Seeds its choices (output lengths, backoff).
    pub seed: u64,
    /// Sends unacked `done`s again while connected (off: as agents did before, to show the
    /// simulation catches what that lost).
    pub resend: bool,
}

struct Work {
    target: u64,
    produced: u64,
    lease: Option<Duration>,
}

/// The host's software.
pub async fn run(spec: AgentSpec, world: Arc<World>) -> turmoil::Result {
    // A restarted host is a new engine: what the old one ran is gone.
    world.node_died(&spec.node_id);
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut unacked: BTreeMap<(String, u64), NodeFrame> = BTreeMap::new();
    let mut next = 0usize;
    let mut pause = Duration::from_millis(100);
    loop {
        let replica = spec.replicas[next % spec.replicas.len()].clone();
        next += 1;
        let registered = session(&spec, &world, &replica, &mut rng, &mut unacked).await;
        if std::env::var("DST_NODE").is_ok_and(|d| d == spec.node_id) {
            eprintln!(
                "{:?} {} SESSION with {replica} ended (registered {registered})",
                turmoil::elapsed(),
                spec.node_id
            );
        }
        if registered {
            pause = Duration::from_millis(100);
        } else {
            pause = (pause * 2).min(Duration::from_secs(2));
        }
        let wait = rng.random_range(0..=u64::try_from(pause.as_millis()).unwrap_or(100));
        tokio::time::sleep(Duration::from_millis(wait)).await;
    }
}

fn done(id: &str, attempt: u64, w: &Work, reason: &str) -> NodeFrame {
    NodeFrame::Done {
        request_id: id.to_owned(),
        attempt,
        prompt_tokens: 10,
        completion_tokens: w.produced,
        finish_reason: reason.to_owned(),
        cached_tokens: None,
        // One token a chunk.
        chunks: Some(w.produced),
    }
}

/// One connection: true once it registered.
async fn session(
    spec: &AgentSpec,
    world: &World,
    replica: &str,
    rng: &mut ChaCha8Rng,
    unacked: &mut BTreeMap<(String, u64), NodeFrame>,
) -> bool {
    let Ok(Ok(stream)) =
        tokio::time::timeout(Duration::from_secs(2), TcpStream::connect((replica, PORT))).await
    else {
        return false;
    };
    let (mut read, mut write) = stream.into_split();
    let register = NodeFrame::Register {
        node_id: spec.node_id.clone(),
        token: "dst".into(),
        gpus: Vec::new(),
        models: vec![spec.model.clone()],
        version: "dst".into(),
        location: Location::Onprem,
        protocol: 1,
    };
    if write_frame(&mut write, &register).await.is_err() {
        return false;
    }
    match tokio::time::timeout(Duration::from_secs(5), read_frame::<ServerFrame>(&mut read)).await {
        Ok(Ok(ServerFrame::Registered { .. })) => {}
        _ => return false,
    }
    let (frames_tx, mut frames) = mpsc::unbounded_channel();
    // A pong is `None`: it only says the server is there.
    let reader = tokio::spawn(async move {
        while let Ok(value) = read_frame::<serde_json::Value>(&mut read).await {
            let frame = if Control::Pong.is(&value) {
                None
            } else {
                match serde_json::from_value::<ServerFrame>(value) {
                    Ok(frame) => Some(frame),
                    Err(_) => continue,
                }
            };
            if frames_tx.send(frame).is_err() {
                return;
            }
        }
    });
    let mut out: Vec<NodeFrame> = unacked.values().cloned().collect();
    let mut work: BTreeMap<(String, u64), Work> = BTreeMap::new();
    let mut last_heard = Instant::now();
    let mut tokens = tokio::time::interval(INTER_TOKEN);
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    let mut resend = tokio::time::interval_at(Instant::now() + RESEND_AFTER, RESEND_AFTER);
    let mut ping = false;
    loop {
        // A write blocks once the peer stops taking bytes (a partition loses segments for
        // good): past the idle deadline the connection is dead, as the agent's writer task
        // stuck behind a full channel is.
        let ping_now = std::mem::take(&mut ping);
        let writes = async {
            if ping_now {
                write_frame(&mut write, &Control::Ping).await?;
            }
            for frame in out.drain(..) {
                write_frame(&mut write, &frame).await?;
            }
            Ok::<(), std::io::Error>(())
        };
        if !matches!(
            tokio::time::timeout_at(last_heard + IDLE, writes).await,
            Ok(Ok(()))
        ) {
            break;
        }
        tokio::select! {
            frame = frames.recv() => {
                let Some(frame) = frame else { break };
                last_heard = Instant::now();
                let Some(frame) = frame else { continue };
                match frame {
                    ServerFrame::Assign { request_id, attempt, body, lease_ms, .. } => {
                        let ceiling = body.get("max_tokens").and_then(serde_json::Value::as_u64).unwrap_or(16);
                        let target = rng.random_range(1..=ceiling.max(1));
                        world.start_work(&spec.node_id, &request_id, attempt);
                        if std::env::var("DST_NODE").is_ok_and(|d| d == spec.node_id) {
                            eprintln!("{:?} {} START {request_id} #{attempt} lease {lease_ms:?} running {}", turmoil::elapsed(), spec.node_id, work.len() + 1);
                        }
                        if std::env::var("DST_DEBUG").is_ok_and(|d| d == request_id) {
                            eprintln!("{:?} {} assign {request_id} #{attempt} target {target}", turmoil::elapsed(), spec.node_id);
                        }
                        work.insert((request_id.clone(), attempt), Work {
                            target,
                            produced: 0,
                            lease: lease_ms.map(Duration::from_millis),
                        });
                        out.push(NodeFrame::Accepted { request_id, attempt });
                    }
                    ServerFrame::Cancel { request_id, attempt } => {
                        let key = (request_id, attempt);
                        if let Some(w) = work.remove(&key) {
                            if std::env::var("DST_NODE").is_ok_and(|d| d == spec.node_id) {
                                eprintln!("{:?} {} END {} #{}", turmoil::elapsed(), spec.node_id, key.0, key.1);
                            }
                            world.end_work(&spec.node_id);
                            let d = done(&key.0, key.1, &w, "abort");
                            unacked.insert(key, d.clone());
                            out.push(d);
                        }
                    }
                    ServerFrame::Ack { request_id, attempt } => {
                        unacked.remove(&(request_id, attempt));
                    }
                    _ => {}
                }
            }
            _ = tokens.tick() => {
                let now = Instant::now();
                if now.duration_since(last_heard) > IDLE {
                    break;
                }
                let keys: Vec<(String, u64)> = work.keys().cloned().collect();
                for key in keys {
                    let Some(w) = work.get_mut(&key) else { continue };
                    // The server went silent past the attempt's lease: it may have fenced
                    // the attempt and dispatched another, so this one stops.
                    let expired = w.lease.is_some_and(|l| now.duration_since(last_heard) > l);
                    if !expired {
                        w.produced += 1;
                        if std::env::var("DST_DEBUG").is_ok_and(|d| d == key.0) {
                            eprintln!("{:?} {} chunk {} #{} seq {}", turmoil::elapsed(), spec.node_id, key.0, key.1, w.produced - 1);
                        }
                        world.produce(&key.0, key.1);
                        out.push(NodeFrame::Chunk {
                            request_id: key.0.clone(),
                            attempt: key.1,
                            seq: w.produced - 1,
                            delta: WireDelta::Text("tok ".into()),
                            logprobs: None,
                        });
                    }
                    if expired || w.produced >= w.target {
                        let reason = if expired { "abort" } else { "stop" };
                        if let Some(w) = work.remove(&key) {
                            if std::env::var("DST_NODE").is_ok_and(|d| d == spec.node_id) {
                                eprintln!("{:?} {} END {} #{}", turmoil::elapsed(), spec.node_id, key.0, key.1);
                            }
                            world.end_work(&spec.node_id);
                            let d = done(&key.0, key.1, &w, reason);
                            unacked.insert(key, d.clone());
                            out.push(d);
                        }
                    }
                }
            }
            _ = resend.tick() => {
                if spec.resend {
                    out.extend(unacked.values().cloned());
                }
            }
            _ = heartbeat.tick() => {
                ping = true;
                out.push(NodeFrame::Heartbeat {
                    queue_depth: 0,
                    running: work.len() as u64,
                    kv_cache_usage: 0.1,
                    gpu_util: 0.5,
                    models: vec![spec.model.clone()],
                    engine_counters: None,
                    // Taken when its `assign` is read, dropped as its `done` is queued.
                    assignments: Some(work.keys().map(|(request_id, attempt)| Held {
                        request_id: request_id.clone(),
                        attempt: *attempt,
                    }).collect()),
                });
            }
        }
    }
    reader.abort();
    // A lost connection ends every assignment: their `done`s wait for the next one.
    for (key, w) in std::mem::take(&mut work) {
        if std::env::var("DST_NODE").is_ok_and(|d| d == spec.node_id) {
            eprintln!(
                "{:?} {} LOST {} #{}",
                turmoil::elapsed(),
                spec.node_id,
                key.0,
                key.1
            );
        }
        world.end_work(&spec.node_id);
        let d = done(&key.0, key.1, &w, "abort");
        unacked.insert(key, d);
    }
    true
}
