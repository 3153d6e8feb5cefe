//! The [`ModelQueueActor`]: bounded queue, deadlines, dispatch. It runs under the model
//! queue supervisor (`crate::supervision`), which restarts it after a crash and rebuilds its
//! nodes and waiting generations from the node actors and the generations themselves.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use super::cluster::QueueCluster;
use super::line::{Lane, Line, Ticket};
use super::msg::{ModelQueueHandle, NodeReport, QueueMsg, QueueStats, Slot};
use super::routing::{NodeView, RouteKey, Router, RoutingStrategy};
use crate::error::{ErrorCode, Failure};
use crate::generation::GenerationMsg;
use crate::metric_names::{EARLY_REFUSALS_TOTAL, QUEUE_DEPTH, QUEUE_DISPATCHES_TOTAL};
use crate::node::{NodeHandle, NodeLoad};
use crate::ports::Clock;
use crate::protocol::Api;
use crate::tasks::TaskGuard;
use crate::tier::{Policy, Tier};

/// How often deadlines are checked.
const TICK: Duration = Duration::from_millis(100);
/// How long after its last node left a model still takes requests (they wait in the queue,
/// up to its deadline): the nodes of a replica that died, or of a restarted engine, reconnect
/// within seconds, and the requests meanwhile should wait for them, not fail.
pub const NODES_RETURN_WITHIN: Duration = Duration::from_secs(10);
/// Dispatches counted for the drain rate behind `Retry-After`.
const RATE_WINDOW: Duration = Duration::from_secs(30);

/// Limits of one model's queue.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueConfig {
    /// Most generations waiting at once; more get `queue_full`.
    pub max_waiting: usize,
    /// Most tokens of work waiting at once (prompts and output ceilings); more get
    /// `queue_full`.
    pub max_waiting_tokens: u64,
    /// Who goes next when the nodes are full, and how long each tier may wait (past its
    /// budget: `capacity_exhausted`).
    pub policy: Policy,
    /// Assignments one node may carry at once for this model.
    pub node_capacity: u32,
    /// How to pick among nodes with room.
    pub routing: RoutingStrategy,
    /// KV blocks one node's cache holds (the size of its prefix index for `cache_aware`).
    pub cache_blocks: usize,
}

/// What a model queue starts with (kept by its supervisor to start it again).
#[derive(Debug, Clone)]
pub struct QueueArgs {
    /// The model (its resolved name).
    pub model: String,
    /// Limits.
    pub config: QueueConfig,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// In a cluster, the lease and channels that make one replica's queue the owner; `None`
    /// runs the queue alone (one replica, or tests).
    pub cluster: Option<Arc<QueueCluster>>,
}

/// Whose generation waits: this replica's, or another's (in a cluster, the owner holds the
/// waiting generations of every replica).
#[derive(Debug)]
pub(super) enum Waiter {
    /// A generation on this replica.
    Local(ActorRef<GenerationMsg>),
    /// A generation on another replica, reached through [`crate::cluster::from_queue`].
    Remote(String),
}

/// How a generation joins the line, besides who it is.
#[derive(Debug)]
pub(super) struct Join {
    /// A retry goes to the head.
    pub(super) front: bool,
    /// A retry's failed node: another one is preferred.
    pub(super) avoid: Option<String>,
    /// The engine API it needs.
    pub(super) api: Api,
    /// Its prompt, for routing.
    pub(super) route: Option<Arc<RouteKey>>,
    /// How long it waited already (in an earlier owner's queue, or forwarded).
    pub(super) waited: Duration,
    /// Its tier, team and work, for the line's order.
    pub(super) ticket: Ticket,
}

#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) request_id: String,
    pub(super) waiter: Waiter,
    /// When it entered a queue of this model (on its replica, or an earlier owner's): the
    /// order it is served in, and where its deadline runs from.
    pub(super) arrived: Instant,
    pub(super) deadline: Instant,
    /// A retry's failed node: another one is preferred.
    pub(super) avoid: Option<String>,
    /// The engine API it needs.
    pub(super) api: Api,
    /// Its prompt, for routing.
    pub(super) route: Option<Arc<RouteKey>>,
    /// Times a later waiter went first to a node holding more of its prompt
    /// ([`Router::pick`]).
    pub(super) passed: u32,
    /// Its tier, team and work, for the line's order.
    pub(super) ticket: Ticket,
}

