//! The suite's scenarios. Each starts its own stack (a simulated engine at the scenario's
//! timing, `serve` replicas on a fresh PostgreSQL database and their own Redis, one node
//! agent, a key with every limit set), runs [`compare`] against the engine and through the
//! subject, and turns each comparison into [`Figure`]s.

use std::time::Duration;

use anyhow::Context;
use tokio::process::Child;

use super::sample::{Peaks, Watch};
use super::{BenchOptions, Figure, Found, LiteLlm, Run};
use crate::compare::{CompareConfig, Role, compare};
use crate::drill::{MODEL, Stack, StackConfig};
use crate::{Limit, RunConfig};

/// The figures of a latency comparison.
const LATENCY: &[&str] = &[
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "tokens_per_s",
    "cpu_us_per_token",
    "peak_rss_mib",
    "failed",
];

/// A stack for the bench: `replicas` replicas, one node whose engine answers after 50 ms and
/// then every 20 ms divided by `time_scale`. The simulator is no GPU, so the node takes every
/// stream the load sends (a queue at the gateway would measure queueing, not the gateway);
/// owner leases as in production.
fn stack_config(replicas: usize, time_scale: f64) -> StackConfig {
    StackConfig {
        replicas,
        nodes: 1,
        time_scale,
        node_concurrency: 100_000,
        extra_toml: "[queue]\nmax_waiting = 100000\n".to_owned(),
        owner_lease_secs: 6,
        ..StackConfig::default()
    }
}

/// The pid of a child still running.
fn pid(child: Option<&Child>) -> anyhow::Result<u32> {
    child
        .and_then(Child::id)
        .context("a process of the stack is not running")
}

/// The processes of a one-node stack: replicas' pids, the agent's, the engine's.
struct Pids {
    serve: Vec<u32>,
    agent: u32,
    engine: u32,
}

impl Pids {
    fn of(stack: &Stack) -> anyhow::Result<Self> {
        Ok(Self {
            serve: stack
                .replicas
                .iter()
                .map(|r| pid(r.child.as_ref()))
                .collect::<anyhow::Result<_>>()?,
            agent: pid(stack.agents.first().and_then(Option::as_ref))?,
            engine: pid(stack.engines.first().and_then(Option::as_ref))?,
        })
    }

    /// Every replica and the agent as the gateway's path, the engine as itself.
    fn roles(&self) -> Vec<(Role, u32)> {
        let mut roles: Vec<(Role, u32)> = self.serve.iter().map(|&p| (Role::Gateway, p)).collect();
        roles.push((Role::Agent, self.agent));
        roles.push((Role::Engine, self.engine));
        roles
    }

    fn watch(&self) -> Vec<Watch> {
        let mut watch: Vec<Watch> = self
            .serve
            .iter()
            .enumerate()
            .map(|(i, &p)| Watch::rss(&format!("serve-{i}"), p))
            .collect();
        watch.push(Watch::rss("agent", self.agent));
        watch.push(Watch::rss("engine", self.engine));
        watch
    }
}

/// Closed-loop load of `streams` workers for one phase, 64 tokens of ~500-token prompts.
fn load(opts: &BenchOptions, url: &str, key: Option<&str>, streams: usize) -> RunConfig {
    let mut cfg = RunConfig::new(url, MODEL);
    cfg.api_key = key.map(str::to_owned);
    cfg.streams = streams;
    cfg.limit = Limit::Duration(opts.phase);
    cfg.prompt_tokens = 500;
    cfg.max_tokens = 64;
    cfg.progress = opts.progress;
    cfg
}

/// The engine's and the first replica's OpenAI base URLs.
fn urls(stack: &Stack, replica: usize) -> anyhow::Result<(String, String)> {
    let engine = stack.engine_ports.first().context("no engine")?;
    let gateway = &stack.replicas.get(replica).context("no such replica")?.url;
    Ok((
        format!("http://127.0.0.1:{engine}/v1"),
        format!("{gateway}/v1"),
    ))
}

