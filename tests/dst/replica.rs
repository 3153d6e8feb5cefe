//! A replica as a simulated host: the actors a `switchyard serve` runs, started by the same
//! [`ReplicaActors::start`] (the supervision tree, each model's queue in the cluster, the
//! team budgets with cluster-wide ownership, the node view), on the coordinator host over
//! the simulated network and the shared database. Its HTTP layer is replaced by what it
//! drives: node connections taken on [`agent::PORT`] and handed to the node view, and the
//! clients of the plan, whose requests go through the launcher with an admission that
//! prices and bounds them as the server's does.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use switchyard_actors::budget::BudgetConfig;
use switchyard_actors::cluster::NodeView;
use switchyard_actors::error::Failure;
use switchyard_actors::generation::{
    GenEvent, LaunchError, Launched, Launcher, StreamBound, Timeouts, Trace,
};
use switchyard_actors::model_queue::{ModelQueueHandle, QueueConfig, RoutingStrategy};
use switchyard_actors::node::NodeTrust;
use switchyard_actors::ports::admission::{AdmissionJob, Admit, LimitState, Ready};
use switchyard_actors::ports::{Clock, Reservation, UsageBounds};
use switchyard_actors::protocol::{
    Api, NodeFrame, PROTOCOL_VERSION, ServerFrame, decode_node_frame,
};
use switchyard_actors::replica::{ReplicaActors, ReplicaArgs};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turmoil::net::{TcpListener, TcpStream};

use super::agent::PORT;
use super::net::{Control, NetCoordinator, read_frame, write_frame};
use super::world::{Outcome, Planned, World};

/// The one model of the simulation.
pub const MODEL: &str = "llama-3.1-8b-instruct";
/// Owner leases (queues, budgets).
const LEASE_TTL: Duration = Duration::from_secs(3);

/// The simulation's clock: tokio's (simulated) instant, and a wall clock that is the
/// simulation's own epoch plus its elapsed time, so nothing reads the host's real time.
#[derive(Debug)]
pub struct SimClock;

impl Clock for SimClock {
    fn now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
    fn wall(&self) -> DateTime<Utc> {
        let since = turmoil::since_epoch().unwrap_or_default();
        DateTime::<Utc>::from_timestamp_millis(i64::try_from(since.as_millis()).unwrap_or(0))
            .unwrap_or_default()
    }
}

/// The queues' policy: the default weights and minimum share, fair between teams, every
/// tier waiting at most 10 s (the simulated run is short).
fn dst_policy() -> switchyard_actors::tier::Policy {
    let mut policy = switchyard_actors::tier::Policy::default();
    for tier in &mut policy.tiers {
        tier.budget = Duration::from_secs(10);
    }
    policy
}

/// The deadlines of the simulation's generations: short, so a run comes to rest quickly.
pub fn timeouts() -> Timeouts {
    Timeouts {
        first_token: Duration::from_secs(10),
        total: Duration::from_secs(30),
        cancel_grace: Duration::from_secs(1),
        settle_wait: Duration::from_secs(5),
        lease: Duration::from_secs(3),
    }
}

/// The host's software: a new replica (a new id) each time the host starts.
pub async fn run(host: String, world: Arc<World>, plan: Arc<Vec<Planned>>) -> turmoil::Result {
    let replica_id = world.incarnate(&host);
    let actors = ReplicaActors::start(ReplicaArgs {
        replica_id: replica_id.clone(),
        ledger: world.ledger.clone(),
        lifecycle: None,
        coordinator: Arc::new(NetCoordinator::new("redis")),
        clock: Arc::new(SimClock),
        models: vec![(
            MODEL.to_owned(),
            QueueConfig {
                max_waiting: 64,
                max_waiting_tokens: u64::MAX,
                policy: dst_policy(),
                node_capacity: world.capacity,
                routing: RoutingStrategy::LeastLoaded,
                cache_blocks: 1024,
            },
        )],
        lease_ttl: LEASE_TTL,
        budget: BudgetConfig::default(),
        heartbeat_timeout: Duration::from_secs(5),
        trust: NodeTrust::default(),
        timeouts: timeouts(),
        bound: StreamBound::default(),
        retention: Duration::from_secs(5),
        accounting: None,
    })
    .await?;
    // The replica's life is the host's: a crash ends it, nothing stops it otherwise.
    actors.join(CancellationToken::new()).await;
    let queue = actors.supervision.queues[MODEL].clone();
    let launcher = actors.launcher.clone();
    let view = actors.view.clone();
    tokio::spawn(clients(host, replica_id, world, plan, launcher, queue));
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(node_connection(view.clone(), stream));
    }
}

