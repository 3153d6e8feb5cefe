//! Faults of the cluster's own ownership: Redis restarted empty, the replica holding the
//! nodes' sockets frozen past its leases, the queue's owner killed. Each runs under load that
//! keeps both nodes full and requests waiting, then checks what an operator would: both
//! nodes' capacity is used again within [`RECOVERY`] with nobody acting, no request through a
//! healthy replica waited out its deadline (or was refused `no_healthy_node`) while the nodes
//! had room, and the books close.

use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::ProgressBar;
use serde_json::json;
use tokio::time::Instant;

use super::{DrillOptions, Found, MODEL, Stack, StackConfig, short_deadlines, wait_books_closed};
use crate::{Limit, Report, RunConfig};

/// Assignments one node carries.
pub(super) const SLOTS: u32 = 32;
/// Slots a node must be running again to count as recovered (the "28 of 32").
const FULL: f64 = (SLOTS - 4) as f64;
/// Closed-loop clients: more than both nodes' slots, so requests wait.
const CLIENTS: usize = 130;
/// Load before the fault.
const WARMUP: Duration = Duration::from_secs(6);
/// How long after a fault ends both nodes must be full again.
pub(super) const RECOVERY: Duration = Duration::from_secs(30);
/// Outcomes a client of a healthy replica must never see: a wait run out, or a refusal for
/// want of nodes while two were healthy.
const STRANDED: &[&str] = &["503 capacity_exhausted", "503 no_healthy_node", "timeout"];

/// The stack of these drills: three replicas, two nodes of [`SLOTS`], engines in real time (a
/// request of 64 tokens takes about 1.3 s, so 130 clients need some 50 requests a second:
/// little enough for a debug build on two cores to relay), leases of 2 s; with
/// `socket_holder`, every node dials that replica first.
pub(super) fn stack(socket_holder: Option<usize>) -> StackConfig {
    StackConfig {
        replicas: 3,
        nodes: 2,
        node_concurrency: SLOTS,
        time_scale: 1.0,
        owner_lease_secs: 2,
        nodes_dial_first: socket_holder,
        ..short_deadlines()
    }
}

/// How long a fault that lasts (a freeze) lasts: the drill's load, between 10 and 20 s.
fn fault_length(opts: &DrillOptions) -> Duration {
    opts.load
        .clamp(Duration::from_secs(10), Duration::from_secs(20))
}

/// When a sample was taken, and each engine's running requests then.
type Samples = Arc<Mutex<Vec<(Instant, Vec<f64>)>>>;