#[derive(Debug)]
pub(super) struct NodeEntry {
    pub(super) handle: NodeHandle,
    /// Assignments running on it by replica (this replica's under its own id); only this
    /// replica's are known unless it owns the queue.
    pub(super) running: BTreeMap<String, u32>,
    pub(super) load: NodeLoad,
    pub(super) draining: bool,
    /// Its engine refused work twice in a row; back with its next heartbeat.
    pub(super) suspended: bool,
    /// As the owner: slots granted to each follower (taken until they come back).
    pub(super) granted: BTreeMap<String, u32>,
    /// As the owner: when its grants were last recalled (none since).
    pub(super) recalled: Option<Instant>,
    /// Slots taken lately, which the node's socket may not show yet ([`super::carried`]).
    pub(super) recent: super::carried::Recent,
    /// Its socket refused an `assign` for want of room: it counts as full until one of its
    /// slots comes back or its socket speaks again ([`super::carried::Word`]).
    pub(super) full: bool,
}

impl NodeEntry {
    fn new(handle: NodeHandle, load: NodeLoad) -> Self {
        Self {
            handle,
            running: BTreeMap::new(),
            load,
            draining: false,
            suspended: false,
            granted: BTreeMap::new(),
            recalled: None,
            recent: super::carried::Recent::default(),
            full: false,
        }
    }

    /// Takes new work at all (room aside).
    pub(super) fn routable(&self) -> bool {
        !self.draining && !self.suspended
    }

    /// Assignments it carries, as far as this replica knows.
    pub(super) fn in_flight(&self) -> u32 {
        self.running.values().fold(0, |a, b| a.saturating_add(*b))
    }

    /// Its slots taken: the assignments it carries and, as the owner, the grants out.
    pub(super) fn load(&self) -> u32 {
        self.granted
            .values()
            .fold(self.in_flight(), |a, b| a.saturating_add(*b))
    }

    /// Its slots taken, of `capacity`: all of them while it counts as full.
    pub(super) fn taken(&self, capacity: u32) -> u32 {
        if self.full {
            self.load().max(capacity)
        } else {
            self.load()
        }
    }

    /// What the chooser sees of it (as node `id`, of `capacity`).
    pub(super) fn view<'a>(&'a self, id: &'a str, capacity: u32) -> NodeView<'a> {
        NodeView {
            node_id: id,
            in_flight: self.taken(capacity),
            capacity,
            kv_cache_usage: self.load.kv_cache_usage,
            engine_waiting: self.load.queue_depth,
        }
    }

    /// One more of `replica`'s, taken at `now`.
    pub(super) fn take(&mut self, replica: &str, now: Instant) {
        *self.running.entry(replica.to_owned()).or_default() += 1;
        self.recent.took(replica, now);
    }

    /// One fewer of `replica`'s.
    pub(super) fn give_back(&mut self, replica: &str) {
        if let Some(n) = self.running.get_mut(replica) {
            *n = n.saturating_sub(1);
        }
        self.full = false;
    }
}

/// The actor's state.
#[derive(Debug)]
pub struct QueueState {
    pub(super) args: QueueArgs,
    /// The waiting generations, in the order the policy serves them.
    pub(super) line: Line,
    /// Nodes by id (ordered, so choice is deterministic).
    pub(super) nodes: BTreeMap<String, NodeEntry>,
    /// Recent dispatch times, for the drain rate.
    dispatches: VecDeque<Instant>,
    /// Tokens of work dispatched while work waited: when a newcomer would start.
    throughput: super::predict::Throughput,
    /// Node choice, with what it knows of each node's cache.
    pub(super) router: Router,
    ticker: Option<ractor::concurrency::JoinHandle<()>>,
    /// When a routable node was last seen (checked every tick).
    nodes_seen: Option<Instant>,
    /// This replica's id in [`NodeEntry::running`].
    pub(super) me: String,
    /// In a cluster: the lease, the owner, what was forwarded to it.
    pub(super) cluster: Option<super::follow::Membership>,
    /// Work still counted on nodes that left (see [`super::departed`]).
    pub(super) departed: super::departed::Departed,
    /// This actor: the queue a dispatch's [`Slot`] goes back to.
    pub(super) myself: ActorRef<QueueMsg>,
    _guard: TaskGuard,
}

