//! `GET /v1/nodes/connect`: a GPU node dials in (it may sit behind NAT) and the connection
//! becomes a node actor, started under the node supervisor. The first frame must be `register` within 5 s with the node's
//! per-node token (stored hashed, compared in constant time); registrations are rate limited
//! so that a reconnect storm after a deploy cannot overwhelm the replica.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::{IntoResponse, Response};
use switchyard_actors::error::ErrorCode;

use super::error::ApiError;
use futures::{SinkExt, StreamExt};
use subtle::ConstantTimeEq;
use switchyard_actors::metric_names::NODE_REPORT_ANOMALIES_TOTAL;
use switchyard_actors::node::{NodeHandle, Violation};
use switchyard_actors::protocol::{
    Gpu, Malformed, NodeFrame, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, ServerFrame,
    decode_node_frame,
};
use switchyard_actors::tasks::TaskGuard;
use tokio::sync::mpsc;

use crate::server::AppState;
use crate::store::hash_secret;

/// Time a new connection has to send `register`.
const REGISTER_WITHIN: Duration = Duration::from_secs(5);
/// Largest frame a node may send.
const MAX_FRAME_BYTES: usize = 1024 * 1024;
/// Frames queued for one node's socket before it counts as stuck: at least this many, and
/// [`FRAMES_PER_SLOT`] for every request it may run at once (an assign, its cancel and its
/// ack), so a burst of work up to the node's capacity never looks like a stuck node (the
/// benchmark's 10,000 streams on one node overflowed a fixed 4,096 and lost every stream).
const OUTBOUND_FRAMES: usize = 4096;
const FRAMES_PER_SLOT: usize = 4;

pub async fn connect(
    State(state): State<Arc<AppState>>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => ws
            .max_message_size(MAX_FRAME_BYTES)
            .on_upgrade(move |socket| serve_node(state, socket)),
        // Not a WebSocket handshake: the error envelope, with the status axum chose (400,
        // 426 without the upgrade headers).
        Err(rejection) => ApiError::new(
            ErrorCode::InvalidRequest,
            "This route is the node control plane: open a WebSocket (GET with Upgrade: websocket).",
        )
        .with_status(rejection.status())
        .into_response(),
    }
}

/// What a `register` frame carries, once verified.
struct Registered {
    node_id: String,
    models: Vec<String>,
    /// The version spoken on this connection: the agent's, or ours when it is newer.
    protocol: u32,
    /// GPUs it registered with.
    gpus: u32,
}

async fn serve_node(state: Arc<AppState>, mut socket: WebSocket) {
    let _guard = TaskGuard::new("node_connection");
    let registered = match register(&state, &mut socket).await {
        Ok(r) => r,
        Err((reason, retry_after_ms)) => {
            tracing::warn!(%reason, "node registration refused");
            let frame = ServerFrame::Rejected {
                reason,
                retry_after_ms,
            };
            let _ = send(&mut socket, &frame).await;
            let _ = socket.close().await;
            return;
        }
    };
    let (outbound, mut frames) = mpsc::channel(outbound_bound(&state, &registered.models));
    let accepted = ServerFrame::Registered {
        protocol: Some(registered.protocol),
    };
    if send(&mut socket, &accepted).await.is_err() {
        return;
    }
    let node = match state
        .view
        .connected(
            &registered.node_id,
            &registered.models,
            registered.protocol,
            registered.gpus,
            outbound,
        )
        .await
    {
        Ok(node) => node,
        Err(e) => {
            tracing::error!(error = %e, "could not start the node actor");
            return;
        }
    };
    tracing::info!(node_id = %registered.node_id, models = ?registered.models, "node registered");
    relay(socket, &node, &mut frames).await;
    state.view.disconnected(&node);
}

/// How many frames may wait for `models`' node's socket.
fn outbound_bound(state: &AppState, models: &[String]) -> usize {
    let slots: usize = state
        .config
        .models
        .iter()
        .filter(|m| models.contains(&m.name))
        .map(|m| m.node_concurrency as usize)
        .sum();
    slots
        .saturating_mul(FRAMES_PER_SLOT)
        .clamp(OUTBOUND_FRAMES, tokio::sync::Semaphore::MAX_PERMITS)
}

/// Pumps frames both ways until either side ends. A replica shutting down keeps node sockets
/// open while its in-flight streams drain; it closes them by stopping the node actors. A node
/// actor that crashes drops its outbound sender with its state: `frames` ends, the socket is
/// closed, and the agent reconnects and resends its `done`s (its supervisor has already told
/// the queues and the generations).
async fn relay(socket: WebSocket, node: &NodeHandle, frames: &mut mpsc::Receiver<ServerFrame>) {
    let (mut sink, mut stream) = socket.split();
    loop {
        tokio::select! {
            out = frames.recv() => match out {
                // Flushed once nothing more is queued: a burst goes out in few writes.
                Some(frame) => {
                    let Ok(text) = serde_json::to_string(&frame) else { continue };
                    if sink.feed(Message::Text(text.into())).await.is_err() {
                        return;
                    }
                    if frames.is_empty() && sink.flush().await.is_err() {
                        return;
                    }
                }
                // The actor stopped (shutdown, a revoked token, too many violations, a crash): say so,
                // so the agent sees a closed connection rather than a reset one.
                None => {
                    let _ = sink.send(Message::Close(None)).await;
                    return;
                }
            },
            incoming = stream.next() => match incoming {
                Some(Ok(Message::Text(text))) => match decode_node_frame(&text) {
                    Ok(frame) => {
                        if !node.deliver(frame) {
                            return;
                        }
                    }
                    // Never serde's message: it can quote the frame, which may hold output.
                    Err(Malformed { kind }) => {
                        tracing::debug!(node_id = node.node_id(), kind = kind.as_deref().unwrap_or(""), bytes = text.len(), "unreadable frame from node");
                        node.violation(Violation::MalformedFrame, None);
                    }
                },
                // The protocol is JSON text frames only.
                Some(Ok(Message::Binary(_))) => node.violation(Violation::MalformedFrame, None),
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            },
        }
    }
}

