//! `peak-200`: the seeds' peak mix (200 streams: 140 on the 8B model, 50 on the 32B, 10 on
//! the 70B) with 2,000-token prompts, on a cluster sized for it: its SLOs must hold. Then
//! more streams than the nodes and the queues hold, ramped in: `switchyard_queue_depth` must
//! rise towards its bound before the first `queue_full`, and every refusal must be typed,
//! never a 5xx or a stream cut.

use std::collections::BTreeMap;
use std::time::Duration;

use indicatif::ProgressBar;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{DrillOptions, Found, ServedModel, Stack, StackConfig, outcomes, wait_books_closed};
use crate::{
    Calibration, Figures, Limit, ModelWeight, Report, RequestRecord, RunConfig, assign_workers,
};

/// One model of the peak mix: its streams at peak and how its engines run.
struct Tier {
    /// The model (SPEC section 1's names).
    model: &'static str,
    /// Its streams at peak (seed 000).
    streams: u32,
    /// Streams one of its replicas carries (seed 000: 32, 16, 8).
    per_node: u32,
    /// Its engines' time to first token, engine ms: a 2,000-token prompt's prefill at the
    /// profile's rate (docs/capacity.md: 6,000, 2,800 and 5,000 tokens/s).
    ttft_ms: u64,
    /// Its engines' time between tokens, engine ms: the profile's decode step at `per_node`
    /// sequences (docs/capacity.md: 47, 24 and 37.5 tokens/s a stream).
    itl_ms: u64,
}

/// The seeds' peak mix.
const MIX: [Tier; 3] = [
    Tier {
        model: "llama-3.1-8b-instruct",
        streams: 140,
        per_node: 32,
        ttft_ms: 333,
        itl_ms: 21,
    },
    Tier {
        model: "qwen2.5-32b-instruct",
        streams: 50,
        per_node: 16,
        ttft_ms: 714,
        itl_ms: 42,
    },
    Tier {
        model: "llama-3.3-70b-instruct",
        streams: 10,
        per_node: 8,
        ttft_ms: 400,
        itl_ms: 27,
    },
];

/// The SLOs the peak must meet, engine time. Seed 000's SLIs set time to first token for
/// the 8B model (p50 1 s, p95 3 s, its 333 ms of prefill included) and at least 20 output
/// tokens a second a stream; the seeds set no TTFT for the others, so each model may add
/// to its own engines' first token what the 8B's targets leave beyond its prefill.
mod slo {
    /// Time to first token beyond the engines' own, median.
    pub const TTFT_P50_ADDED_MS: f64 = 1_000.0 - 333.0;
    /// Time to first token beyond the engines' own, 95th percentile.
    pub const TTFT_P95_ADDED_MS: f64 = 3_000.0 - 333.0;
    /// Output tokens a second of (nearly) every stream: their 5th percentile.
    pub const STREAM_TOKENS_PER_S_P5: f64 = 20.0;
}

/// Teams the load comes from, its runs taking them in turn: a platform's peak is many
/// teams', and each team's settlements queue on its own balance.
const TEAMS: usize = 10;
/// Each team's credits, microcredits: more than the drill spends.
const CREDITS: i64 = 1_000_000_000_000;
/// The peak starts as this many runs, each a tenth of the mix, spread over the ramp: 200
/// prompts arriving in the same instant would measure the start's burst, not the peak.
const PEAK_RUNS: usize = 10;
/// The ramp takes this share of the load, at most [`PEAK_RAMP_MAX`].
const PEAK_RAMP_SHARE: u32 = 2;
/// The longest ramp.
const PEAK_RAMP_MAX: Duration = Duration::from_secs(5);
/// Prompt size of every request (seed 000's load test: "a 2k prompt").
const PROMPT_TOKENS: u32 = 2_000;
/// Output of every request of the peak.
const MAX_TOKENS: u32 = 64;
/// Requests a model's queue holds at the full peak (`[queue] max_waiting`; 256 by
/// default, a quarter of it here so that two cores can overflow it).
const QUEUE_BOUND: usize = 64;
/// The engines run at this fraction of real speed, and the figures are converted back to
/// the engines' time: at real speed the full peak relays 8,000 tokens a second, more than
/// two shared cores carry beside the engines, the agents and the clients.
const TIME_SCALE: f64 = 0.25;
/// How often the replicas' `/metrics` are read.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// Output of every request of the overload: longer than the peak's (3.7 s of engine time
/// on the 8B model, 15 s here), so that streams pile up past the nodes and the queue
/// before the first of them ends, from arrivals no faster than the peak's.
const OVERLOAD_MAX_TOKENS: u32 = 160;
/// Between two runs of the overload, each a tenth of the mix with one request a stream:
/// the 8B model's places and queue (160 + 64 at the full peak) fill in 16 runs, 9.6 s.
const OVERLOAD_STEP: Duration = Duration::from_millis(600);
/// Runs of the overload at most (2.4 times the mix), if no `queue_full` came before.
const OVERLOAD_RUNS_MAX: usize = 24;