/// The failed node a retry avoids, while another routable node of `nodes` could run it.
fn avoided<'a>(
    nodes: &BTreeMap<String, NodeEntry>,
    avoid: Option<&'a str>,
    api: Api,
) -> Option<&'a str> {
    avoid.filter(|a| {
        nodes
            .iter()
            .any(|(id, n)| id.as_str() != *a && n.routable() && n.handle.speaks(api))
    })
}

/// The nodes of `nodes` (of `capacity` each) with room for a waiter of `api` avoiding `avoid`.
fn room_for<'a>(
    nodes: &'a BTreeMap<String, NodeEntry>,
    capacity: u32,
    avoid: Option<&str>,
    api: Api,
) -> Vec<NodeView<'a>> {
    let avoid = avoided(nodes, avoid, api);
    nodes
        .iter()
        .filter(|(id, n)| {
            n.routable()
                && n.taken(capacity) < capacity
                && Some(id.as_str()) != avoid
                && n.handle.speaks(api)
        })
        .map(|(id, n)| n.view(id, capacity))
        .collect()
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelQueueActor;

impl ModelQueueActor {
    /// Starts a model's queue with no supervisor (tests; the server starts queues through
    /// `crate::supervision`).
    pub async fn start(args: QueueArgs) -> Result<ModelQueueHandle, ractor::SpawnErr> {
        let model = args.model.clone();
        let (actor, _) = Actor::spawn(None, ModelQueueActor, args).await?;
        Ok(ModelQueueHandle::new(model, Some(actor)))
    }

    /// Starts a model's queue linked to `supervisor`, which hears of its crash.
    pub(crate) async fn start_linked(
        args: QueueArgs,
        supervisor: ActorCell,
    ) -> Result<ActorRef<QueueMsg>, ractor::SpawnErr> {
        let (actor, _) = Actor::spawn_linked(None, ModelQueueActor, args, supervisor).await?;
        Ok(actor)
    }
}

