//! `switchyard-loadtest routing`: Switchyard's node choice against `round_robin`,
//! `least_loaded` and an oracle, on the same simulated fleet, the same sessions and the same
//! arrival times, in virtual time ([`fleet`]). Two scenarios:
//! - **mix**: the seeds' fleet (6 × 8B, 4 × 32B, 2 × 70B at 32, 16 and 8 streams a node) under
//!   chats, agent loops and one-shot retrieval questions ([`workload`]) arriving at 50 %, 90 %
//!   and 110 % of capacity, where 100 % is the session rate that would keep every slot busy if
//!   no prompt were ever cached;
//! - **llm-d**: the shape of llm-d's published prefix-cache benchmark: 8 × 8B, 512 clients in a
//!   closed loop, 150 groups of a 6,000-token system prompt, each request one of them plus a
//!   1,200-token question of its own, 900 tokens out (the prompt lengths are options, so the
//!   shape can be swept from where a fleet holds its clients to where it cannot).
//!
//! The figures: TTFT p50/p95/mean per model and for the whole mix (queue wait included), the
//! prefix-cache hit rate (prompt tokens read from a node's cache / prompt tokens),
//! preemptions, and output tokens per GPU-second; `routing.json`, a markdown table and
//! `routing.png`.

pub mod fleet;
mod plot;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use switchyard::sim::{Profile, SimTokenizer};
use tokio::task::JoinSet;

pub use fleet::{ModelSpec, Record, Strategy};
use workload::{Mix, exp, session, shared_prefix_turn};

/// What to run.
#[derive(Debug, Clone)]
pub struct RoutingOptions {
    /// Where routing.json, routing.md and routing.png go.
    pub out: PathBuf,
    /// Seed of the sessions and arrivals.
    pub seed: u64,
    /// Scenarios: `mix`, `llm-d`.
    pub scenarios: Vec<String>,
    /// Loads of the mix, as fractions of capacity.
    pub loads: Vec<f64>,
    /// Virtual seconds before measuring.
    pub warmup: Duration,
    /// Virtual seconds measured.
    pub window: Duration,
    /// Strategies compared.
    pub strategies: Vec<Strategy>,
    /// `node_concurrency` of the llm-d shapes' nodes: 256 (vLLM's `--max-num-seqs`) is no
    /// gateway queue, as behind llm-d; less puts a queue in front of the engines.
    pub llmd_node_concurrency: u32,
    /// The llm-d shapes' prompts.
    pub llmd_shape: LlmdShape,
}

/// The prompts of the llm-d shapes: `groups` shared system prompts of `system` tokens, each
/// request one of them plus a `question` of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LlmdShape {
    /// Shared system prompts.
    pub groups: u64,
    /// Tokens of each.
    pub system: u32,
    /// Tokens of a request's own question.
    pub question: u32,
}

impl Default for LlmdShape {
    fn default() -> Self {
        Self {
            groups: LLMD_GROUPS,
            system: LLMD_SYSTEM,
            question: LLMD_QUESTION,
        }
    }
}

/// One strategy on one model at one load.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `mix` or `llm-d`.
    pub scenario: String,
    /// The strategy.
    pub strategy: Strategy,
    /// Offered load, fraction of capacity (the mix), or clients (llm-d).
    pub load: f64,
    /// The model.
    pub model: String,
    /// Requests sent in the window.
    pub requests: u64,
    /// Of which refused after the queue's deadline.
    pub refused: u64,
    /// TTFT percentiles and mean over the window's answered requests, seconds.
    pub ttft_p50: f64,
    /// See `ttft_p50`.
    pub ttft_p95: f64,
    /// See `ttft_p50`.
    pub ttft_mean: f64,
    /// Prompt tokens read from a node's prefix cache / prompt tokens.
    pub hit_rate: f64,
    /// Sequences the engines preempted (the whole run).
    pub preemptions: u64,
    /// Output tokens of the window's requests / (the model's GPUs × window seconds).
    pub tokens_per_gpu_s: f64,
    /// Output tokens of the window's requests / window seconds.
    pub output_tokens_per_s: f64,
}

/// `routing.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    /// The command line.
    pub command: String,
    /// When, UTC.
    pub date: String,
    /// The seed.
    pub seed: u64,
    /// Warm-up and window, virtual seconds.
    pub warmup_s: f64,
    /// See `warmup_s`.
    pub window_s: f64,
    /// Each model's capacity in the mix (100 % load), sessions per second.
    pub capacity_sessions_per_s: Vec<(String, f64)>,
    /// The llm-d shapes' prompts.
    pub llmd_shape: LlmdShape,
    /// Every figure.
    pub rows: Vec<Row>,
    /// Real seconds the whole benchmark took.
    pub wall_s: f64,
}

