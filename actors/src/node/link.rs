//! How a node actor reaches its node: the socket on this replica, or, for a proxy, the
//! node's owner through the coordinator (see [`crate::cluster`]). The actor's own logic —
//! in-flight counts, trust, routing to generations — is the same either way.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ractor::{ActorProcessingErr, ActorRef};
use serde_json::value::RawValue;
use tokio::sync::mpsc;

use super::actor::{NodeState, assign, on_frame, send, violation};
use super::msg::NodeMsg;
use super::orphan::{Forward, settle_orphan};
use crate::cluster::{
    Announcement, Command, FromNode, NODES_CHANNEL, NodeNews, OnFailure, Outbox, ToNode, listen,
    node_key, to_node, to_replica,
};
use crate::generation::GenerationMsg;
use crate::metric_names::{NODE_ASSIGNMENTS_RECLAIMED_TOTAL, NODES_LOST_TOTAL, STALE_FRAMES_TOTAL};
use crate::model_queue::Word;
use crate::protocol::{NodeFrame, ServerFrame, decode_node_frame};

/// How long `node:{id}` lives without a heartbeat (three 5 s heartbeats).
const NODE_KEY_TTL: Duration = Duration::from_secs(15);

/// How a node actor reaches its node.
#[derive(Debug)]
pub enum Link {
    /// The node's socket is on this replica: frames to write to it (its writer ends when
    /// the actor stops).
    Socket(mpsc::Sender<ServerFrame>),
    /// The node's socket is on replica `owner`, connection `fence`: this actor is its proxy.
    Remote {
        /// The replica holding the socket.
        owner: String,
        /// The connection's fencing token.
        fence: u64,
    },
}

/// Where an assignment's frames go.
#[derive(Debug)]
pub(super) enum Dest {
    /// A generation on this replica.
    Local(ActorRef<GenerationMsg>),
    /// A generation on another replica, whose proxy of this node sent the assignment.
    Replica(String),
    /// Its replica stopped listening: the node was told to cancel; its `done` settles here.
    Orphaned,
}

/// What a link holds while the actor runs.
#[derive(Debug)]
pub(super) enum Transport {
    /// The owner's side.
    Socket {
        outbound: mpsc::Sender<ServerFrame>,
        /// Hears other replicas' commands for this connection.
        listener: Option<tokio::task::JoinHandle<()>>,
        /// One ordered relay per replica whose generations this node serves.
        relays: BTreeMap<String, Relay>,
        /// The last command batch heard per (replica, stream).
        heard: BTreeMap<(String, u64), u64>,
        /// `done`s relayed and not yet acked, by request id, with when: if their replica
        /// stops listening they are settled here.
        unacked: BTreeMap<String, (String, NodeFrame, tokio::time::Instant)>,
    },
    /// A proxy's side.
    Remote {
        owner: String,
        outbox: Outbox<Command>,
        /// The relay stream heard last, and its last batch.
        stream: u64,
        last_seq: u64,
    },
}

/// One replica's relay from this connection.
#[derive(Debug)]
pub(super) struct Relay {
    outbox: Outbox<Box<RawValue>>,
}

impl Transport {
    /// Sends a frame towards the node; false when the link is closed or full.
    pub(super) fn send(&self, frame: ServerFrame) -> bool {
        match self {
            Self::Socket { outbound, .. } => outbound.try_send(frame).is_ok(),
            Self::Remote { outbox, .. } => outbox.push(Command::Frame(frame)),
        }
    }
}

