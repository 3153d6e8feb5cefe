//! The [`NodeActor`]: relays frames between one node's socket and its generations.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};

use super::frames::{relays_to, release, route};
use super::link::{self, Dest, Link, Transport};
use super::meter::UptimeMeter;
use super::msg::{NodeHandle, NodeLoad, NodeMsg, Violation, Work};
use super::orphan::{Forward, settle_orphan};
use super::squared;
use crate::generation::{Directory, GenerationMsg};
use crate::lifecycle::GenerationStore;
use crate::metric_names::{
    NODE_KV_CACHE_USAGE, NODE_LAST_HEARTBEAT_TIMESTAMP_SECONDS, NODE_PROTOCOL_VIOLATIONS_TOTAL,
    STALE_FRAMES_TOTAL,
};
use crate::model_queue::{ModelQueueHandle, NodeReport, Word};
use crate::output::Piece;
use crate::ports::{Clock, Coordinator, Ledger, NodeAccounting, NodeDayUsage};
use crate::protocol::{NodeFrame, ServerFrame, is_finish_reason};
use crate::tasks::TaskGuard;

/// How often the actor checks that heartbeats still arrive.
const HEARTBEAT_CHECK: Duration = Duration::from_secs(1);
/// Stray assignments remembered as already cancelled (forgotten all at once past this); also
/// bounds the `done`s remembered as unrecorded.
pub(super) const MAX_STRAYS: usize = 10_000;
/// Engine refusals in a row after which a node leaves routing until its next heartbeat.
const REFUSALS_BEFORE_SUSPENSION: u32 = 2;

/// How many protocol violations a node may commit, and over what window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeTrust {
    /// Violations tolerated within `window`; one more disconnects the node.
    pub max_violations: u32,
    /// The window.
    pub window: Duration,
}

impl Default for NodeTrust {
    fn default() -> Self {
        Self {
            max_violations: 10,
            window: Duration::from_secs(60),
        }
    }
}

/// What a node connection starts with.
#[derive(Debug)]
pub struct NodeArgs {
    /// The registered node id.
    pub node_id: String,
    /// Models the node serves that this server knows.
    pub models: Vec<String>,
    /// How frames reach the node: its socket here, or its owner replica.
    pub link: Link,
    /// The queue of every model the node serves.
    pub queues: BTreeMap<String, ModelQueueHandle>,
    /// Live generations, to route frames that outlived their assignment (resent `done`s).
    pub directory: Directory,
    /// For `done` frames whose generation is gone.
    pub ledger: Arc<dyn Ledger>,
    /// Generation records, to fence a gone generation's `done` from an old attempt.
    pub lifecycle: Option<Arc<dyn GenerationStore>>,
    /// Where heartbeats go (`node:{id}`, TTL 15 s).
    pub coordinator: Arc<dyn Coordinator>,
    /// This replica's id, recorded as the node's owner.
    pub replica_id: String,
    /// A node silent this long is dead (two missed heartbeats plus slack).
    pub heartbeat_timeout: Duration,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Violations tolerated before the node is disconnected.
    pub trust: NodeTrust,
    /// The protocol version agreed at registration.
    pub protocol: u32,
    /// GPUs the node registered with (its GPU hours are connected time times these).
    pub gpus: u32,
    /// Where the socket's heartbeats are accounted per node and day; `None`: not accounted.
    pub accounting: Option<Arc<dyn NodeAccounting>>,
    /// Assignments of each model the node may carry at once (its queue's `node_capacity`;
    /// a model not named has no limit here). Enforced where the node's socket is.
    pub capacity: BTreeMap<String, u32>,
}

/// One assignment the node is carrying.
#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) attempt: u64,
    pub(super) model: String,
    /// Where its frames go.
    pub(super) dest: Dest,
    /// Heartbeats heard on the connection when its `accepted` arrived; `None` before that.
    /// A heartbeat that leaves it out after a later one arrived proves the node let it go
    /// (`squared::vanished`).
    pub(super) accepted: Option<u64>,
    /// When it was sent, for one the node never acknowledged.
    pub(super) assigned_at: tokio::time::Instant,
}

