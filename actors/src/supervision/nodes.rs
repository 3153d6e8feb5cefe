//! The [`NodeSupervisor`] and [`Nodes`], the handle the WebSocket route starts node actors
//! with. A node actor is never restarted: its socket is gone with it. When one crashes, its
//! queues hear `NodeDown`, its generations `NodeGone`, and its connection closes (the actor's
//! outbound channel drops with its state), so the agent reconnects and resends its `done`s.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::kind;
use crate::generation::{Directory, GenerationMsg};
use crate::metric_names::ACTOR_RESTARTS_TOTAL;
use crate::model_queue::ModelQueueHandle;
use crate::node::{NodeActor, NodeArgs, NodeHandle};
use crate::tasks::TaskGuard;

/// How long starting a node actor may take before the connection gives up on it.
const START_WITHIN: Duration = Duration::from_secs(5);

/// Why a node actor could not be started.
#[derive(Debug, thiserror::Error)]
pub enum NodeStartError {
    /// The node supervisor is not running (restarting, or given up on).
    #[error("the node supervisor is not running")]
    NoSupervisor,
    /// The actor failed to start.
    #[error("could not start the node actor: {0}")]
    Spawn(String),
}

/// What the supervisor remembers of a live node actor, to clean up after its crash.
#[derive(Debug)]
struct Child {
    handle: NodeHandle,
    /// The models it serves, and their queues.
    queues: BTreeMap<String, ModelQueueHandle>,
}

/// Live node actors, shared with the supervisor that replaces this one (its node actors died
/// with it, without their own cleanup) and read by the queue supervisor to rebuild a queue.
type Children = Arc<Mutex<BTreeMap<ActorId, Child>>>;

/// Where the live node supervisor is.
type Slot = Arc<RwLock<Option<ActorRef<NodeSupervisorMsg>>>>;

fn lock(children: &Children) -> std::sync::MutexGuard<'_, BTreeMap<ActorId, Child>> {
    children.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Messages of the node supervisor.
#[derive(Debug)]
pub enum NodeSupervisorMsg {
    /// Start a node actor for a registered connection, linked to the supervisor.
    Start(Box<NodeArgs>, RpcReplyPort<Result<NodeHandle, String>>),
    /// Test-only fault hook: the supervisor panics while handling it.
    #[cfg(any(test, feature = "fault-injection"))]
    Crash,
}

/// What a node supervisor starts with (kept by the root to start it again).
#[derive(Debug, Clone)]
pub struct NodeSupervisorArgs {
    /// Where `NodeGone` is broadcast.
    directory: Directory,
    children: Children,
    slot: Slot,
}

/// The supervisor's state.
#[derive(Debug)]
pub struct NodeSupervisorState {
    /// Where `NodeGone` is broadcast.
    directory: Directory,
    /// Live node actors (shared: see [`Children`]).
    children: Children,
    _guard: TaskGuard,
}

/// Supervises every node actor of this replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeSupervisor;

