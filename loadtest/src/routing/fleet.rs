//! A fleet in virtual time: the simulator's engines (`switchyard sim`'s continuous-batching
//! model with its prefix cache) behind one queue per model that places requests the way
//! Switchyard's model queue does — FIFO, `node_concurrency` slots per node, a deadline, node
//! choice by the product's [`Router`] — with each node's KV use and engine queue seen only
//! through a heartbeat every 5 s, as the agent reports them. Nothing here is HTTP: the run
//! is on tokio's paused clock, so ten minutes of a 12-node fleet take seconds and the same
//! seed gives the same figures.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use switchyard::sim::engine::kv::CacheProbe;
use switchyard::sim::engine::{CacheUse, EngineHandle, SeqEvent, SeqParams};
use switchyard::sim::{EngineConfig, EngineStats, Generator, Profile, SimTokenizer};
use switchyard_actors::model_queue::{NodeView, RouteKey, Router, RoutingStrategy, block_hashes};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::workload::Turn;

/// How often a node's agent reports its engine's load.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// How long a request may wait for a slot (the queue's default deadline).
pub const DEADLINE: Duration = Duration::from_secs(30);
/// Tokens per KV block.
pub const BLOCK_SIZE: u32 = 16;

/// A routing strategy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Each node with room in turn.
    RoundRobin,
    /// Lowest in-flight share plus KV use.
    LeastLoaded,
    /// Switchyard's default: predicted prefix-cache hits against load.
    CacheAware,
    /// `cache_aware` scoring, told each node's cache exactly by its engine.
    Oracle,
}

impl Strategy {
    /// Every strategy, baseline first.
    pub const ALL: [Strategy; 4] = [
        Strategy::RoundRobin,
        Strategy::LeastLoaded,
        Strategy::CacheAware,
        Strategy::Oracle,
    ];

    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::RoundRobin => "round_robin",
            Strategy::LeastLoaded => "least_loaded",
            Strategy::CacheAware => "cache_aware",
            Strategy::Oracle => "oracle",
        }
    }

    fn routing(self) -> RoutingStrategy {
        match self {
            Strategy::RoundRobin => RoutingStrategy::RoundRobin,
            Strategy::LeastLoaded => RoutingStrategy::LeastLoaded,
            Strategy::CacheAware | Strategy::Oracle => RoutingStrategy::CacheAware,
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown strategy `{s}` (round_robin, least_loaded, cache_aware, oracle)"
                )
            })
    }
}

/// One model's part of the fleet.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Its name in tables.
    pub name: &'static str,
    /// The simulated replica.
    pub profile: Profile,
    /// Replicas.
    pub nodes: usize,
    /// Requests one node carries at once (`node_concurrency`).
    pub capacity: u32,
}

/// What one request did.
#[derive(Debug, Clone)]
pub struct Record {
    /// Index of its model in the fleet.
    pub model: usize,
    /// When it was sent, seconds from the start.
    pub sent: f64,
    /// Time to first token (queue wait included), seconds; `None` when refused.
    pub ttft: Option<f64>,
    /// Prompt tokens.
    pub prompt: u32,
    /// Of which read from the node's prefix cache.
    pub cached: u32,
    /// Tokens generated.
    pub output: u32,
}

/// The records of a run, shared by its request tasks.
pub type Records = Arc<Mutex<Vec<Record>>>;

/// A fleet on the current (paused-clock) runtime.
#[derive(Debug, Clone)]
pub struct Fleet {
    queues: Vec<mpsc::UnboundedSender<Msg>>,
    engines: Vec<Arc<Vec<EngineHandle>>>,
    tokenizer: Arc<SimTokenizer>,
    start: Instant,
    records: Records,
}

#[derive(Debug)]
enum Msg {
    Enqueue(Pending),
    Release(usize),
}

#[derive(Debug)]
struct Pending {
    route: Arc<RouteKey>,
    since: Instant,
    /// Times a later request went first ([`Router::pick`]).
    passed: u32,
    reply: oneshot::Sender<Option<usize>>,
}