/// The actor's state.
#[derive(Debug)]
pub struct NodeState {
    pub(super) args: NodeArgs,
    pub(super) handle: NodeHandle,
    /// The connection's fencing token (see [`crate::cluster`]).
    pub(super) fence: u64,
    /// What the link needs while the actor runs.
    pub(super) transport: Transport,
    /// Assignments by request id: the node's own in-flight count.
    pub(super) in_flight: BTreeMap<String, InFlight>,
    /// Requests whose chunks no generation took, already told to cancel.
    strays: std::collections::BTreeSet<String>,
    /// `done`s whose attempt no record named, and when first seen (see `orphan.rs`).
    pub(super) unrecorded: BTreeMap<(String, u64), tokio::time::Instant>,
    /// `done`s left unacked that will be read again shortly (see `orphan::look_again`).
    pub(super) again: std::collections::BTreeSet<(String, u64)>,
    /// When the last heartbeat (or registration) arrived.
    last_heartbeat: tokio::time::Instant,
    /// Heartbeats heard on this connection: what an assignment's `accepted` is dated by.
    pub(super) beats: u64,
    /// The last heartbeat's load.
    pub(super) load: NodeLoad,
    /// Set by an operator's drain or the node's own (`draining`): no new work.
    pub(super) draining: bool,
    /// Already counted as lost (the actor is stopping): a loss is counted once.
    pub(super) lost: bool,
    /// Times of this node's protocol violations within the trust window.
    violations: VecDeque<tokio::time::Instant>,
    /// Every violation since it connected (published with its heartbeat).
    pub(super) violations_total: u64,
    /// Assignments its engine refused in a row (reset by an acceptance or a heartbeat).
    refusals_in_a_row: u32,
    /// Out of routing after repeated refusals, until its next heartbeat.
    suspended: bool,
    /// Uptime and engine counters between this connection's heartbeats.
    meter: UptimeMeter,
    checker: Option<ractor::concurrency::JoinHandle<()>>,
    _guard: TaskGuard,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeActor;

impl NodeActor {
    /// Starts the actor for a registered connection with no supervisor (tests; the server
    /// starts node actors through `crate::supervision::Nodes`) and returns its handle.
    pub async fn start(args: NodeArgs) -> Result<NodeHandle, ractor::SpawnErr> {
        let node_id = args.node_id.as_str().into();
        let protocol = args.protocol;
        let (actor, _) = Actor::spawn(None, NodeActor, args).await?;
        Ok(NodeHandle {
            node_id,
            actor,
            protocol,
        })
    }