/// One node's connection, as `/v1/nodes/connect` serves it.
async fn node_connection(view: Arc<NodeView>, stream: TcpStream) {
    let (mut read, mut write) = stream.into_split();
    let first = tokio::time::timeout(Duration::from_secs(5), read_frame::<NodeFrame>(&mut read));
    let Ok(Ok(NodeFrame::Register {
        node_id,
        models,
        protocol,
        ..
    })) = first.await
    else {
        return;
    };
    let protocol = protocol.min(PROTOCOL_VERSION);
    let registered = ServerFrame::Registered {
        protocol: Some(protocol),
    };
    if write_frame(&mut write, &registered).await.is_err() {
        return;
    }
    let (outbound, mut frames) = mpsc::channel(256);
    let Ok(node) = view
        .connected(&node_id, &models, protocol, 1, outbound)
        .await
    else {
        return;
    };
    let (incoming_tx, mut incoming) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        // The frame goes through the server's own parser, from its text; a ping is `None`.
        while let Ok(frame) = read_frame::<serde_json::Value>(&mut read).await {
            let text = (!Control::Ping.is(&frame)).then(|| frame.to_string());
            if incoming_tx.send(text).is_err() {
                return;
            }
        }
    });
    loop {
        tokio::select! {
            out = frames.recv() => match out {
                Some(frame) => {
                    if write_frame(&mut write, &frame).await.is_err() {
                        break;
                    }
                }
                None => break,
            },
            text = incoming.recv() => match text {
                Some(None) => {
                    if write_frame(&mut write, &Control::Pong).await.is_err() {
                        break;
                    }
                }
                Some(Some(text)) => match decode_node_frame(&text) {
                    Ok(frame) => {
                        if !node.deliver(frame) {
                            break;
                        }
                    }
                    Err(_) => node.violation(switchyard_actors::node::Violation::MalformedFrame, None),
                },
                None => break,
            },
        }
    }
    reader.abort();
    view.disconnected(&node);
}

/// The admission of a simulated request: priced and bounded as the server's would be
/// (10 prompt tokens at 1 µcr, output at 2 µcr per token).
#[derive(Debug)]
struct Job {
    planned: Planned,
    queue: ModelQueueHandle,
}

/// The simulated admission never refuses (limits are not what the simulation tests).
#[derive(Debug)]
enum Never {}

impl std::fmt::Display for Never {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {}
    }
}

impl std::error::Error for Never {}

impl From<Never> for Failure {
    fn from(never: Never) -> Self {
        match never {}
    }
}

#[async_trait]
impl AdmissionJob for Job {
    type Error = Never;

    async fn run(self: Box<Self>) -> Result<Admit, Never> {
        let p = self.planned;
        let price_in = 1_000_000;
        let price_out = 2_000_000;
        let reservation = Reservation {
            request_id: p.id.clone(),
            team_id: p.team,
            key_id: None,
            model: MODEL.into(),
            estimated_prompt_tokens: 10,
            max_tokens: p.max_tokens,
            estimated_cost: switchyard_actors::ports::cost_of(
                10,
                p.max_tokens,
                price_in,
                price_out,
            ),
            price_input_per_mtok: price_in,
            price_output_per_mtok: price_out,
            bounds: UsageBounds {
                prompt_tokens: 10,
                completion_tokens: p.max_tokens,
            },
        };
        Ok(Admit::Ready(Box::new(Ready {
            request_id: p.id,
            model: MODEL.into(),
            body: serde_json::json!({"model": MODEL, "messages": [], "max_tokens": p.max_tokens}),
            reservation,
            embedding_dimensions: None,
            queue: self.queue,
            route: None,
            lifecycle: None,
            resumable: false,
            tier: p.tier,
            on_end: None,
            limits: LimitState::default(),
        })))
    }
}