#[derive(Debug)]
struct Node {
    id: String,
    probe: CacheProbe,
    engine: EngineHandle,
    in_flight: u32,
    /// The last heartbeat's KV use and engine queue.
    kv: f64,
    waiting: u64,
}

impl Fleet {
    /// Starts every model's engines and queue.
    pub fn start(models: &[ModelSpec], strategy: Strategy, tokenizer: Arc<SimTokenizer>) -> Self {
        let mut queues = Vec::new();
        let mut engines = Vec::new();
        for (m, spec) in models.iter().enumerate() {
            let profile = spec.profile.spec();
            let cache_blocks = profile.num_gpu_blocks(0.9, BLOCK_SIZE);
            let nodes: Vec<Node> = (0..spec.nodes)
                .map(|i| {
                    let probe = CacheProbe::default();
                    let (engine, _) =
                        EngineHandle::spawn_probed(engine_config(spec), probe.clone());
                    Node {
                        id: format!("{}-{i}", spec.name),
                        probe,
                        engine,
                        in_flight: 0,
                        kv: 0.0,
                        waiting: 0,
                    }
                })
                .collect();
            engines.push(Arc::new(nodes.iter().map(|n| n.engine.clone()).collect()));
            let (tx, rx) = mpsc::unbounded_channel();
            let queue = Queue {
                nodes,
                waiting: VecDeque::new(),
                router: Router::new(
                    strategy.routing(),
                    usize::try_from(cache_blocks).unwrap_or(usize::MAX),
                ),
                oracle: strategy == Strategy::Oracle,
                capacity: spec.capacity,
            };
            tokio::spawn(queue.run(rx, m));
            queues.push(tx);
        }
        Self {
            queues,
            engines,
            tokenizer,
            start: Instant::now(),
            records: Arc::default(),
        }
    }

    /// Seconds since the fleet started.
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Every engine's statistics, by model.
    pub fn stats(&self) -> Vec<Vec<EngineStats>> {
        self.engines
            .iter()
            .map(|e| e.iter().map(EngineHandle::stats).collect())
            .collect()
    }