/// One comparison, direct against `gateway`, with the peaks of `watch` over it.
async fn measure(
    opts: &BenchOptions,
    subject: &str,
    direct: RunConfig,
    gateway: RunConfig,
    pids: Vec<(Role, u32)>,
    watch: Vec<Watch>,
) -> anyhow::Result<Run> {
    let streams = gateway.streams as u64;
    eprintln!("bench:   {subject}, {streams} streams");
    let peaks = Peaks::start(watch);
    let report = compare(CompareConfig {
        direct,
        gateway,
        rounds: opts.rounds,
        pids,
    })
    .await;
    let peaks = peaks.finish().await;
    Ok(Run {
        subject: subject.to_owned(),
        streams,
        peaks,
        compare: report.with_context(|| format!("{subject} at {streams} streams"))?,
    })
}

/// Keeps the run and its figures `names`.
fn keep(found: &mut Found, scenario: &str, run: Run, names: &[&str]) {
    for name in names {
        if let Some((value, direct)) = figure_of(&run, name) {
            found.figures.push(Figure::new(
                scenario,
                &run.subject,
                run.streams,
                name,
                value,
                direct,
            ));
        }
    }
    found.runs.push(run);
}

/// Figure `name` of a run: (through the subject, direct); `None` when it cannot be had (no
/// tokens, no CPU measured).
pub(super) fn figure_of(run: &Run, name: &str) -> Option<(f64, f64)> {
    let c = &run.compare;
    let (d, g) = (&c.direct, &c.gateway);
    // CPU seconds of the subject's processes in its phases, and the engine's in the direct ones.
    let subject_cpu: f64 = c
        .cpu
        .iter()
        .filter(|p| p.role != Role::Engine)
        .map(|p| p.gateway.cpu_s)
        .sum();
    let engine_cpu: f64 = c
        .cpu
        .iter()
        .filter(|p| p.role == Role::Engine)
        .map(|p| p.direct.cpu_s)
        .sum();
    let per = |cpu: f64, n: u64| (n > 0 && cpu > 0.0).then(|| cpu * 1e6 / n as f64);
    let rss = |f: &dyn Fn(&str) -> bool| -> f64 {
        let bytes: f64 = run
            .peaks
            .iter()
            .filter_map(|(k, v)| f(k.strip_prefix("rss_bytes.")?).then_some(*v))
            .sum();
        bytes / (1024.0 * 1024.0)
    };
    let engine_rss = rss(&|p| p == "engine");
    match name {
        "ttft_p50_ms" => Some((g.ttft_ms.p50, d.ttft_ms.p50)),
        "ttft_p99_ms" => Some((g.ttft_ms.p99, d.ttft_ms.p99)),
        "itl_p50_ms" => Some((g.itl_ms.p50, d.itl_ms.p50)),
        "itl_p99_ms" => Some((g.itl_ms.p99, d.itl_ms.p99)),
        "tokens_per_s" => Some((g.total_tokens_per_s, d.total_tokens_per_s)),
        "new_streams_per_s" => Some((g.completed_requests_per_s, d.completed_requests_per_s)),
        "completed" => Some((g.completed as f64, d.completed as f64)),
        "failed" => Some((
            g.requests.saturating_sub(g.completed) as f64,
            d.requests.saturating_sub(d.completed) as f64,
        )),
        "cpu_us_per_token" => Some((
            per(subject_cpu, g.completion_tokens_sum)?,
            per(engine_cpu, d.completion_tokens_sum)?,
        )),
        "cpu_us_per_stream" => Some((
            per(subject_cpu, g.completed)?,
            per(engine_cpu, d.completed)?,
        )),
        "tokens_per_core_s" => Some((
            1e6 / per(subject_cpu, g.completion_tokens_sum)?,
            1e6 / per(engine_cpu, d.completion_tokens_sum)?,
        )),
        "peak_rss_mib" => Some((rss(&|p| p != "engine"), engine_rss)),
        "serve_peak_rss_mib" => Some((rss(&|p| p.starts_with("serve")), engine_rss)),
        "agent_peak_rss_mib" => Some((rss(&|p| p == "agent"), engine_rss)),
        "peak_streams" => {
            let carried: f64 = run
                .peaks
                .iter()
                .filter(|(k, _)| k.starts_with("streams.serve"))
                .map(|(_, v)| *v)
                .sum();
            Some((carried, *run.peaks.get("streams.engine")?))
        }
        _ => None,
    }
}

