//! The generation supervisor and [`Generations`], the handle the HTTP layer uses to start a
//! generation and read its events. A generation that crashes (a panic in a handler) is
//! reported here: the supervisor releases its ledger row and tells its client, so a bug can
//! neither leak a reservation nor leave a stream hanging. Generations are never restarted.
//! The supervisor itself runs under the root (`crate::supervision`); what it knows of its
//! children lives outside it, so the one that replaces it after a crash cleans up after the
//! generations that died with it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use super::actor::GenerationActor;
use super::directory::Directory;
use super::events::{CrashSender, EventReceiver};
use super::msg::{GenEvent, GenerationArgs, GenerationMsg};
use crate::error::{ErrorCode, Failure};
use crate::metric_names::ACTOR_RESTARTS_TOTAL;
use crate::ports::Ledger;
use crate::tasks::TaskGuard;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

/// What the supervisor remembers of each child, to clean up after a crash.
#[derive(Debug)]
struct Child {
    request_id: String,
    ledger_id: String,
    events: CrashSender,
}

/// The live children, shared with the supervisor that replaces this one: when a supervisor
/// dies its generations are killed with it (no `post_stop`), and the next one settles them.
type Children = Arc<Mutex<BTreeMap<ActorId, Child>>>;

/// Where the live supervisor is: rebound by each supervisor that starts.
type Slot = Arc<RwLock<Option<ActorRef<SupervisorMsg>>>>;

/// Messages of the supervisor.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// Spawn a generation linked to the supervisor.
    Spawn(
        Box<GenerationArgs>,
        RpcReplyPort<Result<ActorRef<GenerationMsg>, String>>,
    ),
    /// Test-only fault hook: the supervisor panics while handling it.
    #[cfg(any(test, feature = "fault-injection"))]
    Crash,
}

/// What a generation supervisor starts with (kept by the root to start it again).
#[derive(Debug, Clone)]
pub struct SupervisorArgs {
    /// To release the rows of crashed generations.
    pub ledger: Arc<dyn Ledger>,
    /// The live generations.
    pub directory: Directory,
    children: Children,
    slot: Slot,
}

/// The supervisor's state.
#[derive(Debug)]
pub struct SupervisorState {
    ledger: Arc<dyn Ledger>,
    directory: Directory,
    /// Live generations, to clean up after a crash (shared: see [`Children`]).
    children: Children,
    _guard: TaskGuard,
}

/// Supervises every generation of this replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationSupervisor;

impl Actor for GenerationSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let state = SupervisorState {
            ledger: args.ledger,
            directory: args.directory,
            children: args.children,
            _guard: TaskGuard::new("supervisor"),
        };
        // Children left by a supervisor that crashed were killed with it: settle them now.
        let orphans = std::mem::take(&mut *lock(&state.children));
        for (id, child) in orphans {
            tracing::error!(request_id = %child.request_id, "generation killed with its crashed supervisor; releasing its reservation");
            crashed(&state, id, child).await;
        }
        *args.slot.write().unwrap_or_else(PoisonError::into_inner) = Some(myself);
        Ok(state)
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
                        lock(&state.children).insert(actor.get_id(), child);
                        Ok(actor)
                    }
                    Err(e) => Err(e.to_string()),
                };
                let _ = reply.send(result);
            }
            #[cfg(any(test, feature = "fault-injection"))]
            SupervisorMsg::Crash => crate::supervision::fault::inject("generation supervisor"),
        }
        Ok(())
    }

    /// Stopped on purpose (shutdown): its generations are killed with it, as before there
    /// was a root. Their records are dropped so that nothing keeps their clients' streams
    /// open (each holds a sender); a crash, instead, leaves them for the next supervisor.
    async fn post_stop(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        lock(&state.children).clear();
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
                lock(&state.children).remove(&cell.get_id());
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                let child = lock(&state.children).remove(&cell.get_id());
                if let Some(child) = child {
                    metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => "generation").increment(1);
                    tracing::error!(request_id = %child.request_id, %error, "generation crashed; releasing its reservation (never restarted)");
                    crashed(state, cell.get_id(), child).await;
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
async fn crashed(state: &SupervisorState, id: ActorId, child: Child) {
    state.directory.remove(&child.request_id, id);
    if let Err(e) = state.ledger.cancel(&child.ledger_id).await {
        tracing::error!(request_id = %child.request_id, error = %e, "could not release a crashed generation's row");
    }
    child.events.send(GenEvent::Failed(Failure::new(
        ErrorCode::ModelBackendError,
        "The generation failed inside the server.",
    )));
}

fn lock(children: &Children) -> std::sync::MutexGuard<'_, BTreeMap<ActorId, Child>> {
    children.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts generations; cloneable, held by the HTTP layer. It reaches whichever supervisor is
/// live: one restarted by the root replaces the one that crashed.
#[derive(Debug, Clone)]
pub struct Generations {
    supervisor: Slot,
    directory: Directory,
}

impl Generations {
    /// Starts a supervisor of its own, with no parent (tests; the server starts it under the
    /// root, see `crate::supervision`).
    pub async fn start(
        ledger: Arc<dyn Ledger>,
        directory: Directory,
    ) -> Result<Self, ractor::SpawnErr> {
        let (handle, args) = Self::unstarted(ledger, directory);
        Actor::spawn(None, GenerationSupervisor, args).await?;
        Ok(handle)
    }

    /// A handle with no supervisor yet, and the arguments that start one bound to it.
    pub(crate) fn unstarted(
        ledger: Arc<dyn Ledger>,
        directory: Directory,
    ) -> (Self, SupervisorArgs) {
        let slot: Slot = Arc::default();
        let args = SupervisorArgs {
            ledger,
            directory: directory.clone(),
            children: Children::default(),
            slot: slot.clone(),
        };
        (
            Self {
                supervisor: slot,
                directory,
            },
            args,
        )
    }

    fn supervisor(&self) -> Option<ActorRef<SupervisorMsg>> {
        self.supervisor
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Test-only fault hook: makes the generation supervisor panic.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn crash_supervisor(&self) {
        if let Some(s) = self.supervisor() {
            let _ = s.cast(SupervisorMsg::Crash);
        }
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
        let Some(supervisor) = self.supervisor() else {
            return Err(unavailable("supervisor"));
        };
        let spawned = supervisor
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
        if let Some(s) = self.supervisor() {
            s.stop(None);
        }
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
