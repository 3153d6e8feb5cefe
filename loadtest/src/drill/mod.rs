//! `switchyard-loadtest drill NAME`: each drill starts its own local cluster ([`Stack`]),
//! drives load through it, injects its fault and checks the invariants that must hold
//! afterwards — from outside, as an auditor would: the load's outcomes, `GET /admin/nodes`,
//! and the ledger in PostgreSQL. A drill reports each check and its figures as JSON.

mod bank;
mod drills;
mod faults;
mod ledger;
mod owners;
mod peak;
mod proxy;
mod stack;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::time::Instant;

pub use bank::bank;
pub use ledger::{Books, books};
pub use peak::PeakShape;
pub use proxy::CutProxy;
pub use stack::{MODEL, ServedModel, Stack, StackConfig, free_port, rss_bytes};

use crate::{Limit, Report, RunConfig};

/// The drills, in the order `all` runs them.
pub const DRILLS: &[&str] = &[
    "peak-200",
    "kill-replica",
    "kill-engine",
    "restart-all",
    "redis-down",
    "spot-reclaim",
    "abandon-10k",
    "cut-node",
    "postgres-down",
    "max-streams-500",
    "redis-restart-empty",
    "freeze-socket-holder",
    "kill-queue-owner",
];

/// How to run drills.
#[derive(Debug, Clone)]
pub struct DrillOptions {
    /// The `switchyard` binary.
    pub bin: PathBuf,
    /// A PostgreSQL URL whose server the drill makes its database on.
    pub database: String,
    /// Seconds of load (a short run for the test command uses a few).
    pub load: Duration,
    /// Show a progress bar.
    pub progress: bool,
    /// Keep the processes' logs (their directory is in the report).
    pub keep_logs: bool,
    /// Clients `abandon-10k` sends (10,000; the test command's short run sends fewer).
    pub abandon: usize,
}

/// One check of a drill.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What must hold.
    pub name: String,
    /// Whether it did.
    pub ok: bool,
    /// What was seen.
    pub detail: String,
}

/// What a drill found.
#[derive(Debug, Clone, Serialize)]
pub struct DrillReport {
    /// The drill.
    pub drill: String,
    /// Every check held.
    pub passed: bool,
    /// Wall time of the whole drill, stack included.
    pub seconds: f64,
    /// Each invariant checked.
    pub checks: Vec<Check>,
    /// Measured figures (times, outcome counts).
    pub figures: BTreeMap<String, Value>,
    /// Where the processes' logs are, if kept.
    pub logs: Option<String>,
}

impl DrillReport {
    /// One line per check, then the figures.
    pub fn print(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let verdict = if self.passed { "PASSED" } else { "FAILED" };
        writeln!(
            out,
            "drill {}: {verdict} in {:.1} s",
            self.drill, self.seconds
        )?;
        for c in &self.checks {
            let mark = if c.ok { "ok  " } else { "FAIL" };
            writeln!(out, "  {mark} {}: {}", c.name, c.detail)?;
        }
        for (k, v) in &self.figures {
            writeln!(out, "  {k} = {v}")?;
        }
        if let Some(logs) = &self.logs {
            writeln!(out, "  logs: {logs}")?;
        }
        Ok(())
    }
}

/// Prints one table row per drill.
pub fn print_table(reports: &[DrillReport], out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<16} {:<7} {:>8}  failed checks",
        "drill", "result", "seconds"
    )?;
    for r in reports {
        let failed: Vec<&str> = r
            .checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| c.name.as_str())
            .collect();
        let verdict = if r.passed { "passed" } else { "FAILED" };
        writeln!(
            out,
            "{:<16} {:<7} {:>8.1}  {}",
            r.drill,
            verdict,
            r.seconds,
            failed.join(", ")
        )?;
    }
    Ok(())
}

/// Runs drill `name` (or every drill, for `all`).
pub async fn drill(name: &str, opts: &DrillOptions) -> anyhow::Result<Vec<DrillReport>> {
    let names: Vec<&str> = if name == "all" {
        DRILLS.to_vec()
    } else if DRILLS.contains(&name) {
        vec![name]
    } else {
        anyhow::bail!(
            "unknown drill `{name}`; the drills: all, {}",
            DRILLS.join(", ")
        );
    };
    let mut reports = Vec::new();
    for n in names {
        reports.push(run_one(n, opts, PeakShape::FULL).await?);
    }
    Ok(reports)
}

/// Runs `peak-200` at `shape` (the test command runs a quarter of the peak).
pub async fn peak_200(opts: &DrillOptions, shape: PeakShape) -> anyhow::Result<DrillReport> {
    run_one("peak-200", opts, shape).await
}