/// Stops the stack; after a failure, or requests through the gateway that failed, its logs
/// stay and their directory is noted.
async fn finish(stack: Stack, failed: bool, found: &mut Found) {
    let refused = found
        .runs
        .iter()
        .any(|r| r.compare.gateway.completed < r.compare.gateway.requests);
    let keep = failed || refused;
    if keep {
        found.logs = Some(stack.work_dir().display().to_string());
    }
    if let Err(e) = stack.stop(keep).await {
        found
            .notes
            .push(format!("could not drop the stack's database: {e:#}"));
    }
}

/// Added TTFT and ITL, throughput ratio, CPU and memory at 1, 50 and 200 streams, through
/// Switchyard and through LiteLLM's proxy, each against the same engine directly.
pub(super) async fn overhead(
    opts: &BenchOptions,
    peer: bool,
    found: &mut Found,
) -> anyhow::Result<()> {
    found.setup = format!(
        "switchyard sim --profile fixed: 50 ms to the first token, 20 ms per token; ~500-token \
         prompts, 64 tokens; {:.0} s phases, {} rounds; one serve on PostgreSQL + Redis, one agent{}",
        opts.phase.as_secs_f64(),
        opts.rounds,
        if peer {
            format!("; LiteLLM's proxy with {} workers", opts.litellm_workers)
        } else {
            String::new()
        }
    );
    let stack = Stack::start(&opts.bin, &opts.database, stack_config(1, 1.0)).await?;
    let outcome = overhead_on(&stack, opts, peer, found).await;
    finish(stack, outcome.is_err(), found).await;
    outcome
}

async fn overhead_on(
    stack: &Stack,
    opts: &BenchOptions,
    peer: bool,
    found: &mut Found,
) -> anyhow::Result<()> {
    let (engine, gateway) = urls(stack, 0)?;
    let pids = Pids::of(stack)?;
    let proxy = if peer {
        match LiteLlm::start(
            &opts.peers,
            &opts.out.join("litellm"),
            &engine,
            opts.litellm_workers,
        )
        .await
        {
            Ok(p) => Some(p),
            Err(e) => {
                found.notes.push(format!("LiteLLM left out: {e:#}"));
                None
            }
        }
    } else {
        None
    };
    for streams in [1, 50, 200] {
        let run = measure(
            opts,
            "switchyard",
            load(opts, &engine, None, streams),
            load(opts, &gateway, Some(&stack.key), streams),
            pids.roles(),
            pids.watch(),
        )
        .await?;
        keep(found, "overhead", run, LATENCY);
        let Some(proxy) = &proxy else { continue };
        let litellm = proxy.pid().context("LiteLLM is not running")?;
        let run = measure(
            opts,
            "litellm",
            load(opts, &engine, None, streams),
            load(opts, &proxy.url, Some(&proxy.key), streams),
            vec![(Role::Gateway, litellm), (Role::Engine, pids.engine)],
            vec![
                Watch::Rss {
                    name: "litellm".to_owned(),
                    pid: litellm,
                    tree: true,
                },
                Watch::rss("engine", pids.engine),
            ],
        )
        .await;
        match run {
            Ok(run) => keep(found, "overhead", run, LATENCY),
            Err(e) => found.notes.push(format!("LiteLLM: {e:#}")),
        }
    }
    if let Some(proxy) = proxy {
        proxy.stop().await;
    }
    Ok(())
}