/// How big a `peak-200` run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeakShape {
    /// The mix's streams, the streams each node carries and the queues' bound are divided
    /// by this (the nodes are as many as the streams then need).
    pub divisor: u32,
}

impl PeakShape {
    /// The seeds' peak: 200 streams on 5, 4 and 2 nodes of 32, 16 and 8 streams, queues of
    /// 64. It needs a release build: a debug build spends about 1 ms of CPU relaying each
    /// token (replica, agent and engine together), which two cores lack for 200 streams.
    pub const FULL: Self = Self { divisor: 1 };
    /// A quarter: 50 streams (35, 13, 2) on 5, 4 and 1 nodes of 8, 4 and 2 streams, queues
    /// of 16; what the test command's debug build carries.
    pub const QUARTER: Self = Self { divisor: 4 };

    /// Each model's streams at this peak.
    fn streams(self) -> Vec<usize> {
        let weights: Vec<ModelWeight> = MIX
            .iter()
            .map(|t| ModelWeight {
                name: t.model.to_owned(),
                weight: t.streams,
            })
            .collect();
        let total: u32 = MIX.iter().map(|t| t.streams).sum();
        assign_workers(&weights, (total / self.divisor.max(1)) as usize)
    }

    /// Streams a node of model `i` carries.
    fn per_node(self, i: usize) -> u32 {
        (MIX[i].per_node / self.divisor.max(1)).max(1)
    }

    /// Nodes of model `i`: enough for its streams, no more.
    fn nodes(self, i: usize) -> usize {
        self.streams()[i].div_ceil(self.per_node(i) as usize)
    }

    /// Streams the nodes of model `i` carry together.
    fn capacity(self, i: usize) -> usize {
        self.nodes(i) * self.per_node(i) as usize
    }

    /// Requests each model's queue holds.
    fn queue_bound(self) -> usize {
        (QUEUE_BOUND / self.divisor.max(1) as usize).max(1)
    }

    /// Run `run`'s share of each model's streams when the mix comes as [`PEAK_RUNS`] runs:
    /// a tenth, the remainders going to the first runs.
    fn tenth(self, run: usize) -> Vec<usize> {
        let run = run % PEAK_RUNS;
        self.streams()
            .iter()
            .map(|s| s / PEAK_RUNS + usize::from(run < s % PEAK_RUNS))
            .collect()
    }
}

/// The stack of `peak-200`: three replicas, each model on the nodes its peak needs.
pub(super) fn stack(shape: PeakShape) -> (StackConfig, Vec<ServedModel>) {
    let models = MIX
        .iter()
        .enumerate()
        .map(|(i, t)| ServedModel {
            name: t.model.to_owned(),
            nodes: shape.nodes(i),
            node_concurrency: shape.per_node(i),
            ttft_ms: t.ttft_ms,
            itl_ms: t.itl_ms,
        })
        .collect();
    let config = StackConfig {
        time_scale: TIME_SCALE,
        extra_toml: format!("[queue]\nmax_waiting = {}\n", shape.queue_bound()),
        // As in production: nothing fails over here, and a one-second lease changes hands
        // on a busy machine (the drills that kill owners shorten it).
        owner_lease_secs: 6,
        ..StackConfig::default()
    };
    (config, models)
}

/// What one reading of every replica's `/metrics` saw, by model.
#[derive(Debug, Clone, Default)]
struct Sample {
    /// When the reading started, on the drill's clock.
    started: Duration,
    /// When the last replica answered.
    ended: Duration,
    /// `switchyard_queue_depth`, summed over the replicas (only a queue's owner holds any).
    depth: BTreeMap<String, f64>,
    /// `switchyard_requests_total{code="queue_full"}`, summed over the replicas.
    queue_full: BTreeMap<String, f64>,
}

impl Sample {
    fn depth(&self, model: &str) -> f64 {
        self.depth.get(model).copied().unwrap_or(0.0)
    }
}

