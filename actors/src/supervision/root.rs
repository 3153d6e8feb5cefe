//! The [`RootSupervisor`]: starts every child supervisor, restarts one that crashes (with
//! backoff, within its [`RestartPolicy`]), and past the policy gives up on it, reports it
//! down and lets its handles refuse typed instead of hang.

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::time::Instant;

use super::{ChildSpec, Down, RestartPolicy, RestartWindow, kind};
use crate::metric_names::ACTOR_RESTARTS_TOTAL;
use crate::tasks::TaskGuard;

/// What the root starts with.
#[derive(Debug)]
pub struct RootArgs {
    /// Its children, started in this order.
    pub(super) children: Vec<Box<dyn ChildSpec>>,
    /// How often a child may be restarted.
    pub(super) policy: RestartPolicy,
    /// Where it reports the children it gave up on.
    pub(super) down: Down,
}

/// Messages of the root.
#[derive(Debug)]
pub enum RootMsg {
    /// Restart the child at this index (sent after its backoff).
    Restart(usize),
}

/// One child supervisor.
#[derive(Debug)]
struct Child {
    spec: Box<dyn ChildSpec>,
    /// The running instance; `None` while it awaits a restart, after it was given up on, or
    /// after it stopped normally (shutdown).
    cell: Option<ActorCell>,
    /// Its recent crashes.
    crashes: RestartWindow,
}

/// The root's state.
#[derive(Debug)]
pub struct RootState {
    children: Vec<Child>,
    policy: RestartPolicy,
    down: Down,
    _guard: TaskGuard,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct RootSupervisor;

impl Actor for RootSupervisor {
    type Msg = RootMsg;
    type State = RootState;
    type Arguments = RootArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RootMsg>,
        args: RootArgs,
    ) -> Result<RootState, ActorProcessingErr> {
        let mut children = Vec::with_capacity(args.children.len());
        for spec in args.children {
            // A child that cannot start at boot fails the boot: nothing runs half-built.
            let cell = spec.start(myself.get_cell()).await?;
            children.push(Child {
                spec,
                cell: Some(cell),
                crashes: RestartWindow::default(),
            });
        }
        Ok(RootState {
            children,
            policy: args.policy,
            down: args.down,
            _guard: TaskGuard::new("supervisor"),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RootMsg>,
        msg: RootMsg,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RootMsg::Restart(i) => restart(&myself, state, i).await,
        }
        Ok(())
    }

    /// A child's end never stops the root (ractor's default would).
    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RootMsg>,
        event: SupervisionEvent,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(child) = state.child_of(&cell) {
                    tracing::info!(child = child.spec.name(), "child supervisor stopped");
                    child.cell = None;
                }
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                let Some(i) = state.index_of(&cell) else {
                    return Ok(());
                };
                metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => kind::SUPERVISOR).increment(1);
                let policy = state.policy;
                let child = &mut state.children[i];
                child.cell = None;
                let name = child.spec.name();
                match child.crashes.record(Instant::now(), &policy) {
                    Some(delay) if delay.is_zero() => {
                        tracing::error!(child = name, %error, "child supervisor crashed; restarting it");
                        restart(&myself, state, i).await;
                    }
                    Some(delay) => {
                        tracing::error!(child = name, %error, ?delay, "child supervisor crashed; restarting it after a backoff");
                        myself.send_after(delay, move || RootMsg::Restart(i));
                    }
                    None => give_up(state, i, &error.to_string()),
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl RootState {
    fn index_of(&self, cell: &ActorCell) -> Option<usize> {
        self.children
            .iter()
            .position(|c| c.cell.as_ref().is_some_and(|c| c.get_id() == cell.get_id()))
    }

    fn child_of(&mut self, cell: &ActorCell) -> Option<&mut Child> {
        let i = self.index_of(cell)?;
        self.children.get_mut(i)
    }
}

/// Starts child `i` again; one that cannot even start is given up on.
async fn restart(myself: &ActorRef<RootMsg>, state: &mut RootState, i: usize) {
    let Some(child) = state.children.get_mut(i) else {
        return;
    };
    if child.cell.is_some() {
        return;
    }
    match child.spec.start(myself.get_cell()).await {
        Ok(cell) => {
            tracing::info!(child = child.spec.name(), "child supervisor restarted");
            child.cell = Some(cell);
        }
        Err(e) => give_up(state, i, &e.to_string()),
    }
}

/// Past its policy (or unable to start): the child stays down, its handles refuse typed, and
/// [`super::Supervision::down`] names it for readiness.
fn give_up(state: &mut RootState, i: usize, error: &str) {
    let Some(child) = state.children.get(i) else {
        return;
    };
    let name = child.spec.name();
    tracing::error!(child = name, error, window = ?state.policy.window, max_restarts = state.policy.max_restarts, "child supervisor keeps crashing; giving up on it (the replica reports not ready)");
    state
        .down
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(name);
    child.spec.abandon();
}