/// The highest rate of new streams with full admission: every request one token from an
/// engine answering in 1 ms, through a key whose every limit is set; also with a fresh
/// Idempotency-Key each (the generation lifecycle's record).
pub(super) async fn admission(opts: &BenchOptions, found: &mut Found) -> anyhow::Result<()> {
    let streams = 200;
    found.setup = format!(
        "switchyard sim --profile fixed at time scale 50: 1 ms to the (only) token; max_tokens 1, \
         ~50-token prompts, {streams} closed-loop workers; {:.0} s phases, {} rounds; one serve on \
         PostgreSQL + Redis, one agent",
        opts.phase.as_secs_f64(),
        opts.rounds
    );
    let stack = Stack::start(&opts.bin, &opts.database, stack_config(1, 50.0)).await?;
    let outcome = admission_on(&stack, opts, streams, found).await;
    finish(stack, outcome.is_err(), found).await;
    outcome
}

async fn admission_on(
    stack: &Stack,
    opts: &BenchOptions,
    streams: usize,
    found: &mut Found,
) -> anyhow::Result<()> {
    let (engine, gateway) = urls(stack, 0)?;
    let pids = Pids::of(stack)?;
    for (subject, keyed) in [("switchyard", false), ("switchyard idempotent", true)] {
        let side = |url: &str, key: Option<&str>| {
            let mut cfg = load(opts, url, key, streams);
            cfg.max_tokens = 1;
            cfg.prompt_tokens = 50;
            cfg.idempotency_keys = keyed;
            cfg
        };
        let run = measure(
            opts,
            subject,
            side(&engine, None),
            side(&gateway, Some(&stack.key)),
            pids.roles(),
            pids.watch(),
        )
        .await?;
        keep(
            found,
            "admission",
            run,
            &[
                "new_streams_per_s",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "cpu_us_per_stream",
                "failed",
            ],
        );
    }
    Ok(())
}

/// Many concurrent streams of one team on one replica (10,000; fewer with `--quick`): every
/// worker sends one long request at once; the replica's and the agent's memory, the streams
/// the replica carried at once, CPU per token.
pub(super) async fn many_streams(opts: &BenchOptions, found: &mut Found) -> anyhow::Result<()> {
    let max_tokens = if opts.quick { 10 } else { 30 };
    let ramp = if opts.quick { 5 } else { 30 };
    found.setup = format!(
        "switchyard sim --profile fixed at time scale 0.01: 5 s to the first token, 2 s per token; \
         {} workers starting evenly over {ramp} s, one request each ({max_tokens} tokens, ~16-token \
         prompts), direct then through one serve on PostgreSQL + Redis and one agent",
        opts.many
    );
    let stack = Stack::start(&opts.bin, &opts.database, stack_config(1, 0.01)).await?;
    let ramp = Duration::from_secs(ramp);
    let outcome = many_on(&stack, opts, max_tokens, ramp, found).await;
    finish(stack, outcome.is_err(), found).await;
    outcome
}