impl Actor for NodeSupervisor {
    type Msg = NodeSupervisorMsg;
    type State = NodeSupervisorState;
    type Arguments = NodeSupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeSupervisorMsg>,
        args: NodeSupervisorArgs,
    ) -> Result<NodeSupervisorState, ActorProcessingErr> {
        let state = NodeSupervisorState {
            directory: args.directory,
            children: args.children,
            _guard: TaskGuard::new("supervisor"),
        };
        // Node actors left by a supervisor that crashed were killed with it.
        let orphans = std::mem::take(&mut *lock(&state.children));
        for child in orphans.into_values() {
            tracing::error!(
                node_id = child.handle.node_id(),
                "node actor killed with its crashed supervisor; its connection is closed"
            );
            crashed(&state.directory, &child);
        }
        *args.slot.write().unwrap_or_else(PoisonError::into_inner) = Some(myself);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<NodeSupervisorMsg>,
        msg: NodeSupervisorMsg,
        state: &mut NodeSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeSupervisorMsg::Start(args, reply) => {
                let queues = args.queues.clone();
                let started = NodeActor::start_linked(*args, myself.get_cell()).await;
                let result = match started {
                    Ok(handle) => {
                        lock(&state.children).insert(
                            handle.actor.get_id(),
                            Child {
                                handle: handle.clone(),
                                queues,
                            },
                        );
                        Ok(handle)
                    }
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(result);
            }
            #[cfg(any(test, feature = "fault-injection"))]
            NodeSupervisorMsg::Crash => super::fault::inject("node supervisor"),
        }
        Ok(())
    }

    /// A child's end never stops the supervisor (ractor's default would).
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<NodeSupervisorMsg>,
        event: SupervisionEvent,
        state: &mut NodeSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            // A normal stop ran the actor's own cleanup (`post_stop`).
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                lock(&state.children).remove(&cell.get_id());
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                let child = lock(&state.children).remove(&cell.get_id());
                if let Some(child) = child {
                    metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => kind::NODE).increment(1);
                    tracing::error!(node_id = child.handle.node_id(), %error, "node actor crashed; closing its connection (never restarted: the agent reconnects)");
                    crashed(&state.directory, &child);
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// What the crashed actor's `post_stop` would have done: its queues stop routing to it, and
/// the generations it carried learn their node is gone (each retries or ends typed per its
/// lease rules). Its socket closes on its own: the outbound channel died with its state.
fn crashed(directory: &Directory, child: &Child) {
    for queue in child.queues.values() {
        queue.node_down(&child.handle);
    }
    let node_id = child.handle.node_id().to_owned();
    directory.broadcast(|| GenerationMsg::NodeGone {
        node_id: node_id.clone(),
    });
}

/// Starts node actors under the supervisor; cloneable, held by the HTTP layer.
#[derive(Debug, Clone)]
pub struct Nodes {
    slot: Slot,
    children: Children,
    directory: Directory,
}

impl Nodes {
    /// A handle with no supervisor yet.
    pub(super) fn new(directory: Directory) -> Self {
        Self {
            slot: Slot::default(),
            children: Children::default(),
            directory,
        }
    }

    /// The arguments that start a supervisor bound to this handle.
    pub(super) fn args(&self) -> NodeSupervisorArgs {
        NodeSupervisorArgs {
            directory: self.directory.clone(),
            children: self.children.clone(),
            slot: self.slot.clone(),
        }
    }

    /// The live generations (node actors route frames through it).
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Starts the node actor of a registered connection, supervised.
    pub async fn start(&self, args: NodeArgs) -> Result<NodeHandle, NodeStartError> {
        let supervisor = self
            .slot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or(NodeStartError::NoSupervisor)?;
        let started = supervisor
            .call(
                |reply| NodeSupervisorMsg::Start(Box::new(args), reply),
                Some(START_WITHIN),
            )
            .await;
        match started {
            Ok(ractor::rpc::CallResult::Success(Ok(handle))) => Ok(handle),
            Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(NodeStartError::Spawn(e)),
            _ => Err(NodeStartError::NoSupervisor),
        }
    }

    /// The live node actors serving `model` (a restarted queue asks them to announce
    /// themselves again).
    pub(super) fn serving(&self, model: &str) -> Vec<NodeHandle> {
        lock(&self.children)
            .values()
            .filter(|c| c.queues.contains_key(model))
            .map(|c| c.handle.clone())
            .collect()
    }

    /// Number of live node actors.
    pub fn len(&self) -> usize {
        lock(&self.children).len()
    }

    /// Whether no node actor is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Test-only fault hook: makes the node supervisor panic.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn crash_supervisor(&self) {
        let supervisor = self
            .slot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(s) = supervisor {
            let _ = s.cast(NodeSupervisorMsg::Crash);
        }
    }
}
