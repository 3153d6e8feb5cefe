//! Messages of the [`super::ModelQueueActor`] and the handle others hold. The handle points
//! at the queue through a slot its supervisor rebinds after a restart, so generations and
//! node actors keep one handle for the life of the replica.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use ractor::{ActorRef, RpcReplyPort};

use super::cluster::Role;
use super::line::Ticket;
use super::routing::RouteKey;
use crate::cluster::{FromQueue, QueueOwner, ToQueue};
use crate::error::Failure;
use crate::generation::GenerationMsg;
use crate::node::{NodeHandle, NodeLoad};
use crate::protocol::Api;

/// One node slot a queue counted for one dispatch. Dropped, it goes back to that queue (the
/// actor that counted it, never a restarted successor); handed over with the assignment, the
/// node's end of the assignment gives it back instead. So a dispatch lost on its way — a
/// generation stopping as it arrived, its mailbox dropped with it — cannot leak the slot:
/// a PostgreSQL outage once filled every node's count that way with nothing running.
#[derive(Debug)]
pub struct Slot {
    queue: Option<ActorRef<QueueMsg>>,
    node_id: String,
}

impl Slot {
    pub(crate) fn new(queue: ActorRef<QueueMsg>, node_id: &str) -> Self {
        Self {
            queue: Some(queue),
            node_id: node_id.to_owned(),
        }
    }

    /// The node it is a slot of.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The assignment went out: the node's in-flight entry gives the slot back from now on.
    pub fn handed_over(mut self) {
        self.queue = None;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(queue) = self.queue.take() {
            let _ = queue.cast(QueueMsg::Released(std::mem::take(&mut self.node_id)));
        }
    }
}

/// A snapshot for operators and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    /// Generations waiting for a node.
    pub waiting: usize,
    /// Of them, by tier ([`crate::tier::Tier::ALL`] order), in this replica's line (the
    /// owner's holds every replica's).
    pub waiting_by_tier: [usize; 3],
    /// (node id, in flight, draining) of every node serving the model.
    pub nodes: Vec<(String, u32, bool)>,
    /// Nodes out of routing because their engine kept refusing work.
    pub suspended: Vec<String>,
    /// Dispatches per second over the measuring window.
    pub drain_rate: f64,
    /// The replica owning the queue, as far as this one knows (`None` standalone, or while
    /// no owner is known).
    pub owner: Option<String>,
    /// Generations this replica started on the owner's capacity grants (see
    /// `model_queue::grant`), without asking the owner.
    pub on_grant: u64,
}

/// What a [`super::ModelQueueActor`] handles.
#[derive(Debug)]
pub enum QueueMsg {
    /// Admit a generation to the queue, or refuse it (`queue_full`, `no_healthy_node`).
    Enqueue {
        /// The generation's request id.
        request_id: String,
        /// The generation to dispatch.
        generation: ActorRef<GenerationMsg>,
        /// A retry of a generation whose node was lost goes to the front.
        front: bool,
        /// A retry avoids the node that failed it, unless no other node serves the model.
        avoid: Option<String>,
        /// The engine API it needs: only nodes whose agent speaks it are chosen.
        api: Api,
        /// Its prompt, for node choice.
        route: Option<Arc<RouteKey>>,
        /// Its tier, team and work, for its place in line.
        ticket: Ticket,
        /// Admitted or refused.
        reply: RpcReplyPort<Result<(), Failure>>,
    },
    /// A generation left while waiting (client gone).
    Withdraw {
        /// Its request id.
        request_id: String,
    },
    /// A node serving this model connected.
    NodeUp(NodeHandle, NodeLoad),
    /// A live node announces itself again to a restarted queue, with what only it still knows:
    /// the assignments of this model it carries, so the new queue never assigns past capacity.
    NodeRejoin(NodeReport),
    /// A node's connection ended (its actor stopped or crashed). It names the connection, not
    /// only the node id: a node that already reconnected keeps its new entry.
    NodeDown(NodeHandle),
    /// A node's heartbeat.
    NodeLoad(String, NodeLoad),
    /// What the replica holding a node's socket says it carries of this model, by the
    /// replica whose generation holds each assignment: counts are squared with it.
    NodeCarries(String, BTreeMap<String, u32>, super::carried::Word),
    /// A node finished an assignment of this model.
    Released(String),
    /// A node takes no new work.
    NodeDraining(String),
    /// A node's engine refused work twice in a row (true) or reported healthy again (false):
    /// a suspended node gets no new work but stays connected.
    NodeSuspended(String, bool),
    /// Periodic: expire deadlines, publish the depth gauge.
    Tick,
    /// The lease task took, renewed or lost the queue's lease.
    Role(Role),
    /// A replica announced that it owns this model's queue.
    Owner(QueueOwner),
    /// Another replica's enqueues, withdrawals, releases and reports (heard by the owner).
    Remote(ToQueue),
    /// The owner's verdicts, dispatches and timeouts for this replica's generations.
    Replies(FromQueue),
    /// Nobody heard what this replica sent the owner (fence, incarnation): it is gone.
    OwnerGone(u64, u64),
    /// Nobody heard what the owner sent a replica: it is gone, with its generations.
    ReplicaGone(String),
    /// Current statistics.
    Stats(RpcReplyPort<QueueStats>),
    /// Test-only fault hook: the queue panics while handling it, as a bug would.
    #[cfg(any(test, feature = "fault-injection"))]
    Crash,
}

/// What a node tells a restarted queue about itself (see [`QueueMsg::NodeRejoin`]).
#[derive(Debug, Clone)]
pub struct NodeReport {
    /// The node's connection.
    pub node: NodeHandle,
    /// Its last heartbeat's load.
    pub load: NodeLoad,
    /// Assignments of this queue's model it carries now.
    pub in_flight: u32,
    /// An operator drained it: no new work.
    pub draining: bool,
    /// Out of routing after repeated refusals.
    pub suspended: bool,
}

