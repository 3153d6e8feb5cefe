//! The supervision tree of one replica: a [`RootSupervisor`] over one child supervisor per
//! kind of actor (nodes, model queues, generations, and a slot for team budgets), each with
//! its restart policy. [`Supervision::start`] builds it and hands out the handles the server
//! uses; a crash anywhere is logged and counted in `switchyard_actor_restarts_total{kind}`.

mod nodes;
mod queues;
mod root;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorRef, SpawnErr};
use tokio::time::Instant;

use crate::generation::{Directory, GenerationSupervisor, Generations};
use crate::model_queue::{ModelQueueHandle, QueueArgs};
use crate::ports::Ledger;

pub use nodes::{NodeStartError, NodeSupervisor, NodeSupervisorMsg, Nodes};
pub use queues::{QueueSupervisor, QueueSupervisorMsg};
pub use root::{RootMsg, RootSupervisor};

/// Values of the `kind` label of `switchyard_actor_restarts_total`.
pub mod kind {
    /// A generation actor (never restarted; its supervisor settles what it held).
    pub const GENERATION: &str = "generation";
    /// A node actor (never restarted; the connection is closed and the agent reconnects).
    pub const NODE: &str = "node";
    /// A model queue (restarted with backoff and rebuilt).
    pub const MODEL_QUEUE: &str = "model_queue";
    /// A team budget actor (see the budget supervisor).
    pub const TEAM_BUDGET: &str = "team_budget";
    /// A child supervisor (restarted by the root).
    pub const SUPERVISOR: &str = "supervisor";
    /// Every kind, for the series exported at 0 before any crash.
    pub const ALL: [&str; 5] = [GENERATION, NODE, MODEL_QUEUE, TEAM_BUDGET, SUPERVISOR];
}

/// How often, and how fast, a supervisor restarts a child before it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window`; the next crash escalates.
    pub max_restarts: u32,
    /// The window over which restarts are counted.
    pub window: Duration,
    /// Delay before the second restart within the window (the first is immediate, so a
    /// one-off bug costs nothing); it doubles with each further one.
    pub backoff: Duration,
    /// The longest delay.
    pub max_backoff: Duration,
}

impl RestartPolicy {
    /// Model queues: a queue is cheap to rebuild, but one crashing in a loop means a bug
    /// that a fresh queue supervisor (all queues rebuilt) should get a chance to clear.
    pub const QUEUES: Self = Self {
        max_restarts: 5,
        window: Duration::from_secs(60),
        backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(5),
    };

    /// Child supervisors under the root: past this the subsystem is reported down.
    pub const SUPERVISORS: Self = Self {
        max_restarts: 3,
        window: Duration::from_secs(300),
        backoff: Duration::from_millis(500),
        max_backoff: Duration::from_secs(10),
    };
}

/// Recent crashes of one child, against its [`RestartPolicy`].
#[derive(Debug, Clone, Default)]
pub struct RestartWindow {
    crashes: VecDeque<Instant>,
}

impl RestartWindow {
    /// Records a crash at `now`: the delay before the restart, or `None` when the policy's
    /// budget for the window is spent (escalate).
    pub fn record(&mut self, now: Instant, policy: &RestartPolicy) -> Option<Duration> {
        while self
            .crashes
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > policy.window)
        {
            self.crashes.pop_front();
        }
        self.crashes.push_back(now);
        let n = u32::try_from(self.crashes.len()).unwrap_or(u32::MAX);
        if n > policy.max_restarts {
            return None;
        }
        if n <= 1 {
            return Some(Duration::ZERO);
        }
        let factor = 1u32.checked_shl(n - 2).unwrap_or(u32::MAX);
        Some(
            policy
                .backoff
                .saturating_mul(factor)
                .min(policy.max_backoff),
        )
    }
}

/// A future a [`ChildSpec`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One child supervisor of the root: how to start it (again), and what to do when the root
/// gives up on it. The root holds these generically, so a new kind of actor (team budgets)
/// joins the tree with one [`Spec`].
pub trait ChildSpec: Send + Sync + fmt::Debug + 'static {
    /// Its name in logs and in [`Supervision::down`].
    fn name(&self) -> &'static str;
    /// Spawns it linked to `root`.
    fn start(&self, root: ActorCell) -> BoxFuture<'_, Result<ActorCell, SpawnErr>>;
    /// The root stopped restarting it: its handles should refuse at once (typed), never hang.
    fn abandon(&self) {}
}

/// A [`ChildSpec`] from an actor whose arguments can be cloned for each start.
pub struct Spec<A: Actor> {
    name: &'static str,
    actor: A,
    args: A::Arguments,
    on_abandon: Option<Box<dyn Fn() + Send + Sync>>,
}