/// Drill `name` on a stack of its own; `shape` sizes `peak-200`.
async fn run_one(name: &str, opts: &DrillOptions, shape: PeakShape) -> anyhow::Result<DrillReport> {
    let started = Instant::now();
    let bar = progress(opts.progress, name);
    let mut found = Found::default();
    let (config, models) = match name {
        "peak-200" => peak::stack(shape),
        "redis-restart-empty" | "freeze-socket-holder" | "kill-queue-owner" => {
            let config = drill_config(name);
            let models = owners::served(&config);
            (config, models)
        }
        _ => {
            let config = drill_config(name);
            let models = config.one_model();
            (config, models)
        }
    };
    bar.set_message("starting the cluster");
    let mut stack = match Stack::start_serving(&opts.bin, &opts.database, config, models).await {
        Ok(stack) => stack,
        Err(e) => {
            // Reported as a failed drill: `all` goes on with the next.
            bar.finish_and_clear();
            found.check("the drill's cluster started", false, format!("{e:#}"));
            return Ok(DrillReport {
                drill: name.to_owned(),
                passed: false,
                seconds: started.elapsed().as_secs_f64(),
                checks: found.checks,
                figures: found.figures,
                logs: None,
            });
        }
    };
    let outcome = match name {
        "kill-replica" => drills::kill_replica(&mut stack, opts, &bar, &mut found).await,
        "kill-engine" => drills::kill_engine(&mut stack, opts, &bar, &mut found).await,
        "restart-all" => drills::restart_all(&mut stack, opts, &bar, &mut found).await,
        "redis-down" => drills::redis_down(&mut stack, opts, &bar, &mut found).await,
        "spot-reclaim" => drills::spot_reclaim(&mut stack, opts, &bar, &mut found).await,
        "abandon-10k" => drills::abandon(&mut stack, opts, &bar, &mut found).await,
        "cut-node" => faults::cut_node(&mut stack, opts, &bar, &mut found).await,
        "postgres-down" => faults::postgres_down(&mut stack, opts, &bar, &mut found).await,
        "peak-200" => peak::peak_200(&mut stack, opts, &bar, &mut found, shape).await,
        "redis-restart-empty" => {
            owners::redis_restart_empty(&mut stack, opts, &bar, &mut found).await
        }
        "freeze-socket-holder" => {
            owners::freeze_socket_holder(&mut stack, opts, &bar, &mut found).await
        }
        "kill-queue-owner" => owners::kill_queue_owner(&mut stack, opts, &bar, &mut found).await,
        _ => faults::max_streams(&mut stack, opts, &bar, &mut found).await,
    };
    if let Err(e) = &outcome {
        found.check("drill ran", false, format!("{e:#}"));
    }
    bar.set_message("checking the ledger");
    ledger_checks(&stack, &mut found).await;
    let logs = (opts.keep_logs || !found.passed()).then(|| stack.work_dir().display().to_string());
    bar.finish_and_clear();
    if let Err(e) = stack.stop(logs.is_some()).await {
        eprintln!("drill {name}: could not drop its database: {e:#}");
    }
    Ok(DrillReport {
        drill: name.to_owned(),
        passed: found.passed(),
        seconds: started.elapsed().as_secs_f64(),
        checks: found.checks,
        figures: found.figures,
        logs,
    })
}

/// The stack of drill `name` (but `peak-200`'s), serving [`MODEL`].
fn drill_config(name: &str) -> StackConfig {
    match name {
        "kill-replica" | "restart-all" | "redis-down" | "abandon-10k" | "max-streams-500" => {
            short_deadlines()
        }
        "cut-node" => StackConfig {
            cut_node: true,
            ..short_deadlines()
        },
        "postgres-down" => StackConfig {
            cut_database: true,
            ..short_deadlines()
        },
        "redis-restart-empty" => owners::stack(None),
        "kill-queue-owner" => owners::stack_with_production_lease(),
        // Both nodes' sockets on the replica that freezes; the first replica owns the queue.
        "freeze-socket-holder" => owners::stack(Some(1)),
        _ => StackConfig {
            replicas: 2,
            nodes: 2,
            ..short_deadlines()
        },
    }
}

/// The checks and figures a drill gathers.
#[derive(Debug, Default)]
pub(super) struct Found {
    checks: Vec<Check>,
    figures: BTreeMap<String, Value>,
}

impl Found {
    pub(super) fn check(&mut self, name: &str, ok: bool, detail: impl Into<String>) {
        self.checks.push(Check {
            name: name.to_owned(),
            ok,
            detail: detail.into(),
        });
    }

    pub(super) fn figure(&mut self, name: &str, value: Value) {
        self.figures.insert(name.to_owned(), value);
    }

    pub(super) fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.ok)
    }
}