/// The series `name` of a `/metrics` text by its `model` label, of the lines whose other
/// labels include every one of `with`.
fn by_model(text: &str, name: &str, with: &[(&str, &str)]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((labels, value)) = line
            .strip_prefix(name)
            .and_then(|r| r.strip_prefix('{'))
            .and_then(|r| r.split_once("} "))
        else {
            continue;
        };
        let labels: BTreeMap<&str, &str> = labels
            .split(',')
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        let (Some(model), Ok(value)) = (labels.get("model"), value.trim().parse::<f64>()) else {
            continue;
        };
        if !model.is_empty() && with.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            *out.entry((*model).to_owned()).or_default() += value;
        }
    }
    out
}

/// A replica's `/metrics` text (empty when it cannot be read).
async fn read_metrics(http: &reqwest::Client, url: &str) -> String {
    match http.get(format!("{url}/metrics")).send().await {
        Ok(resp) => resp.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Reads every replica's `/metrics` every [`SAMPLE_EVERY`] until told to stop, and
/// publishes the `queue_full` refusals counted so far as it goes.
struct Sampler {
    stop: watch::Sender<bool>,
    refused: watch::Receiver<f64>,
    task: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    fn start(stack: &Stack, began: Instant) -> Self {
        let http = stack.http().clone();
        let urls: Vec<String> = stack.replicas.iter().map(|r| r.url.clone()).collect();
        let (stop, stopped) = watch::channel(false);
        let (tell, refused) = watch::channel(0.0);
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !*stopped.borrow() {
                let mut sample = Sample {
                    started: began.elapsed(),
                    ..Sample::default()
                };
                let reads = urls.iter().map(|url| read_metrics(&http, url));
                for text in futures::future::join_all(reads).await {
                    for (m, v) in by_model(&text, "switchyard_queue_depth", &[]) {
                        *sample.depth.entry(m).or_default() += v;
                    }
                    let full = [("code", "queue_full")];
                    for (m, v) in by_model(&text, "switchyard_requests_total", &full) {
                        *sample.queue_full.entry(m).or_default() += v;
                    }
                }
                sample.ended = began.elapsed();
                let _ = tell.send(sample.queue_full.values().sum());
                samples.push(sample);
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
            samples
        });
        Self {
            stop,
            refused,
            task,
        }
    }

    /// `queue_full` refusals the replicas have counted so far.
    fn refused(&self) -> f64 {
        *self.refused.borrow()
    }

    /// Stops reading; every sample, in order.
    async fn samples(self) -> anyhow::Result<Vec<Sample>> {
        let _ = self.stop.send(true);
        Ok(self.task.await?)
    }
}

/// What every run of the drill shares.
struct Load {
    shape: PeakShape,
    /// A key of each team the load comes from.
    keys: Vec<String>,
    /// The prompts' sizing, probed once.
    calibration: Vec<Calibration>,
    /// The drill's clock: samples and runs are placed on it.
    began: Instant,
}

impl Load {
    /// Run `run` of the load, with the key of a team taken in turn.
    fn run(
        &self,
        stack: &Stack,
        run: usize,
        streams: &[usize],
        limit: Limit,
        max_tokens: u32,
    ) -> RunConfig {
        let key = &self.keys[run % self.keys.len()];
        run_config(stack, key, streams, limit, max_tokens)
    }
}

/// Load with `key`: `streams[i]` workers on model `i` of [`MIX`], through every replica
/// (their requests take the replicas in turn).
fn run_config(
    stack: &Stack,
    key: &str,
    streams: &[usize],
    limit: Limit,
    max_tokens: u32,
) -> RunConfig {
    let urls: Vec<String> = stack
        .replicas
        .iter()
        .map(|r| format!("{}/v1", r.url))
        .collect();
    let mut cfg = RunConfig::new(urls.join(","), MIX[0].model);
    // Weights equal to the streams: the largest remainder gives each model exactly its own.
    cfg.models = MIX
        .iter()
        .zip(streams)
        .map(|(t, n)| ModelWeight {
            name: t.model.to_owned(),
            weight: u32::try_from(*n).unwrap_or(u32::MAX),
        })
        .collect();
    cfg.api_key = Some(key.to_owned());
    cfg.streams = streams.iter().sum();
    cfg.limit = limit;
    cfg.prompt_tokens = PROMPT_TOKENS;
    cfg.max_tokens = max_tokens;
    cfg.time_scale = TIME_SCALE;
    cfg.timeout = Duration::from_secs(180);
    cfg
}

/// A run of load, launched at `launched` on the drill's clock.
struct Wave {
    launched: Duration,
    run: JoinHandle<anyhow::Result<Report>>,
}

impl Wave {
    fn start(cfg: RunConfig, load: &Load) -> Self {
        Self {
            launched: load.began.elapsed(),
            run: tokio::spawn(crate::run_calibrated(cfg, load.calibration.clone())),
        }
    }
}

/// Every wave's report, with when it was launched.
async fn finish(waves: Vec<Wave>) -> anyhow::Result<Vec<(Duration, Report)>> {
    let mut done = Vec::new();
    for w in waves {
        done.push((w.launched, w.run.await??));
    }
    Ok(done)
}

/// Figures of one model over some runs' requests, in engine time.
fn model_figures<'a>(
    records: impl IntoIterator<Item = &'a RequestRecord>,
    model: &str,
    wall: Duration,
) -> Figures {
    let wall_us = u64::try_from(wall.as_micros()).unwrap_or(u64::MAX);
    Figures::compute(records.into_iter().filter(|r| r.model == model), wall_us)
        .to_engine_time(TIME_SCALE)
}