    /// Starts the actor linked to `supervisor`, which cleans up after its crash.
    pub(crate) async fn start_linked(
        args: NodeArgs,
        supervisor: ActorCell,
    ) -> Result<NodeHandle, ractor::SpawnErr> {
        let node_id = args.node_id.as_str().into();
        let protocol = args.protocol;
        let (actor, _) = Actor::spawn_linked(None, NodeActor, args, supervisor).await?;
        Ok(NodeHandle {
            node_id,
            actor,
            protocol,
        })
    }
}

impl Actor for NodeActor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        args: NodeArgs,
    ) -> Result<NodeState, ActorProcessingErr> {
        let handle = NodeHandle {
            node_id: args.node_id.as_str().into(),
            actor: myself.clone(),
            protocol: args.protocol,
        };
        // A socket here claims the node before any queue routes to it; a proxy starts with
        // the token its owner announced.
        let (fence, transport) = link::open(&args, &myself).await?;
        for queue in args.queues.values() {
            queue.node_up(handle.clone(), NodeLoad::default());
        }
        let checker = myself.send_interval(HEARTBEAT_CHECK, || NodeMsg::CheckHeartbeat);
        let state = NodeState {
            last_heartbeat: args.clock.now(),
            beats: 0,
            args,
            handle,
            fence,
            transport,
            in_flight: BTreeMap::new(),
            strays: std::collections::BTreeSet::new(),
            unrecorded: BTreeMap::new(),
            again: std::collections::BTreeSet::new(),
            load: NodeLoad::default(),
            draining: false,
            lost: false,
            violations: VecDeque::new(),
            violations_total: 0,
            refusals_in_a_row: 0,
            suspended: false,
            meter: UptimeMeter::default(),
            checker: Some(checker),
            _guard: TaskGuard::new("node"),
        };
        link::announce(&state).await;
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Assign {
                request_id,
                attempt,
                work,
                lease_ms,
                generation,
            } => {
                let Work {
                    model,
                    body,
                    api,
                    x_request_id,
                    traceparent,
                    tier,
                } = work;
                let frame = ServerFrame::Assign {
                    request_id,
                    attempt,
                    model,
                    body,
                    api,
                    x_request_id,
                    traceparent,
                    lease_ms,
                    tier: Some(tier),
                };
                assign(state, &myself, frame, Dest::Local(generation)).await;
            }
            NodeMsg::Cancel {
                request_id,
                attempt,
            } => {
                send(
                    state,
                    &myself,
                    ServerFrame::Cancel {
                        request_id,
                        attempt,
                    },
                );
            }
            NodeMsg::Ack {
                request_id,
                attempt,
            } => {
                send(
                    state,
                    &myself,
                    ServerFrame::Ack {
                        request_id,
                        attempt,
                    },
                );
            }
            NodeMsg::Frame(frame) => on_frame(state, &myself, frame).await,
            NodeMsg::DoneAgain(done) => {
                if let NodeFrame::Done {
                    request_id,
                    attempt,
                    ..
                } = &done
                {
                    state.again.remove(&(request_id.clone(), *attempt));
                }
                on_frame(state, &myself, done).await;
            }
            NodeMsg::Drain => {
                send(state, &myself, ServerFrame::Drain {});
                start_draining(state).await;
            }
            NodeMsg::LoadModel(name) => send(state, &myself, ServerFrame::LoadModel { name }),
            NodeMsg::ConnectionLost => link::dropped(state, &myself, "connection lost"),
            NodeMsg::CheckHeartbeat => {
                let silent = state
                    .args
                    .clock
                    .now()
                    .saturating_duration_since(state.last_heartbeat);
                if silent > state.args.heartbeat_timeout {
                    tracing::warn!(node_id = %state.args.node_id, ?silent, "node missed its heartbeats; dropping it");
                    link::dropped(state, &myself, "heartbeat timeout");
                }
            }
            NodeMsg::Violation { kind, request_id } => {
                violation(state, &myself, kind, request_id.as_deref()).await;
            }
            NodeMsg::Commands(commands) => link::commands(state, &myself, commands).await,
            NodeMsg::Relayed(relayed) => link::relayed(state, &myself, relayed).await,
            NodeMsg::ReplicaGone(replica) => link::replica_gone(state, &myself, &replica).await,
            NodeMsg::News(news) => link::news(state, &myself, news).await,
            NodeMsg::Announce => link::announce(state).await,
            NodeMsg::Reannounce { model, reply } => {
                if let Some(queue) = state.args.queues.get(&model) {
                    // This replica's own dispatches: another replica's are counted by the
                    // queue's owner from that replica's reports.
                    let in_flight = state
                        .in_flight
                        .values()
                        .filter(|f| f.model == model && matches!(f.dest, Dest::Local(_)))
                        .count();
                    queue.node_rejoin(NodeReport {
                        node: state.handle.clone(),
                        load: state.load,
                        in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
                        draining: state.draining,
                        suspended: state.suspended,
                    });
                }
                let _ = reply.send(());
            }
            #[cfg(any(test, feature = "fault-injection"))]
            NodeMsg::Crash => crate::supervision::fault::inject("node"),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<NodeMsg>,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(checker) = state.checker.take() {
            checker.abort();
        }
        for (_, f) in std::mem::take(&mut state.in_flight) {
            if let Dest::Local(generation) = f.dest {
                let _ = generation.cast(GenerationMsg::NodeLost { attempt: f.attempt });
            }
        }
        for queue in state.args.queues.values() {
            queue.node_down(&state.handle);
        }
        link::close(state).await;
        Ok(())
    }
}

/// Writes a frame to the node (its socket, or its owner); a full or closed link means the
/// node is gone.
pub(super) fn send(state: &mut NodeState, myself: &ActorRef<NodeMsg>, frame: ServerFrame) {
    if !state.transport.send(frame) {
        link::dropped(state, myself, "the node's link is closed or full");
    }
}