/// The seeds' fleet.
pub fn seeds_fleet() -> Vec<ModelSpec> {
    vec![
        ModelSpec {
            name: "8b",
            profile: Profile::B8,
            nodes: 6,
            capacity: 32,
        },
        ModelSpec {
            name: "32b",
            profile: Profile::B32,
            nodes: 4,
            capacity: 16,
        },
        ModelSpec {
            name: "70b",
            profile: Profile::B70,
            nodes: 2,
            capacity: 8,
        },
    ]
}

/// llm-d's benchmark shape.
pub const LLMD_NODES: usize = 8;
/// See [`LLMD_NODES`].
pub const LLMD_CLIENTS: usize = 512;
/// See [`LLMD_NODES`].
pub const LLMD_GROUPS: u64 = 150;
/// See [`LLMD_NODES`].
pub const LLMD_SYSTEM: u32 = 6_000;
/// See [`LLMD_NODES`].
pub const LLMD_QUESTION: u32 = 1_200;
/// See [`LLMD_NODES`].
pub const LLMD_OUTPUT: u32 = 900;
/// `llm-d-short`: the same with short answers, so a request's own tokens are few and the
/// shared prefix is almost all of its work.
pub const LLMD_SHORT_OUTPUT: u32 = 200;

/// Runs the benchmark; every run on its own paused-clock runtime, on this thread.
pub fn run(opts: &RoutingOptions, command: String) -> anyhow::Result<RoutingReport> {
    let started = std::time::Instant::now();
    let tokenizer = SimTokenizer::load().context("loading the simulator's tokenizer")?;
    let mut rows = Vec::new();
    let mut capacities = Vec::new();
    for scenario in &opts.scenarios {
        match scenario.as_str() {
            "mix" => {
                let models = seeds_fleet();
                let sessions = runtime()?.block_on(capacity(
                    opts,
                    &models,
                    &Mix::default(),
                    tokenizer.clone(),
                ));
                for (spec, rate) in models.iter().zip(&sessions) {
                    eprintln!("capacity of {}: {rate:.3} sessions/s", spec.name);
                }
                capacities.extend(
                    models
                        .iter()
                        .map(|s| s.name.to_owned())
                        .zip(sessions.clone()),
                );
                for &load in &opts.loads {
                    for &strategy in &opts.strategies {
                        let r = runtime()?.block_on(mix(
                            opts,
                            strategy,
                            load,
                            &sessions,
                            tokenizer.clone(),
                        ));
                        print_rows(&r);
                        rows.extend(r);
                    }
                }
            }
            "llm-d" | "llm-d-short" => {
                let output = if scenario == "llm-d" {
                    LLMD_OUTPUT
                } else {
                    LLMD_SHORT_OUTPUT
                };
                for &strategy in &opts.strategies {
                    let r = runtime()?.block_on(llmd(
                        opts,
                        scenario,
                        output,
                        strategy,
                        tokenizer.clone(),
                    ));
                    print_rows(&r);
                    rows.extend(r);
                }
            }
            other => {
                anyhow::bail!("unknown routing scenario `{other}` (mix, llm-d, llm-d-short)")
            }
        }
    }
    let report = RoutingReport {
        command,
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        seed: opts.seed,
        warmup_s: opts.warmup.as_secs_f64(),
        window_s: opts.window.as_secs_f64(),
        capacity_sessions_per_s: capacities,
        llmd_shape: opts.llmd_shape,
        rows,
        wall_s: started.elapsed().as_secs_f64(),
    };
    std::fs::create_dir_all(&opts.out)?;
    std::fs::write(
        opts.out.join("routing.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    std::fs::write(opts.out.join("routing.md"), table(&report))?;
    plot::draw(&report, &opts.out.join("routing.png"))?;
    Ok(report)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?)
}

/// Each model's capacity, in sessions per second: the request rate the fleet completes when
/// saturated (three sessions for every slot, run back to back; round robin, though at
/// saturation every strategy hands the next request to the node that just freed a slot),
/// divided by the mean requests in a session.
async fn capacity(
    opts: &RoutingOptions,
    models: &[ModelSpec],
    mix: &Mix,
    tokenizer: Arc<SimTokenizer>,
) -> Vec<f64> {
    let fleet = fleet::Fleet::start(models, Strategy::RoundRobin, tokenizer);
    let (warmup, window) = (60.0, opts.window.as_secs_f64().min(300.0));
    let end = warmup + window;
    let mut loops = JoinSet::new();
    for (m, spec) in models.iter().enumerate() {
        for c in 0..3 * spec.nodes * spec.capacity as usize {
            let fleet = fleet.clone();
            let mix = mix.clone();
            let seed = opts.seed ^ 0xCA9A_C17E;
            loops.spawn(async move {
                let mut n = c as u64;
                while fleet.now() < end {
                    let (_, turns) = session(m as u64, n, seed, &mix);
                    for (t, turn) in turns.iter().enumerate() {
                        tokio::time::sleep(Duration::from_secs_f64(turn.pause)).await;
                        if fleet.now() >= end {
                            break;
                        }
                        fleet.request(m, turn, (n << 8) | t as u64).await;
                    }
                    n += 1 << 20;
                }
            });
        }
    }
    while loops.join_next().await.is_some() {}
    let records = fleet.records();
    (0..models.len())
        .map(|m| {
            let done = records
                .iter()
                .filter(|r| r.model == m && r.sent >= warmup && r.sent < end && r.ttft.is_some())
                .count() as f64;
            let turns: usize = (0..2_000u64)
                .map(|n| session(m as u64, (1 << 40) | n, opts.seed, mix).1.len())
                .sum();
            (done / window) / (turns as f64 / 2_000.0)
        })
        .collect()
}

async fn mix(
    opts: &RoutingOptions,
    strategy: Strategy,
    load: f64,
    capacity: &[f64],
    tokenizer: Arc<SimTokenizer>,
) -> Vec<Row> {
    let models = seeds_fleet();
    let fleet = fleet::Fleet::start(&models, strategy, tokenizer);
    let end = (opts.warmup + opts.window).as_secs_f64();
    let mix = Mix::default();
    let mut arrivals = JoinSet::new();
    for m in 0..models.len() {
        let rate = load * capacity.get(m).copied().unwrap_or(0.0).max(1e-3);
        let fleet = fleet.clone();
        let mix = mix.clone();
        let seed = opts.seed;
        arrivals.spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((m as u64 + 1) * 0x51));
            let mut spawned = JoinSet::new();
            let mut n = 0u64;
            loop {
                let wait = exp(&mut rng, 1.0 / rate);
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
                if fleet.now() >= end {
                    break;
                }
                let (_, turns) = session(m as u64, n, seed, &mix);
                let fleet = fleet.clone();
                spawned.spawn(async move {
                    for (t, turn) in turns.iter().enumerate() {
                        tokio::time::sleep(Duration::from_secs_f64(turn.pause)).await;
                        if fleet.now() >= end {
                            break;
                        }
                        fleet.request(m, turn, (n << 8) | t as u64).await;
                    }
                });
                n += 1;
            }
            while spawned.join_next().await.is_some() {}
        });
    }
    while arrivals.join_next().await.is_some() {}
    rows("mix", strategy, load, &models, &fleet, opts)
}