pub(super) fn progress(show: bool, name: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {prefix} [{elapsed}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_prefix(name.to_owned());
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// The deadlines that bound a dead replica's reservations: swept 10 + 2 + 1 s after
/// admission, checked every second.
pub(super) fn short_deadlines() -> StackConfig {
    StackConfig {
        extra_toml: "[timeouts]\ntotal_secs = 10\nsettle_wait_secs = 2\n\
                     sweep_interval_secs = 1\nsweep_grace_secs = 1\n"
            .to_owned(),
        ..StackConfig::default()
    }
}

/// Load through replica `url`: `streams` closed-loop streams for `load`.
pub(super) fn load(stack: &Stack, url: &str, streams: usize, load: Duration) -> RunConfig {
    let mut cfg = RunConfig::new(format!("{url}/v1"), MODEL);
    cfg.api_key = Some(stack.key.clone());
    cfg.streams = streams;
    cfg.limit = Limit::Duration(load);
    cfg.prompt_tokens = 200;
    cfg.max_tokens = 64;
    cfg.timeout = Duration::from_secs(30);
    cfg
}

/// Closed-loop load running through the replicas, one run per replica.
pub(super) struct Loads(Vec<tokio::task::JoinHandle<anyhow::Result<Report>>>);

/// Starts `streams` streams through every running replica for `duration`.
pub(super) fn start_load(stack: &Stack, streams: usize, duration: Duration) -> Loads {
    Loads(
        stack
            .live_replicas()
            .iter()
            .map(|r| tokio::spawn(crate::run(load(stack, &r.url, streams, duration))))
            .collect(),
    )
}

impl Loads {
    /// Every run's report, in replica order (a run may fail: its replica died).
    pub(super) async fn each(self) -> anyhow::Result<Vec<anyhow::Result<Report>>> {
        let mut reports = Vec::new();
        for run in self.0 {
            reports.push(run.await?);
        }
        Ok(reports)
    }

    /// Every run's report; a run that failed fails the drill.
    pub(super) async fn all(self) -> anyhow::Result<Vec<Report>> {
        self.each().await?.into_iter().collect()
    }
}

/// Starts `streams` streams through every replica for the drill's load, and lets a third
/// of it pass before the fault.
pub(super) async fn load_a_third(
    stack: &Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    streams: usize,
) -> Loads {
    bar.set_message("load through every replica");
    let runs = start_load(stack, streams, opts.load);
    tokio::time::sleep(opts.load / 3).await;
    runs
}

/// Waits for the books to close after a kill at `killed`; the time is a figure.
pub(super) async fn books_closed_since(stack: &Stack, found: &mut Found, killed: Instant) {
    let closed = wait_books_closed(stack, Duration::from_secs(40)).await;
    found.figure(
        "reservations_closed_after_kill_seconds",
        json!(closed.map(|_| killed.elapsed().as_secs_f64())),
    );
}

/// The outcomes of some runs, summed.
pub(super) fn outcomes<'a>(reports: impl IntoIterator<Item = &'a Report>) -> BTreeMap<String, u64> {
    let mut all = BTreeMap::new();
    for r in reports {
        for (k, n) in &r.outcomes {
            *all.entry(k.clone()).or_default() += n;
        }
    }
    all
}

/// Completed, or cut with an error event after the first byte: what a client may see when
/// a node or replica dies under it.
pub(super) fn completed_or_cut(outcomes: &BTreeMap<String, u64>) -> (bool, String) {
    let bad: Vec<String> = outcomes
        .iter()
        .filter(|(k, _)| k.as_str() != "200 ok" && !k.starts_with("stream_error"))
        .map(|(k, n)| format!("{k}: {n}"))
        .collect();
    let ok = outcomes.get("200 ok").copied().unwrap_or(0);
    (
        bad.is_empty() && ok > 0,
        format!(
            "{outcomes:?}{}",
            if bad.is_empty() {
                ""
            } else {
                " — unexpected"
            }
        ),
    )
}

/// Waits until no ledger row is reserved; the time it took.
pub(super) async fn wait_books_closed(stack: &Stack, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if books(&stack.db_url).await.is_ok_and(|b| b.open == 0) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    None
}

/// What every drill checks at the end: the books balance and nothing is left reserved.
pub(super) async fn ledger_checks(stack: &Stack, found: &mut Found) {
    match books(&stack.db_url).await {
        Ok(b) => {
            found.check(
                "no reservation left open",
                b.open == 0,
                format!(
                    "{} reserved, {} settled, {} cancelled",
                    b.open, b.settled, b.cancelled
                ),
            );
            let off: Vec<String> = b
                .teams
                .iter()
                .filter(|t| t.balance != t.credits - t.settled_cost)
                .map(|t| {
                    format!(
                        "team {}: balance {} ≠ {} − {}",
                        t.team_id, t.balance, t.credits, t.settled_cost
                    )
                })
                .collect();
            found.check(
                "balance = credits − settled cost, every team",
                off.is_empty(),
                if off.is_empty() {
                    format!("{} teams", b.teams.len())
                } else {
                    off.join("; ")
                },
            );
            found.figure(
                "ledger_rows",
                json!({"settled": b.settled, "cancelled": b.cancelled}),
            );
        }
        Err(e) => found.check("the ledger could be read", false, format!("{e:#}")),
    }
}