    /// The records so far.
    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sends `turn` to `model`'s queue and follows it to its end; records it.
    pub async fn request(&self, model: usize, turn: &Turn, seed: u64) {
        let sent = Instant::now();
        let blocks = block_hashes(&turn.prompt, BLOCK_SIZE);
        let prompt = u32::try_from(turn.prompt.len()).unwrap_or(u32::MAX);
        let route = Arc::new(RouteKey {
            blocks: blocks.as_slice().into(),
            block_size: BLOCK_SIZE,
            prompt_tokens: prompt,
            session: None,
        });
        let mut record = Record {
            model,
            sent: sent.duration_since(self.start).as_secs_f64(),
            ttft: None,
            prompt,
            cached: 0,
            output: 0,
        };
        let (reply, placed) = oneshot::channel();
        let asked = Pending {
            route,
            since: sent,
            passed: 0,
            reply,
        };
        let node = match self.queues.get(model) {
            Some(q) if q.send(Msg::Enqueue(asked)).is_ok() => placed.await.ok().flatten(),
            _ => None,
        };
        if let Some(node) = node {
            self.run_on(model, node, turn, seed, blocks, sent, &mut record)
                .await;
            if let Some(q) = self.queues.get(model) {
                let _ = q.send(Msg::Release(node));
            }
        }
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(record);
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_on(
        &self,
        model: usize,
        node: usize,
        turn: &Turn,
        seed: u64,
        blocks: Vec<u64>,
        sent: Instant,
        record: &mut Record,
    ) {
        let Some(engine) = self.engines.get(model).and_then(|e| e.get(node)) else {
            return;
        };
        let params = SeqParams {
            prompt_tokens: record.prompt,
            max_tokens: turn.output,
            eos_at: None,
            generator: Generator::new(self.tokenizer.clone(), seed, Vec::new()),
            crash_after: None,
            stall_after: None,
            first_token_delay: Duration::ZERO,
            block_hashes: blocks,
        };
        let Ok(mut events) = engine.submit(params) else {
            return;
        };
        while let Some(event) = events.recv().await {
            let SeqEvent::Token {
                generated, finish, ..
            } = event
            else {
                return;
            };
            if record.ttft.is_none() {
                record.ttft = Some(sent.elapsed().as_secs_f64());
            }
            record.output = generated;
            if let Some(f) = finish {
                record.cached = f.cache.cached;
                return;
            }
        }
    }
}

fn engine_config(spec: &ModelSpec) -> EngineConfig {
    EngineConfig::modeled(spec.profile.spec(), BLOCK_SIZE)
}

/// One model's queue: Switchyard's model queue, reduced to what placement depends on.
#[derive(Debug)]
struct Queue {
    nodes: Vec<Node>,
    waiting: VecDeque<Pending>,
    router: Router,
    oracle: bool,
    capacity: u32,
}

impl Queue {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>, model: usize) {
        // Heartbeats of different nodes do not land together.
        let offset = Duration::from_millis(719 * (model as u64 + 1) % 5_000);
        let mut heartbeat = tokio::time::interval_at(Instant::now() + offset, HEARTBEAT);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Msg::Enqueue(p)) => self.waiting.push_back(p),
                    Some(Msg::Release(n)) => {
                        if let Some(node) = self.nodes.get_mut(n) {
                            node.in_flight = node.in_flight.saturating_sub(1);
                        }
                    }
                    None => return,
                },
                _ = heartbeat.tick() => self.heartbeat(),
                _ = tick.tick() => self.expire(),
            }
            self.dispatch();
        }
    }

    fn heartbeat(&mut self) {
        for n in &mut self.nodes {
            let s = n.engine.stats();
            n.kv = s.used_blocks as f64 / s.num_blocks.max(1) as f64;
            n.waiting = s.waiting_capacity;
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        while self
            .waiting
            .front()
            .is_some_and(|p| now.duration_since(p.since) >= DEADLINE)
        {
            if let Some(p) = self.waiting.pop_front() {
                let _ = p.reply.send(None);
            }
        }
    }

    fn dispatch(&mut self) {
        while let Some(head) = self.waiting.front() {
            let open: Vec<usize> = (0..self.nodes.len())
                .filter(|&i| self.nodes[i].in_flight < self.capacity)
                .collect();
            if open.is_empty() {
                return;
            }
            let views: Vec<NodeView<'_>> = open
                .iter()
                .map(|&i| {
                    let n = &self.nodes[i];
                    NodeView {
                        node_id: &n.id,
                        in_flight: n.in_flight,
                        capacity: self.capacity,
                        kv_cache_usage: n.kv,
                        engine_waiting: n.waiting,
                    }
                })
                .collect();
            let route = &head.route;
            let chosen = if self.oracle {
                let most = CacheUse::most_blocks(route.prompt_tokens, BLOCK_SIZE);
                let cached: Vec<u32> = open
                    .iter()
                    .map(|&i| route.tokens_of(self.nodes[i].probe.hit(&route.blocks, most)))
                    .collect();
                self.router.choose_on(Some(route), &views, &cached)
            } else {
                self.router.choose(Some(route), &views)
            };
            let Some(node) = chosen.and_then(|c| open.get(c).copied()) else {
                return;
            };
            let id = self.nodes[node].id.clone();
            let routes = self.waiting.iter().map(|p| Some(&*p.route));
            let j = self.router.pick(&id, head.passed, routes);
            if j != 0
                && let Some(first) = self.waiting.front_mut()
            {
                first.passed += 1;
            }
            let Some(p) = self.waiting.remove(j) else {
                return;
            };
            self.router.placed(&id, Some(&p.route));
            if p.reply.send(Some(node)).is_ok() {
                self.nodes[node].in_flight += 1;
            }
        }
    }
}