/// The peak: [`PEAK_RUNS`] closed-loop runs of a tenth of the mix each, launched over the
/// ramp and all starting their last request by the end of the load; its SLOs, over every
/// request.
async fn peak(
    stack: &Stack,
    opts: &DrillOptions,
    found: &mut Found,
    load: &Load,
) -> anyhow::Result<()> {
    let ramp = (opts.load / PEAK_RAMP_SHARE).min(PEAK_RAMP_MAX);
    let step = ramp / u32::try_from(PEAK_RUNS).unwrap_or(1);
    let started = Instant::now();
    let mut waves = Vec::new();
    for i in 0..PEAK_RUNS {
        let left = Limit::Duration(opts.load.saturating_sub(started.elapsed()));
        let cfg = load.run(stack, i, &load.shape.tenth(i), left, MAX_TOKENS);
        waves.push(Wave::start(cfg, load));
        if i + 1 < PEAK_RUNS {
            tokio::time::sleep(step).await;
        }
    }
    let reports = finish(waves).await?;
    let wall = started.elapsed();
    let records: Vec<&RequestRecord> = reports.iter().flat_map(|(_, r)| &r.requests).collect();
    let all = outcomes(reports.iter().map(|(_, r)| r));
    let completed = all.get("200 ok").copied().unwrap_or(0);
    found.check(
        "every stream of the peak completes",
        completed > 0 && all.len() == 1,
        format!("{all:?}"),
    );
    found.figure("peak_outcomes", json!(all));
    let mut per_model = BTreeMap::new();
    for (i, tier) in MIX.iter().enumerate() {
        let f = model_figures(records.iter().copied(), tier.model, wall);
        slo_check(found, tier, &f);
        // Beyond the engines' own first token, in wall-clock time: what the replicas, the
        // agents and the clients add, not shrunk by the time scale.
        let wall_ttft =
            Figures::compute(records.iter().copied().filter(|r| r.model == tier.model), 0).ttft_ms;
        let engine_wall = tier.ttft_ms as f64 / TIME_SCALE;
        per_model.insert(
            tier.model,
            json!({
                "streams": load.shape.streams()[i],
                "nodes": load.shape.nodes(i),
                "completed": f.completed,
                "ttft_ms": {"p50": f.ttft_ms.p50, "p95": f.ttft_ms.p95, "p99": f.ttft_ms.p99,
                            "max": f.ttft_ms.max},
                "per_stream_tokens_per_s": {"p5": f.per_stream_tokens_per_s.p5,
                                            "p50": f.per_stream_tokens_per_s.p50},
                "prompt_tokens_mean": f.prompt_tokens_mean,
                "ttft_beyond_engines_wall_clock_ms": {"p50": wall_ttft.p50 - engine_wall,
                                             "p99": wall_ttft.p99 - engine_wall},
            }),
        );
    }
    found.figure("peak", json!(per_model));
    Ok(())
}