/// What a generation asks of its queue besides who it is (see [`QueueMsg::Enqueue`]).
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    /// A retry goes to the front.
    pub front: bool,
    /// A retry avoids its failed node.
    pub avoid: Option<String>,
    /// The engine API it needs.
    pub api: Api,
    /// Its prompt, for node choice.
    pub route: Option<Arc<RouteKey>>,
    /// Its tier, team and work.
    pub ticket: Ticket,
}

/// Cloneable access to a model's queue.
#[derive(Debug, Clone)]
pub struct ModelQueueHandle {
    pub(crate) model: String,
    /// The live queue actor; `None` while its supervisor waits to restart it or gave up on it
    /// (every call then fails at once with `no_healthy_node`, never hangs).
    slot: Arc<RwLock<Option<ActorRef<QueueMsg>>>>,
    /// Set once by [`ModelQueueHandle::stop`]: the queue's lease task ends with it.
    stopped: Arc<tokio::sync::watch::Sender<bool>>,
}

impl ModelQueueHandle {
    /// A handle to `actor`.
    pub(crate) fn new(model: String, actor: Option<ActorRef<QueueMsg>>) -> Self {
        Self {
            model,
            slot: Arc::new(RwLock::new(actor)),
            stopped: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    /// Points every clone of this handle at `actor` (a restart) or at nothing (a crash).
    pub(crate) fn bind(&self, actor: Option<ActorRef<QueueMsg>>) {
        *self.slot.write().unwrap_or_else(PoisonError::into_inner) = actor;
    }

    /// The queue actor now, if one is bound.
    pub(crate) fn actor(&self) -> Option<ActorRef<QueueMsg>> {
        self.slot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Casts to the bound queue; a message to an unbound or dead queue is dropped (a restarted
    /// queue is rebuilt from the nodes and the waiting generations, not from lost casts).
    pub(crate) fn cast(&self, msg: QueueMsg) {
        if let Some(actor) = self.actor() {
            let _ = actor.cast(msg);
        }
    }

    /// Whether a queue actor is bound (false while it awaits a restart or was given up).
    pub fn is_bound(&self) -> bool {
        self.actor().is_some()
    }

    /// The model this queue serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    pub(crate) async fn enqueue(
        &self,
        request_id: &str,
        generation: ActorRef<GenerationMsg>,
        ask: Ask,
    ) -> Result<(), Failure> {
        let Ask {
            front,
            avoid,
            api,
            route,
            ticket,
        } = ask;
        let unavailable = || {
            Err(Failure::new(
                crate::error::ErrorCode::NoHealthyNode,
                format!("the queue of {} is not available", self.model),
            )
            .retry_after(1))
        };
        let Some(actor) = self.actor() else {
            return unavailable();
        };
        let result = actor
            .call(
                |reply| QueueMsg::Enqueue {
                    request_id: request_id.to_owned(),
                    generation,
                    front,
                    avoid,
                    api,
                    route,
                    ticket,
                    reply,
                },
                Some(std::time::Duration::from_secs(5)),
            )
            .await;
        match result {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => unavailable(),
        }
    }

    pub(crate) fn withdraw(&self, request_id: &str) {
        self.cast(QueueMsg::Withdraw {
            request_id: request_id.to_owned(),
        });
    }

    pub(crate) fn node_up(&self, node: NodeHandle, load: NodeLoad) {
        self.cast(QueueMsg::NodeUp(node, load));
    }

    pub(crate) fn node_rejoin(&self, report: NodeReport) {
        self.cast(QueueMsg::NodeRejoin(report));
    }

    pub(crate) fn node_down(&self, node: &NodeHandle) {
        self.cast(QueueMsg::NodeDown(node.clone()));
    }

    pub(crate) fn node_load(&self, node_id: &str, load: NodeLoad) {
        self.cast(QueueMsg::NodeLoad(node_id.to_owned(), load));
    }

    /// What the node's socket carries of this model, by replica (its heartbeat, or the
    /// announcement of the replica holding it).
    pub(crate) fn node_carries(
        &self,
        node_id: &str,
        carried: BTreeMap<String, u32>,
        word: super::carried::Word,
    ) {
        self.cast(QueueMsg::NodeCarries(node_id.to_owned(), carried, word));
    }

    pub(crate) fn released(&self, node_id: &str) {
        self.cast(QueueMsg::Released(node_id.to_owned()));
    }

    pub(crate) fn node_draining(&self, node_id: &str) {
        self.cast(QueueMsg::NodeDraining(node_id.to_owned()));
    }

    pub(crate) fn node_suspended(&self, node_id: &str, suspended: bool) {
        self.cast(QueueMsg::NodeSuspended(node_id.to_owned(), suspended));
    }

    /// Current statistics, or `None` if the queue does not answer.
    pub async fn stats(&self) -> Option<QueueStats> {
        let actor = self.actor()?;
        match actor
            .call(QueueMsg::Stats, Some(std::time::Duration::from_secs(5)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(s)) => Some(s),
            _ => None,
        }
    }

    /// Becomes true when the queue is stopped for good.
    pub(crate) fn stopped(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopped.subscribe()
    }

    /// Stops the queue actor (and, in a cluster, gives its lease up).
    pub fn stop(&self) {
        self.stopped.send_replace(true);
        if let Some(actor) = self.actor() {
            actor.stop(None);
        }
    }

    /// Test-only fault hook: makes the queue actor panic.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn crash(&self) {
        self.cast(QueueMsg::Crash);
    }
}