async fn llmd(
    opts: &RoutingOptions,
    scenario: &str,
    output: u32,
    strategy: Strategy,
    tokenizer: Arc<SimTokenizer>,
) -> Vec<Row> {
    let models = vec![ModelSpec {
        name: "8b",
        profile: Profile::B8,
        nodes: LLMD_NODES,
        // No gateway queue, as behind llm-d's: a node takes what its engine would (vLLM's
        // --max-num-seqs), so every request has every node to choose from.
        capacity: opts.llmd_node_concurrency,
    }];
    let fleet = fleet::Fleet::start(&models, strategy, tokenizer);
    let end = (opts.warmup + opts.window).as_secs_f64();
    let mut clients = JoinSet::new();
    for c in 0..LLMD_CLIENTS {
        let fleet = fleet.clone();
        let seed = opts.seed;
        let shape = opts.llmd_shape;
        clients.spawn(async move {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((c as u64) << 20));
            // Clients start over the first seconds, not all in one instant.
            let start = exp(&mut rng, 5.0).min(30.0);
            tokio::time::sleep(Duration::from_secs_f64(start)).await;
            let mut i = 0u64;
            while fleet.now() < end {
                let group = rand::Rng::random_range(&mut rng, 0..shape.groups);
                let turn =
                    shared_prefix_turn(&mut rng, group, shape.system, shape.question, output);
                fleet.request(0, &turn, ((c as u64) << 32) | i).await;
                i += 1;
            }
        });
    }
    while clients.join_next().await.is_some() {}
    rows(
        scenario,
        strategy,
        LLMD_CLIENTS as f64,
        &models,
        &fleet,
        opts,
    )
}