impl Actor for ModelQueueActor {
    type Msg = QueueMsg;
    type State = QueueState;
    type Arguments = QueueArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<QueueMsg>,
        args: QueueArgs,
    ) -> Result<QueueState, ActorProcessingErr> {
        let ticker = myself.send_interval(TICK, || QueueMsg::Tick);
        let (me, cluster) = match &args.cluster {
            Some(c) => (
                c.replica_id.clone(),
                Some(super::follow::Membership::new(
                    c.clone(),
                    myself.clone(),
                    &args.model,
                    args.clock.now(),
                )),
            ),
            None => (String::new(), None),
        };
        let router = Router::new(args.config.routing, args.config.cache_blocks);
        let line = Line::new(args.config.policy.clone());
        Ok(QueueState {
            args,
            line,
            nodes: BTreeMap::new(),
            dispatches: VecDeque::new(),
            throughput: super::predict::Throughput::default(),
            router,
            ticker: Some(ticker),
            nodes_seen: None,
            me,
            cluster,
            departed: super::departed::Departed::default(),
            myself,
            _guard: TaskGuard::new("model_queue"),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<QueueMsg>,
        msg: QueueMsg,
        state: &mut QueueState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            QueueMsg::Enqueue {
                request_id,
                generation,
                front,
                avoid,
                api,
                route,
                ticket,
                reply,
            } => {
                let join = Join {
                    front,
                    avoid,
                    api,
                    route,
                    waited: Duration::ZERO,
                    ticket,
                };
                state.enqueue(request_id, generation, join, reply);
            }
            QueueMsg::Withdraw { request_id } => {
                if state.follows() {
                    state.withdraw_forwarded(&request_id);
                } else {
                    state.line.remove_if(|w| {
                        w.request_id == request_id && matches!(w.waiter, Waiter::Local(_))
                    });
                }
            }
            QueueMsg::NodeUp(handle, load) => {
                let id = handle.node_id().to_owned();
                let entry = NodeEntry::new(handle, load);
                state.replace_node(id, entry);
                state.dispatch();
            }
            QueueMsg::NodeRejoin(report) => state.node_rejoined(report),
            QueueMsg::NodeDown(node) => state.node_down(&node),
            QueueMsg::NodeLoad(id, load) => {
                if let Some(n) = state.nodes.get_mut(&id) {
                    n.load = load;
                }
            }
            QueueMsg::NodeCarries(id, carried, word) => state.node_carries(&id, &carried, word),
            QueueMsg::Released(id) => {
                let me = state.me.clone();
                state.give_back(&id, &me);
                if state.follows() {
                    if !state.release_granted(&id) {
                        state.tell_owner(crate::cluster::QueueItem::Released { node_id: id });
                    }
                } else {
                    state.dispatch();
                }
            }
            QueueMsg::NodeDraining(id) => {
                if let Some(n) = state.nodes.get_mut(&id) {
                    n.draining = true;
                }
            }
            QueueMsg::NodeSuspended(id, suspended) => {
                if let Some(n) = state.nodes.get_mut(&id) {
                    n.suspended = suspended;
                }
                state.dispatch();
            }
            QueueMsg::Tick => state.tick(),
            QueueMsg::Role(role) => {
                state.role(role);
                state.dispatch();
            }
            QueueMsg::Owner(owner) => state.owner_heard(owner),
            QueueMsg::Remote(asked) => {
                state.remote(asked);
                state.dispatch();
            }
            QueueMsg::Replies(replies) => state.replies(replies),
            QueueMsg::OwnerGone(fence, incarnation) => state.owner_gone(fence, incarnation),
            QueueMsg::ReplicaGone(replica) => state.forget_replica(&replica),
            QueueMsg::Stats(reply) => {
                let _ = reply.send(state.stats());
            }
            #[cfg(any(test, feature = "fault-injection"))]
            QueueMsg::Crash => crate::supervision::fault::inject("model queue"),
        }
        Ok(())
    }

    async fn post_start(
        &self,
        _myself: ActorRef<QueueMsg>,
        state: &mut QueueState,
    ) -> Result<(), ActorProcessingErr> {
        state.publish_depth();
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<QueueMsg>,
        state: &mut QueueState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        for w in state.line.drain() {
            if let Waiter::Local(generation) = w.waiter {
                let _ = generation.cast(GenerationMsg::QueueTimeout);
            }
        }
        state.stop_forwarded();
        Ok(())
    }
}

impl QueueState {
    /// A live node announces itself again to a restarted queue, with the work it carries.
    fn node_rejoined(&mut self, report: NodeReport) {
        let NodeReport {
            node,
            load,
            in_flight,
            draining,
            suspended,
        } = report;
        let id = node.node_id().to_owned();
        let mut entry = NodeEntry::new(node, load);
        entry.running.insert(self.me.clone(), in_flight);
        entry.draining = draining;
        entry.suspended = suspended;
        self.replace_node(id, entry);
        self.dispatch();
    }

    /// A node's connection ended: its entry goes (only this connection's: a node that already
    /// reconnected keeps its new one), its work still counted until it ends.
    fn node_down(&mut self, node: &NodeHandle) {
        let id = node.node_id();
        if !self
            .nodes
            .get(id)
            .is_some_and(|n| n.handle.same_actor(node))
        {
            return;
        }
        if let Some(old) = self.nodes.remove(id) {
            self.departed.keep(id, &old);
        }
        self.router.forget(id);
        self.node_left(id);
    }

    /// Every 100 ms: note the nodes seen and the service rate, expire deadlines, dispatch.
    fn tick(&mut self) {
        let now = self.args.clock.now();
        let serving = self.live_nodes();
        if serving > 0 {
            self.nodes_seen = Some(now);
        }
        self.throughput.tick(now, !self.line.is_empty(), serving);
        self.expire();
        self.expire_forwarded();
        self.dispatch();
    }