/// A number naming one stream of messages (a proxy's commands, a relay's frames), so a
/// receiver never takes a new stream's first messages for an old stream's repeats.
fn new_stream() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    #[allow(clippy::cast_possible_truncation)] // Mixed bits, not a count.
    let base = (nanos as u64).rotate_left(17);
    base ^ NEXT
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Opens the link: a socket hears commands from other replicas and claims the node (its
/// fencing token); a proxy opens its outbox to the owner.
pub(super) async fn open(
    args: &super::NodeArgs,
    myself: &ActorRef<NodeMsg>,
) -> Result<(u64, Transport), ActorProcessingErr> {
    match &args.link {
        Link::Socket(outbound) => {
            // The node's loss counter exists from its registration on, so the first loss is
            // an increase Prometheus can see.
            metrics::counter!(NODES_LOST_TOTAL, "node" => args.node_id.clone()).increment(0);
            metrics::counter!(NODE_ASSIGNMENTS_RECLAIMED_TOTAL, "node" => args.node_id.clone())
                .increment(0);
            // Heard again after the coordinator's pub/sub connection drops: a socket deaf to
            // the other replicas' commands makes every proxy of the node give up on it.
            let me = myself.clone();
            let channel = to_node(&args.node_id);
            let listener = listen(
                args.coordinator.clone(),
                channel,
                "node_commands",
                move |payload| match serde_json::from_slice::<ToNode>(&payload) {
                    Ok(batch) => me.cast(NodeMsg::Commands(batch)).is_ok(),
                    Err(_) => {
                        tracing::warn!(
                            bytes = payload.len(),
                            "unreadable command batch from a replica"
                        );
                        true
                    }
                },
            )
            .await?;
            let fields = owner_fields(&args.replica_id, &args.models, 0, 0);
            let fence = match args
                .coordinator
                .claim_hash(&node_key(&args.node_id), &fields, NODE_KEY_TTL)
                .await
            {
                Ok(fence) => fence,
                Err(e) => {
                    listener.abort();
                    return Err(e.into());
                }
            };
            Ok((
                fence,
                Transport::Socket {
                    outbound: outbound.clone(),
                    listener: Some(listener),
                    relays: BTreeMap::new(),
                    heard: BTreeMap::new(),
                    unacked: BTreeMap::new(),
                },
            ))
        }
        Link::Remote { owner, fence } => {
            let (from, fence) = (args.replica_id.clone(), *fence);
            let stream = new_stream();
            let me = myself.clone();
            let outbox = Outbox::spawn(
                args.coordinator.clone(),
                to_node(&args.node_id),
                OnFailure::GiveUp,
                move |seq, commands| {
                    serde_json::to_vec(&ToNode {
                        from: from.clone(),
                        fence,
                        stream,
                        seq,
                        commands,
                    })
                    .ok()
                },
                move || me.stop(Some("the node's owner no longer listens".into())),
            );
            Ok((
                fence,
                Transport::Remote {
                    owner: owner.clone(),
                    outbox,
                    stream: 0,
                    last_seq: 0,
                },
            ))
        }
    }
}

/// What `node:{id}` says besides the load: who owns it.
fn owner_fields(
    owner: &str,
    models: &[String],
    in_flight: usize,
    violations: u64,
) -> BTreeMap<String, String> {
    [
        ("owner", owner.to_owned()),
        ("models", models.join(",")),
        ("in_flight", in_flight.to_string()),
        ("violations", violations.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The owner tells every replica about its node (a proxy says nothing).
pub(super) async fn announce(state: &NodeState) {
    announce_as(state, Word::Announced).await;
}

/// [`announce`], with what the node carries taken as `word` by every replica's queues.
pub(super) async fn announce_as(state: &NodeState, word: Word) {
    if !matches!(state.transport, Transport::Socket { .. }) {
        return;
    }
    let news = NodeNews::Node(Announcement {
        node_id: state.args.node_id.clone(),
        owner: state.args.replica_id.clone(),
        fence: state.fence,
        models: state.args.models.clone(),
        protocol: state.args.protocol,
        draining: state.draining,
        queue_depth: state.load.queue_depth,
        running: state.load.running,
        kv_cache_usage: state.load.kv_cache_usage,
        in_flight: state.in_flight.len() as u64,
        carried: carried(state),
        exact: word == Word::Exact,
    });
    let Ok(payload) = serde_json::to_vec(&news) else {
        return;
    };
    if let Err(e) = state.args.coordinator.publish(NODES_CHANNEL, payload).await {
        tracing::warn!(error = %e, "could not announce a node to the cluster");
    }
}

/// What the node carries where its socket is, by model and by the replica whose generation
/// holds each assignment (an orphaned one, whose replica stopped listening, is nobody's).
pub(super) fn carried(state: &NodeState) -> BTreeMap<String, BTreeMap<String, u32>> {
    let mut carried: BTreeMap<String, BTreeMap<String, u32>> = BTreeMap::new();
    for f in state.in_flight.values() {
        let replica = match &f.dest {
            Dest::Local(_) => state.args.replica_id.as_str(),
            Dest::Replica(r) => r.as_str(),
            Dest::Orphaned => continue,
        };
        *carried
            .entry(f.model.clone())
            .or_default()
            .entry(replica.to_owned())
            .or_default() += 1;
    }
    carried
}

/// Every queue of the node hears what it carries (`ModelQueueHandle::node_carries`), as
/// `word`.
pub(super) fn tell_carried(
    state: &NodeState,
    carried: &BTreeMap<String, BTreeMap<String, u32>>,
    word: Word,
) {
    for (model, queue) in &state.args.queues {
        queue.node_carries(
            &state.args.node_id,
            carried.get(model).cloned().unwrap_or_default(),
            word,
        );
    }
}

/// The owner refreshes `node:{id}` with a heartbeat and announces it; a refresh its token no
/// longer allows means a newer connection of the node holds it elsewhere: this one ends.
pub(super) async fn heartbeat(
    state: &NodeState,
    myself: &ActorRef<NodeMsg>,
    gpu_util: f64,
    models: &[String],
) {
    if !matches!(state.transport, Transport::Socket { .. }) {
        return;
    }
    let mut fields = owner_fields(
        &state.args.replica_id,
        models,
        state.in_flight.len(),
        state.violations_total,
    );
    for (field, value) in [
        ("queue_depth", state.load.queue_depth.to_string()),
        ("running", state.load.running.to_string()),
        ("kv_cache_usage", state.load.kv_cache_usage.to_string()),
        ("gpu_util", gpu_util.to_string()),
        ("draining", state.draining.to_string()),
        ("last_heartbeat", state.args.clock.wall().to_rfc3339()),
    ] {
        fields.insert(field.to_owned(), value);
    }
    let key = node_key(&state.args.node_id);
    match state
        .args
        .coordinator
        .put_hash_fenced(&key, &fields, state.fence, NODE_KEY_TTL)
        .await
    {
        Ok(true) => announce(state).await,
        Ok(false) => {
            tracing::warn!(node_id = %state.args.node_id, "a newer connection of this node holds it; closing this one");
            myself.stop(Some("superseded by a newer connection".into()));
        }
        Err(e) => tracing::warn!(error = %e, "could not publish the node's heartbeat"),
    }
}

/// The owner gives the node up: `node:{id}` goes (unless a newer connection holds it) and
/// every replica hears it left.
pub(super) async fn close(state: &mut NodeState) {
    let Transport::Socket { listener, .. } = &mut state.transport else {
        return;
    };
    if let Some(listener) = listener.take() {
        listener.abort();
    }
    let coordinator = &state.args.coordinator;
    let node_id = &state.args.node_id;
    if let Err(e) = coordinator
        .delete_fenced(&node_key(node_id), state.fence)
        .await
    {
        tracing::warn!(error = %e, "could not remove the node's heartbeat key");
    }
    let down = NodeNews::Down {
        node_id: node_id.clone(),
        fence: state.fence,
    };
    if let Ok(payload) = serde_json::to_vec(&down)
        && let Err(e) = coordinator.publish(NODES_CHANNEL, payload).await
    {
        tracing::warn!(error = %e, "could not tell the cluster a node left");
    }
    tracing::info!(%node_id, "node disconnected");
}

/// Another replica's news about this node.
pub(super) async fn news(state: &mut NodeState, myself: &ActorRef<NodeMsg>, news: Announcement) {
    if news.fence > state.fence {
        tracing::info!(node_id = %state.args.node_id, owner = %news.owner, "the node connected again elsewhere; dropping this connection");
        myself.stop(Some("superseded by a newer connection".into()));
        return;
    }
    if news.fence < state.fence || !matches!(state.transport, Transport::Remote { .. }) {
        return;
    }
    if news.draining && !state.draining {
        state.draining = true;
        for queue in state.args.queues.values() {
            queue.node_draining(&state.args.node_id);
        }
    }
    let word = if news.exact {
        Word::Exact
    } else {
        Word::Announced
    };
    tell_carried(state, &news.carried, word);
    // The owner's heartbeat, as this proxy's own.
    let heartbeat = NodeFrame::Heartbeat {
        queue_depth: news.queue_depth,
        running: news.running,
        kv_cache_usage: news.kv_cache_usage,
        gpu_util: 0.0,
        models: news.models,
        engine_counters: None,
        // The owner squares the node's count; a proxy never does.
        assignments: None,
    };
    on_frame(state, myself, heartbeat).await;
}

/// Sends a node's frame to the replica whose generation holds the attempt; false when that
/// replica no longer listens (the frame is then handled here).
pub(super) fn relay(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    replica: String,
    frame: &NodeFrame,
) -> bool {
    let Transport::Socket {
        relays, unacked, ..
    } = &mut state.transport
    else {
        return false;
    };
    let Ok(raw) = serde_json::value::to_raw_value(frame) else {
        return false;
    };
    let relay = relays.entry(replica.clone()).or_insert_with(|| {
        let (node_id, fence, stream) = (state.args.node_id.clone(), state.fence, new_stream());
        let (me, gone) = (myself.clone(), replica.clone());
        Relay {
            // A failed publish is this replica's trouble with the coordinator, not the
            // generation's replica gone: settling its `done`s here would bill an attempt it
            // may already have fenced and retried (found by the simulation, seed 217).
            outbox: Outbox::spawn(
                state.args.coordinator.clone(),
                to_replica(&replica),
                OnFailure::Retry,
                move |seq, frames| {
                    serde_json::to_vec(&FromNode {
                        node_id: node_id.clone(),
                        fence,
                        stream,
                        seq,
                        frames,
                    })
                    .ok()
                },
                move || {
                    let _ = me.cast(NodeMsg::ReplicaGone(gone));
                },
            ),
        }
    });
    if !relay.outbox.push(raw) {
        relays.remove(&replica);
        let _ = myself.cast(NodeMsg::ReplicaGone(replica));
        return false;
    }
    if let NodeFrame::Done { request_id, .. } = frame {
        // A copy sent again keeps the first one's time: the wait for the ack is the first's.
        let now = state.args.clock.now();
        let since = match unacked.get(request_id) {
            Some((_, NodeFrame::Done { attempt: a, .. }, at)) if matches!(frame, NodeFrame::Done { attempt, .. } if attempt == a) => {
                *at
            }
            _ => now,
        };
        unacked.insert(request_id.clone(), (replica, frame.clone(), since));
    }
    true
}

/// How long a relayed `done` may wait for its replica's ack before a copy of it sent again
/// is settled here instead: past the generation's wait for its usage (20 s by default), a
/// replica that still has not acked is gone or cut off — a machine lost without closing its
/// connections still counts as listening.
const RELAYED_ACK_WITHIN: Duration = Duration::from_secs(30);

/// The replica a `done` of `attempt` was relayed to, while it has not acked it (and has
/// had less than [`RELAYED_ACK_WITHIN`] to).
pub(super) fn awaiting_ack(state: &NodeState, request_id: &str, attempt: u64) -> Option<String> {
    relayed_at(state, request_id, attempt)
        .filter(|(_, at)| {
            state.args.clock.now().saturating_duration_since(*at) < RELAYED_ACK_WITHIN
        })
        .map(|(replica, _)| replica)
}

/// Whether a `done` of `attempt` was relayed and its replica has not acked it within
/// [`RELAYED_ACK_WITHIN`]: it is settled here, never relayed again.
pub(super) fn ack_overdue(state: &NodeState, request_id: &str, attempt: u64) -> bool {
    relayed_at(state, request_id, attempt).is_some_and(|(_, at)| {
        state.args.clock.now().saturating_duration_since(at) >= RELAYED_ACK_WITHIN
    })
}

/// Where and since when a `done` of `attempt` waits for its ack.
fn relayed_at(
    state: &NodeState,
    request_id: &str,
    attempt: u64,
) -> Option<(String, tokio::time::Instant)> {
    let Transport::Socket { unacked, .. } = &state.transport else {
        return None;
    };
    unacked
        .get(request_id)
        .filter(|(_, done, _)| matches!(done, NodeFrame::Done { attempt: a, .. } if a == &attempt))
        .map(|(replica, _, at)| (replica.clone(), *at))
}

/// A replica stopped listening for this node's frames (it died, or lost Redis): the node
/// is told to cancel that replica's work, whose `done`s — and those relayed but never
/// acked — are settled here.
pub(super) async fn replica_gone(state: &mut NodeState, myself: &ActorRef<NodeMsg>, replica: &str) {
    let Transport::Socket {
        relays, unacked, ..
    } = &mut state.transport
    else {
        return;
    };
    relays.remove(replica);
    let theirs: Vec<String> = unacked
        .iter()
        .filter(|(_, (r, _, _))| r == replica)
        .map(|(id, _)| id.clone())
        .collect();
    let dones: Vec<NodeFrame> = theirs
        .iter()
        .filter_map(|id| unacked.remove(id))
        .map(|(_, done, _)| done)
        .collect();
    let mut cancels = Vec::new();
    for (request_id, f) in &mut state.in_flight {
        if matches!(&f.dest, Dest::Replica(r) if r == replica) {
            f.dest = Dest::Orphaned;
            cancels.push(ServerFrame::Cancel {
                request_id: request_id.clone(),
                attempt: f.attempt,
            });
        }
    }
    if !cancels.is_empty() || !dones.is_empty() {
        tracing::warn!(node_id = %state.args.node_id, %replica, cancelled = cancels.len(), dones = dones.len(), "a replica stopped listening; its work on this node is cancelled and settled here");
    }
    for cancel in cancels {
        send(state, myself, cancel);
    }
    for done in dones {
        settle_orphan(state, myself, done, Forward::Never).await;
    }
}

/// An assignment that never reached the node: its generation may retry at once.
pub(super) fn not_sent(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    dest: Dest,
    request_id: String,
    attempt: u64,
    why: &str,
) {
    tracing::debug!(node_id = %state.args.node_id, %request_id, attempt, why, "an assign was not sent");
    match dest {
        Dest::Local(generation) => {
            let _ = generation.cast(GenerationMsg::EngineError {
                attempt,
                code: "not_sent".into(),
                message: why.into(),
                from: None,
            });
        }
        Dest::Replica(replica) => {
            let frame = NodeFrame::Error {
                request_id,
                attempt,
                code: "not_sent".into(),
                message: why.into(),
            };
            relay(state, myself, replica, &frame);
        }
        Dest::Orphaned => {}
    }
}

/// The owner runs another replica's commands for this connection, once each and in order.
pub(super) async fn commands(state: &mut NodeState, myself: &ActorRef<NodeMsg>, batch: ToNode) {
    let Transport::Socket { heard, .. } = &mut state.transport else {
        return;
    };
    if batch.fence != state.fence {
        metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_connection").increment(1);
        return;
    }
    let last = heard.entry((batch.from.clone(), batch.stream)).or_insert(0);
    if batch.seq <= *last {
        return;
    }
    if *last != 0 && batch.seq != *last + 1 {
        tracing::warn!(node_id = %state.args.node_id, from = %batch.from, after = *last, got = batch.seq, "commands from a replica were lost");
    }
    *last = batch.seq;
    for command in batch.commands {
        match command {
            Command::Frame(frame @ ServerFrame::Assign { .. }) => {
                assign(state, myself, frame, Dest::Replica(batch.from.clone())).await;
            }
            Command::Frame(ServerFrame::Drain {}) => {
                let _ = myself.cast(NodeMsg::Drain);
            }
            Command::Frame(frame @ ServerFrame::Ack { .. }) => {
                if let (ServerFrame::Ack { request_id, .. }, Transport::Socket { unacked, .. }) =
                    (&frame, &mut state.transport)
                {
                    unacked.remove(request_id);
                }
                send(state, myself, frame);
            }
            Command::Frame(
                frame @ (ServerFrame::Cancel { .. } | ServerFrame::LoadModel { .. }),
            ) => send(state, myself, frame),
            Command::Frame(ServerFrame::Registered { .. } | ServerFrame::Rejected { .. }) => {}
            Command::Violation { kind, request_id } => {
                violation(state, myself, kind, request_id.as_deref()).await;
            }
        }
    }
}

/// A proxy takes a batch of its node's frames from the owner: a repeat is dropped; after a
/// gap (frames lost between replicas) every assignment it carried is treated as on a lost
/// node — cancelled, its generation told (an error event if it streamed, a retry after the
/// lease if not) — and of the batch only the `done`s, which settle exactly, are taken.
pub(super) async fn relayed(state: &mut NodeState, myself: &ActorRef<NodeMsg>, batch: FromNode) {
    let Transport::Remote {
        stream, last_seq, ..
    } = &mut state.transport
    else {
        return;
    };
    if batch.fence != state.fence {
        return;
    }
    let same_stream = *stream == batch.stream;
    if same_stream && batch.seq <= *last_seq {
        metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "duplicate_relay").increment(1);
        return;
    }
    let gap = *last_seq != 0 && (!same_stream || batch.seq != *last_seq + 1);
    *stream = batch.stream;
    *last_seq = batch.seq;
    if gap {
        tracing::warn!(node_id = %state.args.node_id, "frames relayed from the node's owner were lost; its assignments here end as on a lost node");
        lost(state, myself);
    }
    for raw in batch.frames {
        match decode_node_frame(raw.get()) {
            Ok(frame @ NodeFrame::Done { .. }) => on_frame(state, myself, frame).await,
            Ok(_) if gap => {}
            Ok(NodeFrame::Error {
                request_id,
                attempt,
                code,
                ..
            }) if code == super::squared::NODE_LOST => {
                super::squared::lost_on_node(state, &request_id, attempt);
            }
            Ok(frame) => on_frame(state, myself, frame).await,
            Err(_) => {
                violation(state, myself, super::msg::Violation::MalformedFrame, None).await;
            }
        }
    }
}

/// The node is gone without having drained (its socket closed or failed, or its heartbeats
/// stopped): the replica holding its socket counts it lost, once, and the actor stops. A node
/// that drained (its agent's SIGTERM, an operator's drain) and then left is no loss; a proxy
/// counts nothing, since the node's owner does.
pub(super) fn dropped(state: &mut NodeState, myself: &ActorRef<NodeMsg>, why: &str) {
    if matches!(state.transport, Transport::Socket { .. }) && !state.draining && !state.lost {
        state.lost = true;
        metrics::counter!(NODES_LOST_TOTAL, "node" => state.args.node_id.clone()).increment(1);
        tracing::info!(node_id = %state.args.node_id, reason = why, "node lost without draining");
    }
    myself.stop(Some(why.to_owned()));
}

/// Every assignment of this proxy ends as on a lost node.
fn lost(state: &mut NodeState, myself: &ActorRef<NodeMsg>) {
    let lost = std::mem::take(&mut state.in_flight);
    for (request_id, f) in lost {
        send(
            state,
            myself,
            ServerFrame::Cancel {
                request_id: request_id.clone(),
                attempt: f.attempt,
            },
        );
        if let Some(queue) = state.args.queues.get(&f.model) {
            queue.released(&state.args.node_id);
        }
        if let Dest::Local(generation) = f.dest {
            let _ = generation.cast(GenerationMsg::NodeLost { attempt: f.attempt });
        }
    }
}

/// Whether this actor is a proxy of a node owned elsewhere (violations are the owner's to
/// count, so a proxy forwards them).
pub(super) fn forward_violation(
    state: &NodeState,
    kind: super::msg::Violation,
    request_id: Option<&str>,
) -> bool {
    match &state.transport {
        Transport::Remote { outbox, owner, .. } => {
            tracing::debug!(node_id = %state.args.node_id, %owner, kind = kind.as_str(), "violation forwarded to the node's owner");
            outbox.push(Command::Violation {
                kind,
                request_id: request_id.map(str::to_owned),
            });
            true
        }
        Transport::Socket { .. } => false,
    }
}