/// Sends this replica host's share of the plan at its times; each request's client reads
/// its stream to the end (or hangs up) and records what it saw.
async fn clients(
    host: String,
    replica_id: String,
    world: Arc<World>,
    plan: Arc<Vec<Planned>>,
    launcher: Launcher,
    queue: ModelQueueHandle,
) {
    let start = tokio::time::Instant::now() - turmoil::elapsed();
    for p in plan.iter().filter(|p| p.replica == host) {
        let at = start + Duration::from_millis(p.at_ms);
        if tokio::time::Instant::now() > at + Duration::from_millis(500) {
            // Due while this host was down: its client went elsewhere or gave up.
            continue;
        }
        tokio::time::sleep_until(at).await;
        if !world.issue(&p.id, &replica_id) {
            continue;
        }
        if std::env::var("DST_NODE").is_ok() {
            eprintln!(
                "{:?} ISSUE {} at {replica_id} max_tokens {}",
                turmoil::elapsed(),
                p.id,
                p.max_tokens
            );
        }
        let job = Box::new(Job {
            planned: p.clone(),
            queue: queue.clone(),
        });
        let launcher = launcher.clone();
        let world = world.clone();
        let p = p.clone();
        tokio::spawn(async move {
            let outcome = match launcher.launch(job, Api::Chat, Trace::default()).await {
                Ok(Launched::Running { mut generation, .. }) => {
                    read_stream(&p.id, &mut generation, p.abandon_after).await
                }
                Ok(Launched::Existing(_)) => Outcome::Failed("existing".into()),
                Err(LaunchError::NotStarted { failure, .. }) => {
                    Outcome::Failed(failure.code.as_str().into())
                }
                Err(LaunchError::Refused(never)) => match never {},
            };
            world.outcome(&p.id, outcome);
        });
    }
}

async fn read_stream(
    id: &str,
    generation: &mut switchyard_actors::generation::GenerationStream,
    abandon_after: Option<u64>,
) -> Outcome {
    let mut deltas = 0u64;
    loop {
        if abandon_after.is_some_and(|n| deltas >= n) {
            return Outcome::Abandoned;
        }
        match generation.next().await {
            // Pieces may carry several of the engine's chunks (a reader behind is sent them
            // together): count the tokens, each a "tok " of text.
            Some(GenEvent::Delta(piece)) => {
                deltas += piece.text.matches("tok ").count() as u64;
                if std::env::var("DST_DEBUG").is_ok_and(|d| d == id) {
                    eprintln!(
                        "{:?} client {id} delta {:?}",
                        turmoil::elapsed(),
                        piece.text
                    );
                }
            }
            Some(GenEvent::Finished(usage)) => {
                if std::env::var("DST_DEBUG").is_ok_and(|d| d == id) {
                    eprintln!("{:?} client {id} finished {usage:?}", turmoil::elapsed());
                }
                return Outcome::Finished {
                    billed: usage.completion_tokens,
                    deltas,
                };
            }
            Some(GenEvent::Cancelled(_)) => return Outcome::Cancelled,
            Some(GenEvent::Failed(f)) => {
                if std::env::var("DST_DEBUG").is_ok_and(|d| d == id) {
                    eprintln!("{:?} client {id} failed {f:?}", turmoil::elapsed());
                }
                return Outcome::Failed(f.code.as_str().into());
            }
            None => return Outcome::Failed("stream ended without an end".into()),
        }
    }
}