    /// A node (re)joins: a new actor for a node already here keeps the slots lent of it
    /// (the followers still hold them), and whatever still runs there from before, here or
    /// away, stays counted until it ends.
    fn replace_node(&mut self, id: String, mut entry: NodeEntry) {
        // A new connection may be a restarted engine: its cache is not assumed.
        self.router.forget(&id);
        if let Some(old) = self.nodes.remove(&id) {
            entry.granted.clone_from(&old.granted);
            entry.recalled = old.recalled;
            self.departed.keep(&id, &old);
        }
        self.departed.restore(&id, &mut entry);
        self.nodes.insert(id, entry);
    }

    fn live_nodes(&self) -> usize {
        self.nodes.values().filter(|n| n.routable()).count()
    }

    /// Why no node could take work of `api` now, if none could.
    pub(super) fn unroutable(&self, api: Api) -> Option<Failure> {
        let model = &self.args.model;
        if self.live_nodes() == 0 {
            let now = self.args.clock.now();
            if self
                .nodes_seen
                .is_some_and(|at| now.saturating_duration_since(at) < NODES_RETURN_WITHIN)
            {
                // Its nodes left moments ago: they are likely on their way back.
                return None;
            }
            return Some(
                Failure::new(
                    ErrorCode::NoHealthyNode,
                    format!("No healthy node serves {model} right now."),
                )
                .retry_after(5),
            );
        }
        if !self.nodes.values().any(|n| n.handle.speaks(api)) {
            // Mid-upgrade: only older agents serve the model, and they cannot run this API.
            return Some(
                Failure::new(
                    ErrorCode::NoHealthyNode,
                    format!(
                        "No node serving {model} runs an agent that supports {} yet.",
                        api.path()
                    ),
                )
                .retry_after(5),
            );
        }
        None
    }

    /// A generation of this replica asks for a node: as a follower it starts on a grant or
    /// goes to the owner; deciding, it joins the line and the line moves.
    fn enqueue(
        &mut self,
        request_id: String,
        generation: ActorRef<GenerationMsg>,
        join: Join,
        reply: ractor::RpcReplyPort<Result<(), Failure>>,
    ) {
        if self.follows() {
            if !self.is_forwarded(&request_id)
                && self.start_on_grant(
                    &generation,
                    join.avoid.as_deref(),
                    join.api,
                    join.route.as_deref(),
                )
            {
                let _ = reply.send(Ok(()));
            } else {
                let asked = super::follow::Asked {
                    generation,
                    front: join.front,
                    avoid: join.avoid,
                    api: join.api,
                    route: join.route,
                    ticket: join.ticket,
                };
                self.forward(request_id, asked, reply);
            }
            return;
        }
        let verdict = self.admit(request_id, Waiter::Local(generation), join);
        let _ = reply.send(verdict);
        self.dispatch();
    }

    /// Admits a generation to the queue, or says why not.
    pub(super) fn admit(
        &mut self,
        request_id: String,
        waiter: Waiter,
        join: Join,
    ) -> Result<(), Failure> {
        // Already waiting: a generation re-queued after a restart may have entered the new
        // queue before it heard of the restart. One entry, one dispatch.
        if self.line.contains(&request_id) {
            return Ok(());
        }
        if let Some(failure) = self.unroutable(join.api) {
            return Err(failure);
        }
        // One that waited already (sent again to a new owner) was admitted to wait once and
        // keeps its place; only a newcomer finds the line full, or is refused for its wait.
        if !join.front && join.waited.is_zero() {
            self.room_in_line(&join.ticket)?;
        }
        let now = self.args.clock.now();
        let arrived = now.checked_sub(join.waited).unwrap_or(now);
        let entry = Waiting {
            request_id,
            waiter,
            arrived,
            deadline: arrived + self.budget(join.ticket.tier),
            avoid: join.avoid,
            api: join.api,
            route: join.route,
            passed: 0,
            ticket: join.ticket,
        };
        // A retry at the head, anything else behind every waiter of its lane that arrived
        // before it — so the generations a new owner gets from every replica keep the order
        // they came in, and none waits out its budget behind newer ones.
        self.line.push(entry, join.front);
        Ok(())
    }

