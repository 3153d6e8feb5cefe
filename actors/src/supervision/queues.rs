//! The [`QueueSupervisor`]: one per replica, over every model's queue. A queue that crashes
//! is restarted (the first time at once, then with a growing backoff) and rebuilt: the live
//! node actors announce themselves to it again with their load and in-flight work, then the
//! generations that waited in the dead queue enqueue themselves again at the front. Past
//! [`RestartPolicy::max_restarts`] in the window the supervisor escalates: it fails, and the
//! root restarts it with every queue rebuilt the same way.

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::time::Instant;

use super::nodes::Nodes;
use super::{RestartPolicy, RestartWindow, kind};
use crate::generation::{Directory, GenerationMsg};
use crate::metric_names::ACTOR_RESTARTS_TOTAL;
use crate::model_queue::{ModelQueueActor, ModelQueueHandle, QueueArgs};
use crate::tasks::TaskGuard;

/// How long a node actor has to announce itself to a restarted queue.
const REANNOUNCE_WITHIN: Duration = Duration::from_secs(1);

/// What the queue supervisor starts with (kept by the root to start it again).
#[derive(Debug, Clone)]
pub struct QueueSupervisorArgs {
    /// Each model's queue arguments and the handle everyone holds.
    pub(super) queues: Vec<(QueueArgs, ModelQueueHandle)>,
    /// The live node actors, asked to announce themselves to a restarted queue.
    pub(super) nodes: Nodes,
    /// The live generations, told that a queue restarted.
    pub(super) directory: Directory,
    /// When to restart a queue and when to escalate.
    pub(super) policy: RestartPolicy,
}

/// Messages of the queue supervisor.
#[derive(Debug)]
pub enum QueueSupervisorMsg {
    /// Restart the queue of this model (sent after its backoff).
    Restart(String),
}

/// One model's queue.
#[derive(Debug)]
struct Slot {
    /// To start it again.
    args: QueueArgs,
    /// Rebound to each new actor.
    handle: ModelQueueHandle,
    /// The running actor; `None` while it awaits its restart.
    actor: Option<ActorId>,
    /// Its recent crashes.
    crashes: RestartWindow,
}

/// The supervisor's state.
#[derive(Debug)]
pub struct QueueSupervisorState {
    /// Queues by model.
    queues: BTreeMap<String, Slot>,
    nodes: Nodes,
    directory: Directory,
    policy: RestartPolicy,
    _guard: TaskGuard,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueSupervisor;

impl Actor for QueueSupervisor {
    type Msg = QueueSupervisorMsg;
    type State = QueueSupervisorState;
    type Arguments = QueueSupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<QueueSupervisorMsg>,
        args: QueueSupervisorArgs,
    ) -> Result<QueueSupervisorState, ActorProcessingErr> {
        let mut state = QueueSupervisorState {
            queues: args
                .queues
                .into_iter()
                .map(|(args, handle)| {
                    let slot = Slot {
                        args,
                        handle,
                        actor: None,
                        crashes: RestartWindow::default(),
                    };
                    (slot.args.model.clone(), slot)
                })
                .collect(),
            nodes: args.nodes,
            directory: args.directory,
            policy: args.policy,
            _guard: TaskGuard::new("supervisor"),
        };
        // At boot nothing waits; after this supervisor's own restart every queue died with
        // the previous one, and is rebuilt exactly as after its own crash.
        let models: Vec<String> = state.queues.keys().cloned().collect();
        for model in models {
            start_queue(&myself, &mut state, &model).await?;
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<QueueSupervisorMsg>,
        msg: QueueSupervisorMsg,
        state: &mut QueueSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            QueueSupervisorMsg::Restart(model) => {
                if state.queues.get(&model).is_some_and(|s| s.actor.is_none()) {
                    start_queue(&myself, state, &model).await?;
                }
            }
        }
        Ok(())
    }

    /// A queue's crash is handled here; returning `Err` escalates to the root.
    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<QueueSupervisorMsg>,
        event: SupervisionEvent,
        state: &mut QueueSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            // Stopped on purpose (shutdown): not restarted.
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(slot) = state.slot_of(cell.get_id()) {
                    slot.actor = None;
                    slot.handle.bind(None);
                }
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                let policy = state.policy;
                let Some(slot) = state.slot_of(cell.get_id()) else {
                    return Ok(());
                };
                metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => kind::MODEL_QUEUE).increment(1);
                slot.actor = None;
                // Until the new queue runs, requests for the model are refused at once
                // (`no_healthy_node`, retry in 1 s) rather than sent to a dead actor.
                slot.handle.bind(None);
                let model = slot.args.model.clone();
                match slot.crashes.record(Instant::now(), &policy) {
                    Some(delay) if delay.is_zero() => {
                        tracing::error!(%model, %error, "model queue crashed; restarting it");
                        start_queue(&myself, state, &model).await?;
                    }
                    Some(delay) => {
                        tracing::error!(%model, %error, ?delay, "model queue crashed; restarting it after a backoff");
                        myself.send_after(delay, move || QueueSupervisorMsg::Restart(model));
                    }
                    None => {
                        tracing::error!(%model, %error, max_restarts = policy.max_restarts, window = ?policy.window, "model queue keeps crashing; escalating to the root");
                        return Err(format!("the queue of {model} crashed too often").into());
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl QueueSupervisorState {
    fn slot_of(&mut self, id: ActorId) -> Option<&mut Slot> {
        self.queues.values_mut().find(|s| s.actor == Some(id))
    }
}

/// Starts (or restarts) the queue of `model` and rebuilds it: bound first, so what the nodes
/// and generations send reaches it; then every live node serving the model announces itself
/// (each answers once its announcement is sent, so the queue knows its nodes before anyone
/// re-enters it); then the waiting generations are told to enqueue again.
async fn start_queue(
    myself: &ActorRef<QueueSupervisorMsg>,
    state: &mut QueueSupervisorState,
    model: &str,
) -> Result<(), ActorProcessingErr> {
    let Some(slot) = state.queues.get_mut(model) else {
        return Ok(());
    };
    let actor = ModelQueueActor::start_linked(slot.args.clone(), myself.get_cell()).await?;
    slot.actor = Some(actor.get_id());
    slot.handle.bind(Some(actor));
    let nodes = state.nodes.serving(model);
    let mut announced = 0usize;
    for node in &nodes {
        if node.reannounce(model, REANNOUNCE_WITHIN).await {
            announced += 1;
        }
    }
    let model = model.to_owned();
    let told = state.directory.broadcast(|| GenerationMsg::QueueRestarted {
        model: model.clone(),
    });
    tracing::info!(%model, nodes = announced, generations_told = told, "model queue started");
    Ok(())
}

/// What the root does when it gives up on the queue supervisor: every queue refuses at once
/// (`no_healthy_node`), and the generations that waited in them end with that refusal.
pub(super) fn abandon_all(args: QueueSupervisorArgs) -> impl Fn() + Send + Sync + 'static {
    move || {
        for (queue_args, handle) in &args.queues {
            handle.bind(None);
            let model = queue_args.model.clone();
            args.directory.broadcast(|| GenerationMsg::QueueRestarted {
                model: model.clone(),
            });
        }
    }
}