/// Reads and checks the `register` frame; the error carries the reason and a retry hint.
async fn register(
    state: &AppState,
    socket: &mut WebSocket,
) -> Result<Registered, (String, Option<u64>)> {
    let first = tokio::time::timeout(REGISTER_WITHIN, socket.recv())
        .await
        .map_err(|_| ("no register frame within 5 s".to_owned(), None))?;
    let Some(Ok(Message::Text(text))) = first else {
        return Err(("the first frame must be register".into(), None));
    };
    let Ok(NodeFrame::Register {
        node_id,
        token,
        gpus,
        models,
        version,
        location,
        protocol,
    }) = decode_node_frame(&text)
    else {
        return Err(("the first frame must be register".into(), None));
    };
    if protocol < OLDEST_PROTOCOL_VERSION {
        return Err((
            format!(
                "protocol {protocol} is no longer spoken; this server speaks {OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
            ),
            None,
        ));
    }
    let protocol = protocol.min(PROTOCOL_VERSION);
    if state.registrations.check().is_err() {
        let wait = 250 + u64::from(rand::random::<u16>() % 750);
        return Err(("too many registrations; retry later".into(), Some(wait)));
    }
    let record = state
        .store
        .node(&node_id)
        .await
        .map_err(|_| ("registration unavailable".to_owned(), Some(1000)))?;
    let stored = record
        .as_ref()
        .and_then(|r| r.token_hash.clone())
        .unwrap_or_default();
    let presented = hash_secret(&token);
    let valid = !stored.is_empty() && bool::from(stored.as_bytes().ct_eq(presented.as_bytes()));
    if !valid {
        return Err(("unknown node or invalid token".into(), None));
    }
    let known: Vec<String> = models
        .into_iter()
        .filter(|m| state.queues.contains_key(m))
        .collect();
    if known.is_empty() {
        return Err(("the node serves no model this server knows".into(), None));
    }
    let gpus = believed_gpus(&node_id, gpus);
    let gpu_count = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    let gpus = serde_json::to_value(&gpus).unwrap_or_default();
    let at = state.clock.wall();
    if let Err(e) = state
        .store
        .record_node_registration(&node_id, gpus, &known, &state.replica_id, at)
        .await
    {
        tracing::warn!(error = %e, "could not record the registration");
    }
    tracing::debug!(%node_id, %version, protocol, ?location, "register frame accepted");
    Ok(Registered {
        node_id,
        models: known,
        protocol,
        gpus: gpu_count,
    })
}

/// The most GPUs one node is believed to have: the largest servers hold 8 or 16, so more than
/// this is a broken or hostile registration, which must not move the cost report (GPU hours
/// are connected time × GPUs) without bound.
pub const MAX_GPUS_PER_NODE: usize = 64;

/// The GPUs a registration is believed about: its first [`MAX_GPUS_PER_NODE`]; more are
/// left out, logged and counted (`switchyard_node_report_anomalies_total{kind="gpus"}`).
fn believed_gpus(node_id: &str, mut gpus: Vec<Gpu>) -> Vec<Gpu> {
    if gpus.len() > MAX_GPUS_PER_NODE {
        tracing::warn!(%node_id, registered = gpus.len(), kept = MAX_GPUS_PER_NODE, "a node registered more GPUs than any node has; the rest are left out");
        metrics::counter!(NODE_REPORT_ANOMALIES_TOTAL, "kind" => "gpus").increment(1);
        gpus.truncate(MAX_GPUS_PER_NODE);
    }
    gpus
}

async fn send(socket: &mut WebSocket, frame: &ServerFrame) -> Result<(), axum::Error> {
    let text = serde_json::to_string(frame).unwrap_or_default();
    socket.send(Message::Text(text.into())).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_is_believed_about_64_gpus_at_most() {
        let gpu = |index| Gpu {
            index,
            name: "NVIDIA L40S".into(),
            memory_mib: 46_068,
        };
        let eight: Vec<Gpu> = (0..8).map(gpu).collect();
        assert_eq!(believed_gpus("n", eight.clone()), eight);
        let claimed: Vec<Gpu> = (0..12_000).map(gpu).collect();
        let kept = believed_gpus("n", claimed);
        assert_eq!(kept.len(), MAX_GPUS_PER_NODE);
        assert_eq!(kept.last().map(|g| g.index), Some(63));
    }
}