async fn many_on(
    stack: &Stack,
    opts: &BenchOptions,
    max_tokens: u32,
    ramp: Duration,
    found: &mut Found,
) -> anyhow::Result<()> {
    let (engine, gateway) = urls(stack, 0)?;
    let pids = Pids::of(stack)?;
    let side = |url: &str, key: Option<&str>| {
        let mut cfg = load(opts, url, key, opts.many);
        cfg.limit = Limit::Requests(opts.many as u64);
        cfg.max_tokens = max_tokens;
        cfg.prompt_tokens = 16;
        // No calibration probes: each would wait the engine's 5 s.
        cfg.tokens_per_word = Some(1.3);
        // Arriving over a while, as clients do: a stream lasts 5 s + 2 s a token, so all of
        // them are open at once from the end of the ramp until the first ends.
        cfg.ramp = ramp;
        cfg.timeout = Duration::from_secs(600);
        cfg
    };
    let mut watch = pids.watch();
    watch.push(Watch::Metric {
        name: "serve-0".to_owned(),
        url: stack.replicas[0].url.clone(),
        metric: "switchyard_active_streams".to_owned(),
    });
    watch.push(Watch::Metric {
        name: "engine".to_owned(),
        url: engine.trim_end_matches("/v1").to_owned(),
        metric: "vllm:num_requests_running".to_owned(),
    });
    // One phase a side: the load is the whole scenario, not a sample of a steady state.
    let one_round = BenchOptions {
        rounds: 1,
        ..opts.clone()
    };
    let run = measure(
        &one_round,
        "switchyard",
        side(&engine, None),
        side(&gateway, Some(&stack.key)),
        pids.roles(),
        watch,
    )
    .await?;
    keep(
        found,
        "10k",
        run,
        &[
            "peak_streams",
            "completed",
            "failed",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "serve_peak_rss_mib",
            "agent_peak_rss_mib",
            "cpu_us_per_token",
        ],
    );
    Ok(())
}

/// The cross-replica relay: three replicas, the node's socket and the first team's budget on
/// the first; `local` enters there, `relayed` enters the second replica with a team whose
/// budget the second owns, so the queue's decision is made there on a grant and the assign and
/// every frame cross Redis. Tokens per second per core of the gateway's processes.
pub(super) async fn relay(opts: &BenchOptions, found: &mut Found) -> anyhow::Result<()> {
    let streams: &[usize] = if opts.quick { &[50] } else { &[1, 200] };
    found.setup = format!(
        "switchyard sim --profile fixed: 50 ms to the first token, 20 ms per token; ~500-token \
         prompts, 64 tokens; {:.0} s phases, {} rounds; three serve replicas on one PostgreSQL + \
         Redis, one agent on the first; CPU of all three replicas and the agent",
        opts.phase.as_secs_f64(),
        opts.rounds
    );
    let stack = Stack::start(&opts.bin, &opts.database, stack_config(3, 1.0)).await?;
    let outcome = relay_on(&stack, opts, streams, found).await;
    finish(stack, outcome.is_err(), found).await;
    outcome
}

async fn relay_on(
    stack: &Stack,
    opts: &BenchOptions,
    streams: &[usize],
    found: &mut Found,
) -> anyhow::Result<()> {
    let (engine, local) = urls(stack, 0)?;
    let (_, relayed) = urls(stack, 1)?;
    let pids = Pids::of(stack)?;
    let (_, second) = stack.add_team("relay", 1_000_000_000_000_000).await?;
    // A team's budget is owned by the replica its first request enters.
    warm(stack, &local, &stack.key).await?;
    warm(stack, &relayed, &second).await?;
    for &n in streams {
        for (subject, url, key) in [
            ("switchyard local", &local, &stack.key),
            ("switchyard relayed", &relayed, &second),
        ] {
            let run = measure(
                opts,
                subject,
                load(opts, &engine, None, n),
                load(opts, url, Some(key.as_str()), n),
                pids.roles(),
                pids.watch(),
            )
            .await?;
            keep(
                found,
                "relay",
                run,
                &[
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "itl_p99_ms",
                    "tokens_per_s",
                    "tokens_per_core_s",
                    "cpu_us_per_token",
                    "failed",
                ],
            );
        }
    }
    Ok(())
}

/// One short completion through `url` with `key`.
async fn warm(stack: &Stack, url: &str, key: &str) -> anyhow::Result<()> {
    let body = serde_json::json!({
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]
    });
    stack
        .http()
        .post(format!("{url}/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await?
        .error_for_status()
        .with_context(|| format!("a first request through {url}"))?;
    Ok(())
}