/// The engines' running requests, sampled every 200 ms until stopped.
struct Sampler {
    samples: Samples,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    fn start(stack: &Stack) -> Self {
        let samples: Samples = Arc::default();
        let ports = stack.engine_ports.clone();
        let http = stack.http().clone();
        let into = samples.clone();
        let task = tokio::spawn(async move {
            loop {
                let mut running = Vec::new();
                for port in &ports {
                    running.push(engine_running(&http, *port).await);
                }
                if let Ok(mut s) = into.lock() {
                    s.push((Instant::now(), running));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Self { samples, task }
    }

    /// The first sample at or after `since` with every node running at least [`FULL`].
    fn full_since(&self, since: Instant) -> Option<Instant> {
        let samples = self.samples.lock().ok()?;
        samples
            .iter()
            .find(|(at, running)| *at >= since && running.iter().all(|r| *r >= FULL))
            .map(|(at, _)| *at)
    }

    /// Waits until every node runs at least [`FULL`] after `since`, at most `within`.
    async fn wait_full(&self, since: Instant, within: Duration) -> Option<Duration> {
        while since.elapsed() < within {
            if let Some(at) = self.full_since(since) {
                return Some(at.saturating_duration_since(since));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    /// The fewest and most each node ran between `from` and `to`.
    fn range(&self, from: Instant, to: Instant) -> Vec<(f64, f64)> {
        let Ok(samples) = self.samples.lock() else {
            return Vec::new();
        };
        let mut out: Vec<(f64, f64)> = Vec::new();
        for (_, running) in samples.iter().filter(|(at, _)| *at >= from && *at <= to) {
            out.resize(running.len(), (f64::MAX, 0.0));
            for (o, r) in out.iter_mut().zip(running) {
                *o = (o.0.min(*r), o.1.max(*r));
            }
        }
        out
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn engine_running(http: &reqwest::Client, port: u16) -> f64 {
    let Ok(resp) = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
    else {
        return 0.0;
    };
    let text = resp.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("vllm:num_requests_running"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Closed-loop load of `streams` clients for `length` through the replicas `through` (taking
/// requests in turn).
fn start(
    stack: &Stack,
    through: &[usize],
    streams: usize,
    length: Duration,
) -> tokio::task::JoinHandle<anyhow::Result<Report>> {
    let urls: Vec<String> = through
        .iter()
        .map(|i| format!("{}/v1", stack.replicas[*i].url))
        .collect();
    let mut cfg = RunConfig::new(urls.join(","), MODEL);
    cfg.api_key = Some(stack.key.clone());
    cfg.streams = streams;
    cfg.limit = Limit::Duration(length);
    cfg.prompt_tokens = 200;
    cfg.max_tokens = 64;
    cfg.timeout = Duration::from_secs(60);
    // Skips the calibration probes, which would fail on a frozen replica.
    cfg.tokens_per_word = Some(1.3);
    tokio::spawn(crate::run(cfg))
}

/// The load's shape around one fault: the checked clients go through `healthy`, the others
/// (if any) through `faulty`.
struct Load {
    checked: tokio::task::JoinHandle<anyhow::Result<Report>>,
    other: Option<tokio::task::JoinHandle<anyhow::Result<Report>>>,
    sampler: Sampler,
    started: Instant,
}

impl Load {
    /// [`CLIENTS`] clients, a sixth of them through `faulty`, for `length`; returns once both
    /// nodes are full (or after [`WARMUP`] plus 10 s, with the check failed).
    async fn fill(
        stack: &Stack,
        healthy: &[usize],
        faulty: Option<usize>,
        length: Duration,
        found: &mut Found,
    ) -> Self {
        let sampler = Sampler::start(stack);
        let started = Instant::now();
        let other_clients = if faulty.is_some() { CLIENTS / 6 } else { 0 };
        let checked = start(stack, healthy, CLIENTS - other_clients, length);
        let other = faulty.map(|i| start(stack, &[i], other_clients, length));
        let full = sampler
            .wait_full(started, WARMUP + Duration::from_secs(10))
            .await;
        found.check(
            "the load fills both nodes before the fault",
            full.is_some(),
            match full {
                Some(t) => format!(
                    "both nodes at {FULL} or more after {:.1} s",
                    t.as_secs_f64()
                ),
                None => format!("{:?}", sampler.range(started, Instant::now())),
            },
        );
        let left = WARMUP.saturating_sub(started.elapsed());
        tokio::time::sleep(left).await;
        Self {
            checked,
            other,
            sampler,
            started,
        }
    }

    /// After the fault ended at `ended`: both nodes full again within [`RECOVERY`], then the
    /// load's outcomes.
    async fn recovered(
        self,
        stack: &Stack,
        ended: Instant,
        found: &mut Found,
    ) -> anyhow::Result<()> {
        let back = self.sampler.wait_full(ended, RECOVERY).await;
        if back.is_none() {
            found.figure("views_unrecovered", views(stack).await);
        }
        found.check(
            &format!(
                "both nodes run {FULL} of {SLOTS} again within {} s",
                RECOVERY.as_secs()
            ),
            back.is_some(),
            match back {
                Some(t) => format!("{:.1} s after the fault ended", t.as_secs_f64()),
                None => format!(
                    "fewest and most running per node since: {:?}",
                    self.sampler.range(ended, Instant::now())
                ),
            },
        );
        found.figure(
            "capacity_back_seconds",
            json!(back.map(|t| t.as_secs_f64())),
        );
        let checked = self.checked.await??;
        let stranded: Vec<&crate::report::RequestRecord> = checked
            .requests
            .iter()
            .filter(|r| STRANDED.contains(&r.outcome.as_str()))
            .collect();
        found.check(
            "no client of a healthy replica waited out its deadline or was refused for want of nodes",
            stranded.is_empty(),
            format!(
                "{} stranded of {} ({:?})",
                stranded.len(),
                checked.requests.len(),
                stranded
                    .iter()
                    .take(5)
                    .map(|r| (r.outcome.clone(), r.send_us / 1000, r.end_us / 1000))
                    .collect::<Vec<_>>()
            ),
        );
        found.figure("outcomes", json!(checked.outcomes));
        if let Some(other) = self.other
            && let Ok(Ok(r)) = other.await
        {
            found.figure("faulty_replica_outcomes", json!(r.outcomes));
        }
        found.figure("load_seconds", json!(self.started.elapsed().as_secs_f64()));
        Ok(())
    }
}

/// How long the load runs: the warm-up, the fault, and the recovery window with margin.
fn load_length(fault: Duration) -> Duration {
    WARMUP + Duration::from_secs(10) + fault + RECOVERY
}

/// Redis killed under load and started again empty 3 s later: every lease, fencing counter,
/// node key and attempt record is gone. Admission fails closed meanwhile; afterwards the
/// queues have an owner everyone follows and both nodes fill again.
pub(super) async fn redis_restart_empty(
    stack: &mut Stack,
    _opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    bar.set_message("load that keeps both nodes full");
    let outage = Duration::from_secs(3);
    let load = Load::fill(stack, &[0, 1, 2], None, load_length(outage), found).await;
    bar.set_message("kill -9 Redis, and start it again empty");
    stack.kill_redis().await?;
    tokio::time::sleep(outage).await;
    stack.restart_redis().await?;
    let ended = Instant::now();
    bar.set_message("waiting for both nodes to fill again");
    let owners = agreed_owner(stack, ended).await;
    found.check(
        "every replica names the same queue owner after Redis returns",
        owners.is_some(),
        match &owners {
            Some((owner, t)) => format!("{owner} after {:.1} s", t.as_secs_f64()),
            None => "not within 30 s".to_owned(),
        },
    );
    // Refusals while Redis was down (`quota_service_unavailable`) are admission failing
    // closed, as it must: not held against the clients.
    load.recovered(stack, ended, found).await?;
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// The replica holding both nodes' sockets stopped with SIGSTOP past every lease and the
/// nodes' heartbeat timeout, then let run again: the nodes move to the others, whose queue
/// owner fills them, and the woken replica's stale view costs nothing.
pub(super) async fn freeze_socket_holder(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let frozen = 1;
    let holders = stack.socket_holders(&stack.replicas[0].url).await?;
    found.figure("socket_holders", json!(holders));
    let owner = stack.queue_owner(&stack.replicas[0].url, MODEL).await?;
    found.figure("queue_owner", json!(owner));
    let length = fault_length(opts);
    bar.set_message("load that keeps both nodes full");
    let load = Load::fill(stack, &[0, 2], Some(frozen), load_length(length), found).await;
    bar.set_message(format!(
        "SIGSTOP the socket holder for {} s",
        length.as_secs()
    ));
    stack.pause_replica(frozen).await?;
    tokio::time::sleep(length).await;
    stack.resume_replica(frozen).await?;
    let ended = Instant::now();
    bar.set_message("waiting for both nodes to fill again");
    load.recovered(stack, ended, found).await?;
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// The queue's owner, which also holds one node's socket, killed with SIGKILL while its
/// node runs streams of every replica and requests wait on the others: a survivor owns the
/// queue with every request that waited, and the node is filled to its capacity again.
pub(super) async fn kill_queue_owner(
    stack: &mut Stack,
    _opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let owner = stack
        .queue_owner(&stack.replicas[0].url, MODEL)
        .await?
        .unwrap_or_default();
    let doomed = stack.replica_index(&owner).unwrap_or(0);
    let holders = stack.socket_holders(&stack.replicas[0].url).await?;
    found.check(
        "the queue's owner holds a node's socket",
        holders.values().any(|h| *h == owner),
        format!("owner {owner}, sockets {holders:?}"),
    );
    let survivors: Vec<usize> = (0..stack.replicas.len()).filter(|i| *i != doomed).collect();
    bar.set_message("load that keeps both nodes full");
    let load = Load::fill(
        stack,
        &survivors,
        Some(doomed),
        load_length(Duration::ZERO),
        found,
    )
    .await;
    bar.set_message("kill -9 the queue's owner");
    stack.kill_replica(doomed).await?;
    let ended = Instant::now();
    bar.set_message("waiting for both nodes to fill again");
    load.recovered(stack, ended, found).await?;
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// Polls every live replica until all name the same queue owner; that owner and how long
/// after `since` it took (at most 30 s).
async fn agreed_owner(stack: &Stack, since: Instant) -> Option<(String, Duration)> {
    while since.elapsed() < Duration::from_secs(30) {
        let mut owners = Vec::new();
        for r in stack.live_replicas() {
            owners.push(stack.queue_owner(&r.url, MODEL).await.ok().flatten());
        }
        if let Some(Some(first)) = owners.first()
            && owners.iter().all(|o| o.as_ref() == Some(first))
        {
            return Some((first.clone(), since.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// What every live replica says of the nodes (holder, in flight) and the queue (owner,
/// depth), and what the engines run: the figures that explain a capacity not recovered.
async fn views(stack: &Stack) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for r in stack.live_replicas() {
        let nodes = stack.admin_get(&r.url, "/admin/nodes").await.ok();
        let queues = stack.admin_get(&r.url, "/admin/queues").await.ok();
        let nodes: Vec<serde_json::Value> = nodes
            .iter()
            .flat_map(|n| n["data"].as_array().cloned().unwrap_or_default())
            .map(|n| {
                json!([
                    n["node_id"],
                    n["owner_replica"],
                    n["health"],
                    n["in_flight"],
                    n["running"]
                ])
            })
            .collect();
        let queue: Vec<serde_json::Value> = queues
            .iter()
            .flat_map(|q| q["data"].as_array().cloned().unwrap_or_default())
            .map(|q| json!([q["owner"], q["depth"], q["nodes"]]))
            .collect();
        out.insert(r.id.clone(), json!({"nodes": nodes, "queue": queue}));
    }
    let mut engines = Vec::new();
    for port in &stack.engine_ports {
        engines.push(engine_running(stack.http(), *port).await);
    }
    out.insert("engines_running".into(), json!(engines));
    serde_json::Value::Object(out)
}