/// Model `tier`'s SLOs ([`slo`]) over its figures `f`.
fn slo_check(found: &mut Found, tier: &Tier, f: &Figures) {
    let engine = tier.ttft_ms as f64;
    let (p50_max, p95_max) = (
        engine + slo::TTFT_P50_ADDED_MS,
        engine + slo::TTFT_P95_ADDED_MS,
    );
    let (ttft, tps) = (&f.ttft_ms, &f.per_stream_tokens_per_s);
    found.check(
        &format!(
            "{}: TTFT p50 ≤ {p50_max:.0} ms and p95 ≤ {p95_max:.0} ms, ≥ {} tokens/s a stream",
            tier.model,
            slo::STREAM_TOKENS_PER_S_P5
        ),
        f.completed > 0
            && ttft.p50 <= p50_max
            && ttft.p95 <= p95_max
            && tps.p5 >= slo::STREAM_TOKENS_PER_S_P5,
        format!(
            "{} completed; TTFT p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms (its engines' {} ms); \
             {:.1} tokens/s a stream at p5, {:.1} at p50 (its engines' {:.1})",
            f.completed,
            ttft.p50,
            ttft.p95,
            ttft.p99,
            tier.ttft_ms,
            tps.p5,
            tps.p50,
            1000.0 / tier.itl_ms as f64
        ),
    );
}

/// The overload: runs of a tenth of the mix with one request a stream, one every
/// [`OVERLOAD_STEP`], until the replicas count a `queue_full`.
async fn overload(
    stack: &Stack,
    found: &mut Found,
    load: &Load,
    sampler: &Sampler,
) -> anyhow::Result<Vec<(Duration, Report)>> {
    let mut waves = Vec::new();
    let before = sampler.refused();
    let mut streams = 0;
    while waves.len() < OVERLOAD_RUNS_MAX && sampler.refused() <= before {
        let tenth = load.shape.tenth(waves.len());
        let one_each = Limit::Requests(tenth.iter().sum::<usize>() as u64);
        let cfg = load.run(stack, waves.len(), &tenth, one_each, OVERLOAD_MAX_TOKENS);
        streams += cfg.streams;
        waves.push(Wave::start(cfg, load));
        tokio::time::sleep(OVERLOAD_STEP).await;
    }
    found.figure("overload_streams", json!(streams));
    finish(waves).await
}

/// When the clients saw `model`'s first `queue_full`, on the drill's clock: at the
/// earliest, as a run starts its own clock after its launch.
fn first_refusal_seen(reports: &[(Duration, Report)], model: &str) -> Option<Duration> {
    reports
        .iter()
        .flat_map(|(launched, r)| r.requests.iter().map(move |q| (*launched, q)))
        .filter(|(_, q)| q.model == model && q.outcome == "429 queue_full")
        .map(|(launched, q)| launched + Duration::from_micros(q.end_us))
        .min()
}

/// Requests of `model` with `outcome` in some runs.
fn count(reports: &[(Duration, Report)], model: &str, outcome: &str) -> usize {
    reports
        .iter()
        .flat_map(|(_, r)| &r.requests)
        .filter(|q| q.model == model && q.outcome == outcome)
        .count()
}

/// How `model`'s queue rose before its first refusal at `refused`: when a reading that
/// ended before it first saw the queue non-empty since it was last seen empty, and the
/// deepest such reading.
fn rise_before(samples: &[Sample], model: &str, refused: Duration) -> (Option<Duration>, f64) {
    let before: Vec<&Sample> = samples.iter().filter(|s| s.ended < refused).collect();
    let last_empty = before.iter().rposition(|s| s.depth(model) == 0.0);
    let rose = before
        .iter()
        .skip(last_empty.map_or(0, |i| i + 1))
        .find(|s| s.depth(model) > 0.0)
        .map(|s| s.ended);
    let deepest = before.iter().map(|s| s.depth(model)).fold(0.0, f64::max);
    (rose, deepest)
}