    /// Whether a newcomer with `ticket` may wait: the line has room (in requests and in
    /// tokens), and the work before it would let it start within its tier's budget.
    fn room_in_line(&self, ticket: &Ticket) -> Result<(), Failure> {
        let model = &self.args.model;
        let full = self.line.len() >= self.args.config.max_waiting
            || self.line.tokens().saturating_add(ticket.cost) > self.args.config.max_waiting_tokens;
        if full {
            let wait = self.retry_after_secs();
            return Err(Failure::new(
                ErrorCode::QueueFull,
                format!("The queue of {model} is full; retry in about {wait} s."),
            )
            .retry_after(wait));
        }
        let budget = self.budget(ticket.tier);
        let Some(wait) = self.predicted_wait(ticket) else {
            return Ok(());
        };
        if wait <= budget {
            return Ok(());
        }
        metrics::counter!(
            EARLY_REFUSALS_TOTAL,
            "model" => model.clone(),
            "tier" => ticket.tier.as_str(),
        )
        .increment(1);
        let after = (wait - budget).as_secs().clamp(1, 600);
        Err(Failure::new(
            ErrorCode::CapacityExhausted,
            format!(
                "The work waiting for {model} would start this request in about {} s, past the \
                 {} tier's queue budget of {} s; retry in about {after} s.",
                wait.as_secs(),
                ticket.tier,
                budget.as_secs()
            ),
        )
        .retry_after(after))
    }

    /// When a newcomer with `ticket` would start, from the work before it and the measured
    /// service rate (`None` while there is no rate, or nothing waits).
    fn predicted_wait(&self, ticket: &Ticket) -> Option<Duration> {
        if self.line.is_empty() {
            return None;
        }
        let per_node = self.throughput.rate_per_node(self.args.clock.now())?;
        let rate = per_node * self.live_nodes().max(1) as f64;
        Some(super::predict::wait_for(self.line.work_ahead(ticket), rate))
    }

    /// How long a generation of `tier` may wait for a node.
    pub(super) fn budget(&self, tier: Tier) -> Duration {
        self.args.config.policy.of(tier).budget
    }

    /// When the queue, draining at its measured rate, will have room again.
    fn retry_after_secs(&self) -> u64 {
        let rate = self.drain_rate().max(0.1);
        let secs = (self.line.len() as f64 / rate).ceil();
        (secs as u64).clamp(1, 60)
    }

    fn drain_rate(&self) -> f64 {
        let now = self.args.clock.now();
        let recent = self
            .dispatches
            .iter()
            .filter(|t| now.saturating_duration_since(**t) <= RATE_WINDOW)
            .count();
        recent as f64 / RATE_WINDOW.as_secs_f64()
    }

    /// `switchyard_queue_depth`: the signal that scales a model up, from zero too (only the
    /// owner holds waiting generations, so the sum over replicas counts each once).
    fn publish_depth(&self) {
        metrics::gauge!(QUEUE_DEPTH, "model" => self.args.model.clone())
            .set(self.line.len() as f64);
    }

    /// Hands waiting generations to nodes with room, head first — while this replica may
    /// decide (it runs alone, or holds the queue's lease).
    pub(super) fn dispatch(&mut self) {
        if self.decides() {
            self.dispatch_waiting();
            self.share_capacity();
        }
        self.publish_depth();
    }

    /// In the line's order; a waiter that may not go to the only nodes with room (a retry
    /// avoiding its failed node, an API only some agents run) is set aside for this round, and
    /// the generations behind it may go first.
    fn dispatch_waiting(&mut self) {
        let mut aside: Vec<(Lane, Waiting)> = Vec::new();
        while let Some(lane) = self.line.head() {
            let Some(head) = self.line.lane(lane).next() else {
                break;
            };
            let (avoid, api) = (head.avoid.clone(), head.api);
            let capacity = self.args.config.node_capacity;
            let candidates = room_for(&self.nodes, capacity, avoid.as_deref(), api);
            let route = head.route.clone();
            let Some(chosen) = self.router.choose(route.as_deref(), &candidates) else {
                // No room: room lent to followers comes back.
                let now = self.args.clock.now();
                let avoid = avoided(&self.nodes, avoid.as_deref(), api).map(str::to_owned);
                self.recall(api, avoid.as_deref(), now);
                if avoid.is_some() || api != Api::Chat {
                    if let Some(w) = self.line.take(lane, 0, false) {
                        aside.push((lane, w));
                    }
                    continue;
                }
                break;
            };
            let node_id = candidates[chosen].node_id.to_owned();
            let j = self.better_waiter(lane, &node_id);
            let Some(w) = self.line.take(lane, j, true) else {
                break;
            };
            self.send_to(w, &node_id);
            if j != 0
                && let Some(passed) = self.line.head_mut(lane)
            {
                passed.passed += 1;
            }
        }
        for (lane, w) in aside.into_iter().rev() {
            self.line.put_back(lane, w);
        }
    }

