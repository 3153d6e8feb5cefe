//! The generation supervisor and [`Generations`], the handle the HTTP layer uses to start a
//! generation and read its events. A generation that crashes (a panic in a handler) is
//! reported here: the supervisor releases its ledger row and tells its client, so a bug can
//! neither leak a reservation nor leave a stream hanging.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::actor::GenerationActor;
use super::directory::Directory;
use super::events::{CrashSender, EventReceiver};
use super::msg::{GenEvent, GenerationArgs, GenerationMsg};
use crate::error::{ErrorCode, Failure};
use crate::ports::Ledger;
use crate::tasks::TaskGuard;
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};

/// What the supervisor remembers of each child, to clean up after a crash.
#[derive(Debug)]
struct Child {
    request_id: String,
    ledger_id: String,
    events: CrashSender,
}

/// Messages of the supervisor.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// Spawn a generation linked to the supervisor.
    Spawn(
        Box<GenerationArgs>,
        RpcReplyPort<Result<ActorRef<GenerationMsg>, String>>,
    ),
}

/// The supervisor's state.
#[derive(Debug)]
pub struct SupervisorState {
    ledger: Arc<dyn Ledger>,
    directory: Directory,
    children: BTreeMap<ActorId, Child>,
    _guard: TaskGuard,
}

/// Supervises every generation of this replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationSupervisor;

impl Actor for GenerationSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = (Arc<dyn Ledger>, Directory);

    async fn pre_start(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        (ledger, directory): (Arc<dyn Ledger>, Directory),
    ) -> Result<SupervisorState, ActorProcessingErr> {
        Ok(SupervisorState {
            ledger,
            directory,
            children: BTreeMap::new(),
            _guard: TaskGuard::new("supervisor"),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Spawn(args, reply) => {
                let child = Child {
                    request_id: args.request_id.clone(),
                    ledger_id: args.reservation.request_id.clone(),
                    events: args.events.crash_sender(),
                };
                let spawned = Actor::spawn_linked(
                    None,
                    GenerationActor,
                    (*args, state.directory.clone()),
                    myself.get_cell(),
                )
                .await;
                let result = match spawned {
                    Ok((actor, _)) => {
                        state.children.insert(actor.get_id(), child);
                        Ok(actor)
                    }
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(result);
            }
        }
        Ok(())
    }

    /// A child's end never stops the supervisor (ractor's default would).
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                state.children.remove(&cell.get_id());
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                if let Some(child) = state.children.remove(&cell.get_id()) {
                    tracing::error!(request_id = %child.request_id, %error, "generation crashed; releasing its reservation");
                    crashed(state, &cell, child).await;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Cleans up after a crashed generation: its row is cancelled (nothing is known of its
/// usage; a `done` the node sends later still settles it, see the node actor) and its client
/// gets an error instead of a hang.
async fn crashed(state: &SupervisorState, cell: &ActorCell, child: Child) {
    state.directory.remove(&child.request_id, cell.get_id());
    if let Err(e) = state.ledger.cancel(&child.ledger_id).await {
        tracing::error!(request_id = %child.request_id, error = %e, "could not release a crashed generation's row");
    }
    child.events.send(GenEvent::Failed(Failure::new(
        ErrorCode::ModelBackendError,
        "The generation failed inside the server.",
    )));
}

/// Starts generations; cloneable, held by the HTTP layer.
#[derive(Debug, Clone)]
pub struct Generations {
    supervisor: ActorRef<SupervisorMsg>,
    directory: Directory,
}

impl Generations {
    /// Starts the supervisor.
    pub async fn start(
        ledger: Arc<dyn Ledger>,
        directory: Directory,
    ) -> Result<Self, ractor::SpawnErr> {
        let (supervisor, _) =
            Actor::spawn(None, GenerationSupervisor, (ledger, directory.clone())).await?;
        Ok(Self {
            supervisor,
            directory,
        })
    }

    /// The directory of live generations (for node connections).
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Spawns a generation, reserves its row and queues it. On success the caller reads the
    /// returned stream; on failure nothing is left behind (the row is cancelled).
    pub async fn start_generation(
        &self,
        args: GenerationArgs,
        events: EventReceiver,
    ) -> Result<GenerationStream, Failure> {
        let unavailable = |what: &str| {
            Failure::new(
                ErrorCode::QuotaServiceUnavailable,
                format!("could not start the generation: {what}"),
            )
            .retry_after(1)
        };
        let spawned = self
            .supervisor
            .call(
                |reply| SupervisorMsg::Spawn(Box::new(args), reply),
                Some(Duration::from_secs(5)),
            )
            .await;
        let actor = match spawned {
            Ok(ractor::rpc::CallResult::Success(Ok(actor))) => actor,
            _ => return Err(unavailable("supervisor")),
        };
        let admitted = actor
            .call(GenerationMsg::Admit, Some(Duration::from_secs(30)))
            .await;
        match admitted {
            Ok(ractor::rpc::CallResult::Success(Ok(()))) => Ok(GenerationStream { actor, events }),
            Ok(ractor::rpc::CallResult::Success(Err(failure))) => Err(failure),
            _ => {
                actor.stop(None);
                Err(unavailable("admission"))
            }
        }
    }

    /// Tells the live generation `request_id` on this replica that it was cancelled; false
    /// when it does not run here.
    pub fn cancel(&self, request_id: &str) -> bool {
        self.directory
            .get(request_id)
            .is_some_and(|g| g.cast(GenerationMsg::Cancel).is_ok())
    }

    /// Stops the supervisor and with it every generation.
    pub fn stop(&self) {
        self.supervisor.stop(None);
    }
}

/// A started generation's events. Dropping it tells the generation its client left.
#[derive(Debug)]
pub struct GenerationStream {
    actor: ActorRef<GenerationMsg>,
    events: EventReceiver,
}

impl GenerationStream {
    /// The next event; `None` after the terminal one.
    pub async fn next(&mut self) -> Option<GenEvent> {
        self.events.recv().await
    }

    /// Asks the generation to cancel (its record already says so).
    pub fn cancel(&self) {
        let _ = self.actor.cast(GenerationMsg::Cancel);
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        let _ = self.actor.cast(GenerationMsg::ClientGone);
    }
}