/// Sends an assignment and records where its frames go. One the node cannot take (it is
/// draining, its link is gone, or — where its socket is — it already carries its capacity of
/// the model) is answered `not_sent` at once: proven never started, the generation may retry
/// elsewhere.
///
/// The socket's actor sees every assignment the node carries, from every replica, so it is
/// the one place a node's capacity holds whatever the queues believe. They can believe too
/// little: an `assign` relayed just before its owner's link to Redis stalled arrives late,
/// after the other replicas dropped the node, forgot their count on it and filled it again
/// (the simulation, seeds 1195, 1675, 2195).
pub(super) async fn assign(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    frame: ServerFrame,
    dest: Dest,
) {
    let ServerFrame::Assign {
        request_id,
        attempt,
        model,
        ..
    } = &frame
    else {
        return;
    };
    let (request_id, attempt, model) = (request_id.clone(), *attempt, model.clone());
    let refused = if state.draining {
        Some("the node is draining")
    } else if at_capacity(state, &model) {
        metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "over_capacity").increment(1);
        Some("the node carries its capacity of this model")
    } else if !state.transport.send(frame) {
        link::dropped(state, myself, "the node's link is closed or full");
        Some("the node's connection is gone")
    } else {
        None
    };
    if let Some(why) = refused {
        // The generation handed its queue slot over with the assignment; refused, no
        // in-flight entry will give it back.
        if matches!(dest, Dest::Local(_))
            && let Some(queue) = state.args.queues.get(&model)
        {
            queue.released(&state.args.node_id);
        }
        // Refused for want of room, the queues dispatched on a count below the node's: they
        // count what it carries now, and wait for room rather than dispatch here again —
        // this replica's at once, every other's (the owner's above all, which counts every
        // replica's work) with an announcement.
        if matches!(state.transport, Transport::Socket { .. }) {
            link::tell_carried(state, &link::carried(state), Word::Exact);
            link::announce_as(state, Word::Exact).await;
        }
        link::not_sent(state, myself, dest, request_id, attempt, why);
        return;
    }
    state.in_flight.insert(
        request_id,
        InFlight {
            attempt,
            model,
            dest,
            accepted: None,
            assigned_at: state.args.clock.now(),
        },
    );
}

/// Whether the node, where its socket is, already carries `model`'s capacity (a proxy knows
/// only its own replica's share, and leaves the count to the socket's actor).
fn at_capacity(state: &NodeState, model: &str) -> bool {
    if !matches!(state.transport, Transport::Socket { .. }) {
        return false;
    }
    let Some(&capacity) = state.args.capacity.get(model) else {
        return false;
    };
    let carried = state
        .in_flight
        .values()
        .filter(|f| f.model == model)
        .count();
    carried >= usize::try_from(capacity).unwrap_or(usize::MAX)
}

/// The socket's replica adds the heartbeat's interval to the node's day (a proxy's heartbeat
/// is its owner's, accounted there). The write is queued, never awaited here.
fn account(state: &mut NodeState, counters: Option<crate::protocol::EngineCounters>) {
    if !matches!(state.transport, Transport::Socket { .. }) {
        return;
    }
    let wall = state.args.clock.wall();
    let node = state.args.node_id.clone();
    metrics::gauge!(NODE_LAST_HEARTBEAT_TIMESTAMP_SECONDS, "node" => node.clone())
        .set(wall.timestamp_millis() as f64 / 1000.0);
    let Some(interval) = state.meter.beat(state.last_heartbeat, counters) else {
        return;
    };
    let Some(accounting) = &state.args.accounting else {
        return;
    };
    accounting.record(NodeDayUsage {
        node_id: node,
        day: wall.date_naive(),
        // One engine per node: its first model names the row (the cost report's model).
        model: state.args.models.first().cloned().unwrap_or_default(),
        connected_seconds: interval.connected_seconds,
        gpus: state.args.gpus,
        engine_prompt_tokens: interval.prompt_tokens,
        engine_generation_tokens: interval.generation_tokens,
        engine_counters: interval.counters,
    });
}