impl<A: Actor> fmt::Debug for Spec<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Spec").field("name", &self.name).finish()
    }
}

impl<A> Spec<A>
where
    A: Actor + Clone + Sync,
    A::Arguments: Clone + Sync,
{
    /// Starts `actor` with a clone of `args` each time.
    pub fn new(name: &'static str, actor: A, args: A::Arguments) -> Self {
        Self {
            name,
            actor,
            args,
            on_abandon: None,
        }
    }

    /// Runs `f` when the root gives up on the child.
    pub fn on_abandon(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_abandon = Some(Box::new(f));
        self
    }
}

impl<A> ChildSpec for Spec<A>
where
    A: Actor + Clone + Sync,
    A::Arguments: Clone + Sync,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn start(&self, root: ActorCell) -> BoxFuture<'_, Result<ActorCell, SpawnErr>> {
        Box::pin(async move {
            let (actor, _) =
                Actor::spawn_linked(None, self.actor.clone(), self.args.clone(), root).await?;
            Ok(actor.get_cell())
        })
    }

    fn abandon(&self) {
        if let Some(f) = &self.on_abandon {
            f();
        }
    }
}

/// What the tree is built from.
#[derive(Debug)]
pub struct SupervisionArgs {
    /// The ledger (generations release a crashed one's row there).
    pub ledger: Arc<dyn Ledger>,
    /// Every model's queue.
    pub queues: Vec<QueueArgs>,
    /// Model queues' restart policy.
    pub queue_policy: RestartPolicy,
    /// Child supervisors' restart policy (under the root).
    pub supervisor_policy: RestartPolicy,
    /// More child supervisors, started after the built-in ones (the server adds the team
    /// budgets' `BudgetSupervisor`).
    pub extra: Vec<Box<dyn ChildSpec>>,
}

/// Child supervisors the root has given up on, by name (shared with the root).
type Down = Arc<Mutex<BTreeSet<&'static str>>>;

/// The running tree and the handles into it; cloneable handles stay valid across restarts.
#[derive(Debug)]
pub struct Supervision {
    root: ActorRef<RootMsg>,
    /// Starts generations.
    pub generations: Generations,
    /// Every model's queue, by model.
    pub queues: BTreeMap<String, ModelQueueHandle>,
    /// Starts node actors.
    pub nodes: Nodes,
    down: Down,
}

impl Supervision {
    /// Builds the tree: the root, then under it the generations', the nodes' and the
    /// queues' supervisors (in that order: a queue rebuilds itself from the nodes), then
    /// `extra`. Returns once every child is running.
    pub async fn start(args: SupervisionArgs) -> Result<Self, SpawnErr> {
        let directory = Directory::default();
        let (generations, generation_args) =
            Generations::unstarted(args.ledger.clone(), directory.clone());
        let nodes = Nodes::new(directory.clone());
        let queues: BTreeMap<String, ModelQueueHandle> = args
            .queues
            .iter()
            .map(|q| {
                (
                    q.model.clone(),
                    ModelQueueHandle::new(q.model.clone(), None),
                )
            })
            .collect();
        let queue_args = queues::QueueSupervisorArgs {
            queues: args
                .queues
                .into_iter()
                .filter_map(|a| queues.get(&a.model).map(|h| (a, h.clone())))
                .collect(),
            nodes: nodes.clone(),
            directory: directory.clone(),
            policy: args.queue_policy,
        };
        let abandoned_queues = queues::abandon_all(queue_args.clone());
        let mut children: Vec<Box<dyn ChildSpec>> = vec![
            Box::new(Spec::new(
                "generations",
                GenerationSupervisor,
                generation_args,
            )),
            Box::new(Spec::new("nodes", NodeSupervisor, nodes.args())),
            Box::new(
                Spec::new("model_queues", QueueSupervisor, queue_args).on_abandon(abandoned_queues),
            ),
        ];
        children.extend(args.extra);
        let down = Down::default();
        let (root, _) = Actor::spawn(
            None,
            RootSupervisor,
            root::RootArgs {
                children,
                policy: args.supervisor_policy,
                down: down.clone(),
            },
        )
        .await?;
        Ok(Self {
            root,
            generations,
            queues,
            nodes,
            down,
        })
    }

    /// Child supervisors the root gave up on (empty when the tree is whole): readiness.
    pub fn down(&self) -> Vec<&'static str> {
        self.down
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }

    /// Stops the tree: every supervisor, and with them every actor still running.
    pub fn stop(&self) {
        self.root.stop(None);
    }
}

/// Test-only fault hooks: the messages that make an actor panic call this.
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) mod fault {
    /// Panics as a bug in an actor's handler would.
    #[allow(clippy::panic)]
    pub(crate) fn inject(what: &str) -> ! {
        panic!("fault injected into the {what} actor")
    }
}
