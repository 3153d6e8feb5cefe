//! One replica's actors, wired the one way every replica wires them: the supervision tree
//! with each model's queue as a member of the cluster (one owner per queue, grants), the team
//! budgets with cluster-wide ownership, the node view, and the launcher that starts
//! generations. `switchyard serve` puts its HTTP layer and storage around it; the
//! deterministic simulation (`tests/dst.rs`) puts simulated links and clients around it.

use std::sync::Arc;
use std::time::Duration;

use ractor::SpawnErr;
use tokio_util::sync::CancellationToken;

use crate::budget::{BudgetCluster, BudgetConfig, BudgetSupervisor, TeamBudgets};
use crate::cluster::{Epoch, NodeShared, NodeView, spawn_epoch_watch, spawn_view};
use crate::generation::{Launcher, StreamBound, Timeouts};
use crate::lifecycle::GenerationStore;
use crate::model_queue::{QueueArgs, QueueCluster, QueueConfig};
use crate::node::NodeTrust;
use crate::ports::{Clock, Coordinator, Ledger, NodeAccounting};
use crate::supervision::{RestartPolicy, Spec, Supervision, SupervisionArgs};

/// What a replica's actors are made of.
#[derive(Debug)]
pub struct ReplicaArgs {
    /// This replica's id in the cluster (owner of leases, address of its channels).
    pub replica_id: String,
    /// The ledger (the store).
    pub ledger: Arc<dyn Ledger>,
    /// Generation records, when the replica keeps them.
    pub lifecycle: Option<Arc<dyn GenerationStore>>,
    /// Cluster coordination.
    pub coordinator: Arc<dyn Coordinator>,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// Each served model and its queue's configuration.
    pub models: Vec<(String, QueueConfig)>,
    /// How long an owner's lease (a queue's, a team budget's) lasts unrenewed.
    pub lease_ttl: Duration,
    /// The budget actors' batching.
    pub budget: BudgetConfig,
    /// A node silent this long is lost.
    pub heartbeat_timeout: Duration,
    /// How many protocol violations a node may commit.
    pub trust: NodeTrust,
    /// Generations' deadlines.
    pub timeouts: Timeouts,
    /// How far behind a stream's reader may fall.
    pub bound: StreamBound,
    /// How long a finished generation's result (and journal) is kept.
    pub retention: Duration,
    /// Where node sockets' heartbeats are accounted per node and day (`None`: nowhere).
    pub accounting: Option<Arc<dyn NodeAccounting>>,
}

/// A replica's running actors.
#[derive(Debug)]
pub struct ReplicaActors {
    /// The supervision tree (generations, nodes, queues, the team budgets' supervisor).
    pub supervision: Supervision,
    /// The team budgets, through which rows are reserved.
    pub budgets: Arc<TeamBudgets>,
    /// The budget ownership of the cluster.
    budget_cluster: Arc<BudgetCluster>,
    /// The replica's node actors: local sockets and proxies.
    pub view: Arc<NodeView>,
    /// Starts generations.
    pub launcher: Launcher,
}

impl ReplicaActors {
    /// Starts the tree; each queue has had its first try at its lease when this returns, so
    /// a replica starting alone (or first) owns its queues from its first request on.
    pub async fn start(args: ReplicaArgs) -> Result<Self, SpawnErr> {
        let (budgets, budget_args) =
            TeamBudgets::unstarted(args.ledger.clone(), args.clock.clone(), args.budget);
        let budget_cluster = Arc::new(BudgetCluster::new(
            args.coordinator.clone(),
            args.replica_id.clone(),
            args.lease_ttl,
            args.clock.clone(),
        ));
        let budgets = Arc::new(budgets.in_cluster(budget_cluster.clone()));
        let members: Vec<(String, Arc<QueueCluster>)> = args
            .models
            .iter()
            .map(|(model, _)| {
                let member = QueueCluster::new(
                    args.coordinator.clone(),
                    args.replica_id.clone(),
                    args.lease_ttl,
                );
                (model.clone(), Arc::new(member))
            })
            .collect();
        let supervision = Supervision::start(SupervisionArgs {
            ledger: args.ledger.clone(),
            queues: args
                .models
                .iter()
                .zip(&members)
                .map(|((model, config), (_, member))| QueueArgs {
                    model: model.clone(),
                    config: config.clone(),
                    clock: args.clock.clone(),
                    cluster: Some(member.clone()),
                })
                .collect(),
            queue_policy: RestartPolicy::QUEUES,
            supervisor_policy: RestartPolicy::SUPERVISORS,
            extra: vec![Box::new(Spec::new(
                "team_budgets",
                BudgetSupervisor,
                budget_args,
            ))],
        })
        .await?;
        for (model, member) in &members {
            if let Some(queue) = supervision.queues.get(model) {
                member.spawn(queue.clone(), args.clock.clone()).await;
            }
        }
        let view = Arc::new(NodeView::new(
            NodeShared {
                replica_id: args.replica_id.clone(),
                queues: supervision.queues.clone(),
                directory: supervision.generations.directory().clone(),
                ledger: args.ledger.clone(),
                lifecycle: args.lifecycle.clone(),
                coordinator: args.coordinator.clone(),
                heartbeat_timeout: args.heartbeat_timeout,
                clock: args.clock.clone(),
                trust: args.trust,
                accounting: args.accounting.clone(),
                capacity: args
                    .models
                    .iter()
                    .map(|(model, config)| (model.clone(), config.node_capacity))
                    .collect(),
            },
            supervision.nodes.clone(),
        ));
        let launcher = Launcher {
            generations: supervision.generations.clone(),
            ledger: budgets.clone(),
            timeouts: args.timeouts,
            bound: args.bound,
            retention: args.retention,
            clock: args.clock,
            coordinator: args.coordinator,
            replica_id: args.replica_id.clone(),
        };
        Ok(Self {
            supervision,
            budgets,
            budget_cluster,
            view,
            launcher,
        })
    }

    /// Joins the cluster until `stop`: the node view hears the owners' announcements and
    /// relayed frames, the team budgets take and serve their leases, and the coordinator's
    /// epoch is watched (after a loss of its data the live generations record themselves
    /// again).
    pub async fn join(&self, stop: CancellationToken) {
        let launcher = &self.launcher;
        let epoch = Epoch::new(
            launcher.coordinator.clone(),
            &launcher.replica_id,
            launcher.clock.as_ref(),
        );
        spawn_epoch_watch(
            epoch,
            self.supervision.generations.directory().clone(),
            stop.clone(),
        );
        spawn_view(&self.view, stop).await;
        self.budget_cluster.spawn(self.budgets.clone()).await;
    }
}