fn rows(
    scenario: &str,
    strategy: Strategy,
    load: f64,
    models: &[ModelSpec],
    fleet: &fleet::Fleet,
    opts: &RoutingOptions,
) -> Vec<Row> {
    let from = opts.warmup.as_secs_f64();
    let to = from + opts.window.as_secs_f64();
    let records: Vec<Record> = fleet
        .records()
        .into_iter()
        .filter(|r| r.sent >= from && r.sent < to)
        .collect();
    let preemptions: Vec<u64> = fleet
        .stats()
        .iter()
        .map(|s| s.iter().map(|e| e.preemptions).sum())
        .collect();
    let gpus = |spec: &ModelSpec| spec.nodes as f64 * spec.profile.spec().gpus as f64;
    let row = |model: &str, of: &[&Record], preemptions: u64, gpus: f64| {
        let mut row = Row::of(of, opts.window.as_secs_f64(), gpus);
        row.scenario = scenario.to_owned();
        row.strategy = strategy;
        row.load = load;
        row.model = model.to_owned();
        row.preemptions = preemptions;
        row
    };
    let mut out: Vec<Row> = models
        .iter()
        .enumerate()
        .map(|(m, spec)| {
            let mine: Vec<&Record> = records.iter().filter(|r| r.model == m).collect();
            row(
                spec.name,
                &mine,
                preemptions.get(m).copied().unwrap_or(0),
                gpus(spec),
            )
        })
        .collect();
    // The whole fleet's traffic as one: what a caller of the mix sees.
    if models.len() > 1 {
        let all: Vec<&Record> = records.iter().collect();
        out.push(row(
            ALL_MODELS,
            &all,
            preemptions.iter().sum(),
            models.iter().map(gpus).sum(),
        ));
    }
    out
}

/// The `model` of the rows that pool every model's requests.
pub const ALL_MODELS: &str = "all";

impl Row {
    /// The figures of `records` over a window of `window` seconds on `gpus` GPUs; the labels
    /// and preemptions are the caller's.
    fn of(records: &[&Record], window: f64, gpus: f64) -> Row {
        let mut ttft: Vec<f64> = records.iter().filter_map(|r| r.ttft).collect();
        ttft.sort_by(f64::total_cmp);
        let answered = ttft.len();
        let sum: f64 = ttft.iter().sum();
        let prompt: u64 = records.iter().map(|r| u64::from(r.prompt)).sum();
        let cached: u64 = records.iter().map(|r| u64::from(r.cached)).sum();
        let output: u64 = records.iter().map(|r| u64::from(r.output)).sum();
        Row {
            scenario: String::new(),
            strategy: Strategy::RoundRobin,
            load: 0.0,
            model: String::new(),
            requests: records.len() as u64,
            refused: records.iter().filter(|r| r.ttft.is_none()).count() as u64,
            ttft_p50: quantile(&ttft, 0.5),
            ttft_p95: quantile(&ttft, 0.95),
            ttft_mean: if answered == 0 {
                0.0
            } else {
                sum / answered as f64
            },
            hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            preemptions: 0,
            tokens_per_gpu_s: output as f64 / (gpus * window),
            output_tokens_per_s: output as f64 / window,
        }
    }
}

/// The `p` quantile of `sorted` (nearest rank); 0 when empty.
fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Each row as it is measured, as a line of the table.
fn print_rows(rows: &[Row]) {
    for r in rows {
        eprint!("{}", line(r));
    }
}

/// The report as a markdown table (one line per strategy, model and load).
pub fn table(report: &RoutingReport) -> String {
    let mut s = String::from(
        "| scenario | load | model | strategy | TTFT p50 s | TTFT p95 s | TTFT mean s | hit rate | preemptions | tokens/GPU-s | requests | refused |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut rows: Vec<&Row> = report.rows.iter().collect();
    rows.sort_by(|a, b| {
        (a.scenario.as_str(), a.load.to_bits(), a.model.as_str()).cmp(&(
            b.scenario.as_str(),
            b.load.to_bits(),
            b.model.as_str(),
        ))
    });
    for r in rows {
        s.push_str(&line(r));
    }
    s
}

/// One row of the table.
fn line(r: &Row) -> String {
    let load = if r.scenario == "mix" {
        format!("{:.0} %", r.load * 100.0)
    } else {
        format!("{} clients", r.load)
    };
    format!(
        "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.1} % | {} | {:.0} | {} | {} |\n",
        r.scenario,
        load,
        r.model,
        r.strategy.name(),
        r.ttft_p50,
        r.ttft_p95,
        r.ttft_mean,
        r.hit_rate * 100.0,
        r.preemptions,
        r.tokens_per_gpu_s,
        r.requests,
        r.refused,
    )
}

#[cfg(test)]
mod tests;