pub(super) async fn on_frame(state: &mut NodeState, myself: &ActorRef<NodeMsg>, frame: NodeFrame) {
    match frame {
        NodeFrame::Register { .. } => {
            tracing::warn!(node_id = %state.args.node_id, "second register frame ignored");
        }
        NodeFrame::Heartbeat {
            queue_depth,
            running,
            kv_cache_usage,
            gpu_util,
            models,
            engine_counters,
            assignments,
        } => {
            state.last_heartbeat = state.args.clock.now();
            squared::on_heartbeat(state, myself, assignments).await;
            state.beats += 1;
            account(state, engine_counters);
            // A heartbeat means the engine's metrics answered: a node suspended for refusing
            // work gets another chance.
            state.refusals_in_a_row = 0;
            if std::mem::take(&mut state.suspended) {
                tracing::info!(node_id = %state.args.node_id, "node healthy again; back in routing");
                for queue in state.args.queues.values() {
                    queue.node_suspended(&state.args.node_id, false);
                }
            }
            let kv = if kv_cache_usage.is_finite() {
                kv_cache_usage.clamp(0.0, 1.0)
            } else {
                0.0
            };
            state.load = NodeLoad {
                queue_depth,
                running,
                kv_cache_usage: kv,
            };
            if matches!(state.transport, Transport::Socket { .. }) {
                link::tell_carried(state, &link::carried(state), Word::Announced);
            }
            for (model, queue) in &state.args.queues {
                queue.node_load(&state.args.node_id, state.load);
                metrics::gauge!(NODE_KV_CACHE_USAGE, "node" => state.args.node_id.clone(), "model" => model.clone())
                    .set(kv);
            }
            link::heartbeat(state, myself, gpu_util, &models).await;
        }
        NodeFrame::Draining {} => {
            if !state.draining {
                tracing::info!(node_id = %state.args.node_id, in_flight = state.in_flight.len(), "the node is draining itself: no new work");
            }
            start_draining(state).await;
        }
        NodeFrame::Accepted {
            request_id,
            attempt,
        } => {
            if let Some(f) = state
                .in_flight
                .get_mut(&request_id)
                .filter(|f| f.attempt == attempt)
            {
                f.accepted.get_or_insert(state.beats);
                state.refusals_in_a_row = 0;
            }
            if let Some(replica) = relays_to(state, &request_id, attempt) {
                let frame = NodeFrame::Accepted {
                    request_id,
                    attempt,
                };
                link::relay(state, myself, replica, &frame);
                return;
            }
            let from = state.handle.clone();
            route(
                state,
                &request_id,
                attempt,
                GenerationMsg::Accepted { attempt, from },
            );
        }
        NodeFrame::Chunk {
            request_id,
            attempt,
            seq,
            delta,
            logprobs,
        } => {
            if let Some(replica) = relays_to(state, &request_id, attempt) {
                let frame = NodeFrame::Chunk {
                    request_id,
                    attempt,
                    seq,
                    delta,
                    logprobs,
                };
                link::relay(state, myself, replica, &frame);
                return;
            }
            // Structured output is read once, here: a node's delta that no engine would
            // send never reaches a client.
            let delta = match Piece::from_wire(delta, logprobs) {
                Ok(piece) => piece,
                Err(_) => {
                    violation(state, myself, Violation::MalformedFrame, Some(&request_id)).await;
                    return;
                }
            };
            let from = state.handle.clone();
            let taken = route(
                state,
                &request_id,
                attempt,
                GenerationMsg::Chunk {
                    attempt,
                    seq,
                    delta,
                    from,
                },
            );
            // Nobody here waits for it (its generation lived on a replica that died, or
            // ended): the node is told once to stop spending the GPU on it. Its `done`
            // still settles the row.
            if !taken && state.strays.insert(request_id.clone()) {
                if state.strays.len() > MAX_STRAYS {
                    state.strays.clear();
                }
                send(
                    state,
                    myself,
                    ServerFrame::Cancel {
                        request_id,
                        attempt,
                    },
                );
            }
        }
        NodeFrame::Error {
            request_id,
            attempt,
            code,
            message,
        } => {
            let unaccepted = state
                .in_flight
                .get(&request_id)
                .is_some_and(|f| f.attempt == attempt && f.accepted.is_none());
            let remote = relays_to(state, &request_id, attempt);
            // An error before acceptance is final for the assignment (no `done` follows).
            if unaccepted {
                release(state, &request_id);
                if engine_refused(&code) {
                    refused(state);
                }
            }
            if let Some(replica) = remote {
                let frame = NodeFrame::Error {
                    request_id,
                    attempt,
                    code,
                    message,
                };
                link::relay(state, myself, replica, &frame);
                return;
            }
            let from = state.handle.clone();
            route(
                state,
                &request_id,
                attempt,
                GenerationMsg::EngineError {
                    attempt,
                    code,
                    message,
                    from: Some(from),
                },
            );
        }
        NodeFrame::Done {
            request_id,
            attempt,
            prompt_tokens,
            completion_tokens,
            finish_reason,
            cached_tokens,
            chunks,
        } => {
            // Engines name the reason in a short word; anything else (control characters,
            // NUL, kilobytes) would reach the client and the generation's record.
            let finish_reason = if is_finish_reason(&finish_reason) {
                finish_reason
            } else {
                violation(state, myself, Violation::MalformedFrame, Some(&request_id)).await;
                "error".to_owned()
            };
            let remote = relays_to(state, &request_id, attempt);
            if state
                .in_flight
                .get(&request_id)
                .is_some_and(|f| f.attempt == attempt)
            {
                release(state, &request_id);
            }
            let frame = NodeFrame::Done {
                request_id: request_id.clone(),
                attempt,
                prompt_tokens,
                completion_tokens,
                finish_reason: finish_reason.clone(),
                cached_tokens,
                chunks,
            };
            // Its replica stopped listening, or had its time to ack: no generation there
            // takes it, and one here would have been routed to already.
            let mut forward = Forward::ToGeneration;
            if let Some(replica) = remote {
                if link::relay(state, myself, replica, &frame) {
                    return;
                }
                forward = Forward::Never;
            } else if link::ack_overdue(state, &request_id, attempt) {
                forward = Forward::Never;
            }
            let msg = GenerationMsg::Done {
                attempt,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                chunks,
                finish_reason,
                from: state.handle.clone(),
            };
            if !route(state, &request_id, attempt, msg) {
                settle_orphan(state, myself, frame, forward).await;
            }
        }
    }
}