/// The overload's checks: typed refusals only, and every refused model's queue seen
/// rising to at least half its bound before its first refusal.
fn overload_checks(
    found: &mut Found,
    shape: PeakShape,
    reports: &[(Duration, Report)],
    samples: &[Sample],
    since: Duration,
) {
    let all = outcomes(reports.iter().map(|(_, r)| r));
    let typed = ["200 ok", "429 queue_full", "503 capacity_exhausted"];
    let untyped: Vec<String> = all
        .iter()
        .filter(|(k, _)| !typed.contains(&k.as_str()))
        .map(|(k, n)| format!("{k}: {n}"))
        .collect();
    found.check(
        "past the bound, refusals are 429 queue_full (or 503 capacity_exhausted), \
         never a 5xx or a cut stream",
        untyped.is_empty() && all.contains_key("429 queue_full"),
        format!("{all:?}"),
    );
    found.figure("overload_outcomes", json!(all));
    let bound = shape.queue_bound() as f64;
    let during: Vec<Sample> = samples
        .iter()
        .filter(|s| s.started >= since)
        .cloned()
        .collect();
    let records: Vec<&RequestRecord> = reports.iter().flat_map(|(_, r)| &r.requests).collect();
    let mut per_model = BTreeMap::new();
    let mut rises = Vec::new();
    for (i, tier) in MIX.iter().enumerate() {
        let m = tier.model;
        // The replicas' count of refusals, or the clients' sight of one: the earlier.
        let counted = during
            .iter()
            .find(|s| s.queue_full.get(m).is_some_and(|n| *n > 0.0))
            .map(|s| s.started);
        let refused = [counted, first_refusal_seen(reports, m)]
            .into_iter()
            .flatten()
            .min();
        let f = model_figures(records.iter().copied(), m, Duration::ZERO);
        let mut figure = json!({
            "capacity": shape.capacity(i),
            "queue_bound": shape.queue_bound(),
            "queue_depth_max": during.iter().map(|s| s.depth(m)).fold(0.0, f64::max),
            "queue_full": count(reports, m, "429 queue_full"),
            "completed": f.completed,
            "ttft_ms": {"p50": f.ttft_ms.p50, "p99": f.ttft_ms.p99},
        });
        if let Some(refused) = refused {
            let (rose, deepest) = rise_before(&during, m, refused);
            let lead = rose.map(|t| refused.saturating_sub(t).as_secs_f64());
            figure["queue_depth_before_first_refusal"] = json!(deepest);
            figure["queue_rose_seconds_before_first_refusal"] = json!(lead);
            rises.push((m, rose.is_some() && deepest >= bound / 2.0, lead, deepest));
        }
        per_model.insert(m, figure);
    }
    found.figure("overload", json!(per_model));
    let detail: Vec<String> = rises
        .iter()
        .map(|(m, _, lead, deepest)| match lead {
            Some(lead) => format!(
                "{m}: non-empty {lead:.2} s before its first queue_full, {deepest} of {bound} deep"
            ),
            None => format!("{m}: refused with its queue never seen non-empty"),
        })
        .collect();
    found.check(
        "switchyard_queue_depth rises to half its bound or more before the first queue_full",
        !rises.is_empty() && rises.iter().all(|r| r.1),
        if detail.is_empty() {
            "no model refused".to_owned()
        } else {
            detail.join("; ")
        },
    );
}

/// The peak, then the overload.
pub(super) async fn peak_200(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
    shape: PeakShape,
) -> anyhow::Result<()> {
    let streams = shape.streams();
    found.figure(
        "shape",
        json!({
            "streams": streams,
            "nodes": (0..MIX.len()).map(|i| shape.nodes(i)).collect::<Vec<_>>(),
            "streams_per_node": (0..MIX.len()).map(|i| shape.per_node(i)).collect::<Vec<_>>(),
            "queue_bound": shape.queue_bound(),
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS,
            "overload_max_tokens": OVERLOAD_MAX_TOKENS,
            "time_scale": TIME_SCALE,
            "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        }),
    );
    let mut keys = Vec::new();
    for i in 0..TEAMS {
        keys.push(stack.add_team(&format!("peak-{i}"), CREDITS).await?.1);
    }
    // The prompts are sized once, for every model, before the clock starts.
    let probe = run_config(stack, &keys[0], &[1, 1, 1], Limit::Requests(1), 1);
    let load = Load {
        shape,
        keys,
        calibration: crate::calibrate_models(&probe).await?,
        began: Instant::now(),
    };
    let sampler = Sampler::start(stack, load.began);
    bar.set_message(format!(
        "the peak mix: {} streams, 2,000-token prompts",
        streams.iter().sum::<usize>()
    ));
    let peaked = peak(stack, opts, found, &load).await;
    let since = load.began.elapsed();
    bar.set_message("overload: streams past the nodes and the queues");
    let overloaded = match peaked {
        Ok(()) => overload(stack, found, &load, &sampler).await,
        Err(e) => Err(e),
    };
    let samples = sampler.samples().await?;
    let during_peak = samples
        .iter()
        .filter(|s| s.ended <= since)
        .flat_map(|s| s.depth.values())
        .fold(0.0, |a: f64, b| a.max(*b));
    found.figure("peak_queue_depth_max", json!(during_peak));
    overload_checks(found, shape, &overloaded?, &samples, since);
    bar.set_message("waiting for the books to close");
    wait_books_closed(stack, Duration::from_secs(60)).await;
    Ok(())
}