    /// Sends `w` to `node_id`, counted against the node now (a dispatch that does not arrive
    /// gives its slot back).
    fn send_to(&mut self, w: Waiting, node_id: &str) {
        self.router.placed(node_id, w.route.as_deref());
        let sent = match &w.waiter {
            Waiter::Local(generation) => {
                let Some(entry) = self.nodes.get_mut(node_id) else {
                    return;
                };
                entry.take(&self.me, self.args.clock.now());
                let msg = GenerationMsg::Dispatch {
                    node: entry.handle.clone(),
                    slot: Slot::new(self.myself.clone(), node_id),
                };
                generation.cast(msg).is_ok()
            }
            Waiter::Remote(replica) => {
                let replica = replica.clone();
                self.dispatch_remote(&replica, w.request_id, node_id)
            }
        };
        if sent {
            self.throughput.dispatched(w.ticket.cost);
            metrics::counter!(
                QUEUE_DISPATCHES_TOTAL,
                "model" => self.args.model.clone(),
                "tier" => w.ticket.tier.as_str(),
                "team" => w.ticket.team.to_string(),
            )
            .increment(1);
            let now = self.args.clock.now();
            self.dispatches.push_back(now);
            while self
                .dispatches
                .front()
                .is_some_and(|t| now.saturating_duration_since(*t) > RATE_WINDOW)
            {
                self.dispatches.pop_front();
            }
        }
    }

    /// How far behind the head of `lane` is the one to send to `node_id` instead
    /// ([`Router::pick`]): only one of the same lane (fairness decides the lane, routing only
    /// the order inside it) that may run there (its API, not its failed node) is looked at.
    fn better_waiter(&self, lane: Lane, node_id: &str) -> usize {
        let Some(node) = self.nodes.get(node_id) else {
            return 0;
        };
        let passed = self.line.lane(lane).next().map_or(0, |w| w.passed);
        let routes = self.line.lane(lane).map(|w| {
            let fits = w.avoid.as_deref() != Some(node_id) && node.handle.speaks(w.api);
            fits.then_some(w.route.as_deref()).flatten()
        });
        self.router.pick(node_id, passed, routes)
    }

    /// Generations past their deadline leave with `capacity_exhausted`.
    fn expire(&mut self) {
        let now = self.args.clock.now();
        for w in self.line.remove_if(|w| w.deadline <= now) {
            match w.waiter {
                Waiter::Local(generation) => {
                    let _ = generation.cast(GenerationMsg::QueueTimeout);
                }
                Waiter::Remote(replica) => self.tell_replica(
                    &replica,
                    crate::cluster::QueueReply::Timeout {
                        request_id: w.request_id,
                    },
                ),
            }
        }
    }

    fn stats(&self) -> QueueStats {
        QueueStats {
            waiting: self.line.len() + self.forwarded(),
            waiting_by_tier: self.line.by_tier(),
            nodes: self
                .nodes
                .iter()
                .map(|(id, n)| (id.clone(), n.in_flight(), n.draining))
                .collect(),
            suspended: self
                .nodes
                .iter()
                .filter(|(_, n)| n.suspended)
                .map(|(id, _)| id.clone())
                .collect(),
            drain_rate: self.drain_rate(),
            owner: self.owner(),
            on_grant: self.cluster.as_ref().map_or(0, |m| m.grants.started()),
        }
    }
}