/// No new work for this node, here and (through the announcement) on every replica; what
/// it runs finishes. An operator's drain and the node's own (`draining`, on SIGTERM) alike.
async fn start_draining(state: &mut NodeState) {
    state.draining = true;
    for queue in state.args.queues.values() {
        queue.node_draining(&state.args.node_id);
    }
    link::announce(state).await;
}

/// Codes that say the node's engine cannot take work at all: unreachable, or loading. An
/// engine's error answer (a 5xx, a 429) may come from the request itself, so it retries the
/// request elsewhere without counting against the node.
fn engine_refused(code: &str) -> bool {
    matches!(code, "engine_unreachable" | "model_loading")
}

/// One more refusal in a row; at the threshold the node leaves routing until its next
/// heartbeat, so retries go elsewhere instead of back to a dead engine.
fn refused(state: &mut NodeState) {
    state.refusals_in_a_row += 1;
    if state.refusals_in_a_row >= REFUSALS_BEFORE_SUSPENSION && !state.suspended {
        state.suspended = true;
        tracing::warn!(node_id = %state.args.node_id, refusals = state.refusals_in_a_row, "the node's engine keeps refusing work; out of routing until its next heartbeat");
        for queue in state.args.queues.values() {
            queue.node_suspended(&state.args.node_id, true);
        }
    }
}

/// The window of a node's violation count in the coordinator (`GET /admin/nodes`): 24 h from
/// the first violation it counts.
pub const VIOLATIONS_KEPT: Duration = Duration::from_secs(24 * 3600);

/// The coordinator key counting a node's recent violations, for operators: the node list
/// shows it even after the node was disconnected for them.
pub fn violations_key(node_id: &str) -> String {
    format!("node_violations:{node_id}")
}

/// Counts and logs a violation; past the tolerated number within the window the node is
/// disconnected (it may register again; an operator revokes its token to keep it out).
pub(super) async fn violation(
    state: &mut NodeState,
    myself: &ActorRef<NodeMsg>,
    kind: Violation,
    request_id: Option<&str>,
) {
    // A proxy's node is judged by its owner.
    if link::forward_violation(state, kind, request_id) {
        return;
    }
    let node = state.args.node_id.clone();
    metrics::counter!(NODE_PROTOCOL_VIOLATIONS_TOTAL, "node" => node.clone(), "kind" => kind.as_str())
        .increment(1);
    tracing::warn!(node_id = %node, kind = kind.as_str(), request_id, "node protocol violation; frame refused");
    state.violations_total += 1;
    let key = violations_key(&node);
    if let Err(e) = state.args.coordinator.incr(&key, 1, VIOLATIONS_KEPT).await {
        tracing::warn!(error = %e, "could not record a node's violation in the coordinator");
    }
    let now = state.args.clock.now();
    let window = state.args.trust.window;
    state.violations.push_back(now);
    while state
        .violations
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) > window)
    {
        state.violations.pop_front();
    }
    let tolerated = usize::try_from(state.args.trust.max_violations).unwrap_or(usize::MAX);
    if state.violations.len() > tolerated {
        tracing::error!(node_id = %node, violations = state.violations.len(), ?window, "too many protocol violations; disconnecting the node (revoke its token to keep it out)");
        myself.stop(Some("too many protocol violations".into()));
    }
}
