//! Command line of switchyard-loadtest: parses arguments into a `RunConfig`,
//! runs the scenario, prints the report to stdout and writes `--out` JSON.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use switchyard_loadtest::{
    CompareConfig, Limit, ModelWeight, Role, RunConfig, parse_duration, parse_mix,
};

#[derive(Debug, Parser)]
#[command(
    name = "switchyard-loadtest",
    version,
    about = "Load harness for any OpenAI-compatible endpoint"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// N closed-loop workers sending streaming chat completions.
    Run(RunArgs),
    /// The same load directly against an engine and through the gateway, alternating.
    Compare(CompareArgs),
    /// A chaos drill on a local cluster it starts (replicas, nodes, its own Redis, a fresh
    /// PostgreSQL database): load, the fault, then its invariants checked.
    Drill(DrillArgs),
    /// The bank check: randomized requests across replicas and teams with faults at random;
    /// the books must balance exactly afterwards. Seeded: a failure prints its seed.
    Bank(BankArgs),
    /// The benchmark suite, on demand: starts what it needs (a simulated engine, replicas on a
    /// fresh database, LiteLLM's proxy in a virtualenv under the build directory), compares
    /// every figure with the engine directly in the same run, writes bench.json and bench.png.
    Bench(BenchArgs),
    /// The routing benchmark, on demand: Switchyard's node choice against round robin,
    /// least-loaded and an oracle on the same simulated fleet, in virtual time; writes
    /// routing.json, routing.md and routing.png.
    Routing(RoutingArgs),
}

#[derive(Debug, Args)]
struct RoutingArgs {
    /// Scenarios, comma-separated: mix (the seeds' fleet at several loads), llm-d (llm-d's
    /// published benchmark shape) [default: both].
    #[arg(long, value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Loads of the mix, percent of capacity, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [50.0, 90.0, 110.0])]
    loads: Vec<f64>,
    /// Seed of the sessions and arrivals.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Virtual time before measuring [default: 120s; 30s with --quick].
    #[arg(long, value_parser = parse_duration)]
    warmup: Option<Duration>,
    /// Virtual time measured [default: 600s; 60s with --quick].
    #[arg(long, value_parser = parse_duration)]
    window: Option<Duration>,
    /// Short runs to check that everything works; not figures to quote.
    #[arg(long)]
    quick: bool,
    /// Where the results go [default: routing/ in the build directory].
    #[arg(long)]
    out: Option<PathBuf>,
    /// `node_concurrency` of the llm-d shapes' nodes: 256 is no gateway queue (as behind
    /// llm-d); less puts Switchyard's queue in front of the engines.
    #[arg(long, default_value_t = 256)]
    llmd_node_concurrency: u32,
    /// Shared system prompts of the llm-d shapes.
    #[arg(long, default_value_t = switchyard_loadtest::routing::LLMD_GROUPS)]
    llmd_groups: u64,
    /// Tokens of each shared system prompt of the llm-d shapes.
    #[arg(long, default_value_t = switchyard_loadtest::routing::LLMD_SYSTEM)]
    llmd_system: u32,
    /// Tokens of each llm-d request's own question.
    #[arg(long, default_value_t = switchyard_loadtest::routing::LLMD_QUESTION)]
    llmd_question: u32,
    /// Strategies compared, comma-separated: round_robin, least_loaded, cache_aware, oracle
    /// [default: all].
    #[arg(long, value_delimiter = ',')]
    strategies: Vec<String>,
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// Scenarios, comma-separated: overhead, admission, 10k, relay [default: all].
    #[arg(long, value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Where bench.json, bench.png and logs go [default: bench/ in the build directory].
    #[arg(long)]
    out: Option<PathBuf>,
    /// A short run to check that everything works: 3 s phases, one round, 1,000 streams for
    /// `10k`, 50 for `relay`. Its figures are not ones to quote.
    #[arg(long)]
    quick: bool,
    /// Length of every phase [default: 10s; 3s with --quick].
    #[arg(long, value_parser = parse_duration)]
    phase: Option<Duration>,
    /// Rounds of every comparison, each a direct and a gateway phase [default: 2; 1 with
    /// --quick].
    #[arg(long)]
    rounds: Option<u32>,
    /// Concurrent streams of the `10k` scenario [default: 10000; 1000 with --quick].
    #[arg(long)]
    many: Option<usize>,
    /// Leave LiteLLM out of the overhead scenario.
    #[arg(long)]
    no_litellm: bool,
    /// LiteLLM's worker processes (one per core is fair to it).
    #[arg(long, default_value_t = 2)]
    litellm_workers: u32,
    /// Where LiteLLM's virtualenv is made [default: bench-peers/ in the build directory].
    #[arg(long)]
    peers: Option<PathBuf>,
    #[command(flatten)]
    stack: StackArgs,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
}

impl BenchArgs {
    fn into_options(self) -> anyhow::Result<switchyard_loadtest::bench::BenchOptions> {
        // target/ when this binary is target/release/switchyard-loadtest.
        let build_dir = std::env::current_exe()?
            .parent()
            .and_then(std::path::Path::parent)
            .context("the build directory")?
            .to_owned();
        let scenarios = if self.scenarios.is_empty() {
            switchyard_loadtest::bench::SCENARIOS
                .iter()
                .map(|s| (*s).to_owned())
                .collect()
        } else {
            self.scenarios
        };
        let quick = self.quick;
        Ok(switchyard_loadtest::bench::BenchOptions {
            bin: switchyard_bin(self.stack.bin)?,
            database: self.stack.database,
            out: self.out.unwrap_or_else(|| build_dir.join("bench")),
            scenarios,
            quick,
            phase: self
                .phase
                .unwrap_or(Duration::from_secs(if quick { 3 } else { 10 })),
            rounds: self.rounds.unwrap_or(if quick { 1 } else { 2 }),
            many: self.many.unwrap_or(if quick { 1_000 } else { 10_000 }),
            litellm: !self.no_litellm,
            litellm_workers: self.litellm_workers,
            peers: self.peers.unwrap_or_else(|| build_dir.join("bench-peers")),
            progress: !self.no_progress,
            command: std::env::args().collect::<Vec<_>>().join(" "),
        })
    }
}

#[derive(Debug, Args)]
struct BankArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 100_000)]
    requests: usize,
    /// The seed of the requests and the faults [default: random, printed].
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    stack: StackArgs,
    /// Write the report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

/// Where a drill's (or the bank check's) cluster comes from.
#[derive(Debug, Args)]
struct StackArgs {
    /// The `switchyard` binary [default: beside this one].
    #[arg(long)]
    bin: Option<PathBuf>,
    /// PostgreSQL server to make the cluster's database on (a URL naming any database).
    #[arg(
        long,
        env = "DATABASE",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database: String,
}

/// `--bin`, or `switchyard` beside this binary.
fn switchyard_bin(bin: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match bin {
        Some(bin) => Ok(bin),
        None => Ok(std::env::current_exe()?
            .parent()
            .context("the binary's directory")?
            .join("switchyard")),
    }
}

#[derive(Debug, Args)]
struct DrillArgs {
    /// The drill (`peak-200`, `kill-replica`, `kill-engine`, `restart-all`, `redis-down`,
    /// `spot-reclaim`, `abandon-10k`, `cut-node`, `postgres-down`, `max-streams-500`,
    /// `redis-restart-empty`, `freeze-socket-holder`, `kill-queue-owner`), or `all`.
    name: String,
    #[command(flatten)]
    stack: StackArgs,
    /// How long the load runs.
    #[arg(long, default_value = "12s", value_parser = parse_duration)]
    load: Duration,
    /// Write the reports here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep every process's log (their directory is printed).
    #[arg(long)]
    keep_logs: bool,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Clients `abandon-10k` sends.
    #[arg(long, default_value_t = 10_000)]
    abandon: usize,
}

#[derive(Debug, Args)]
struct CompareArgs {
    /// The engine's OpenAI base URL, e.g. http://127.0.0.1:8000/v1.
    #[arg(long)]
    direct_url: String,
    /// Bearer key for the engine, if it wants one.
    #[arg(long)]
    direct_key: Option<String>,
    /// Model name at the engine.
    #[arg(long)]
    direct_model: String,
    /// The gateway's OpenAI base URL, e.g. http://127.0.0.1:8080/v1.
    #[arg(long)]
    gateway_url: String,
    /// Bearer key for the gateway.
    #[arg(long, env = "SWITCHYARD_API_KEY", hide_env_values = true)]
    gateway_key: Option<String>,
    /// Model name at the gateway.
    #[arg(long)]
    gateway_model: String,
    /// Rounds; each runs one phase per side (direct first in even rounds, gateway first in odd).
    #[arg(long, default_value_t = 4)]
    rounds: u32,
    /// Concurrent workers in every phase.
    #[arg(long)]
    streams: usize,
    /// Length of every phase (90s, 2m, 500ms). Default 30s.
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    duration: Option<Duration>,
    /// Requests of every phase.
    #[arg(long)]
    requests: Option<u64>,
    /// Target prompt size in tokens (calibrated once per side).
    #[arg(long)]
    prompt_tokens: u32,
    /// max_tokens of every request.
    #[arg(long)]
    max_tokens: u32,
    /// Both targets run F times faster than real; figures are converted back.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Per-request deadline, send to end of stream.
    #[arg(long, value_parser = parse_duration, default_value = "300s")]
    timeout: Duration,
    /// Skip calibration probes and assume this many prompt tokens per word.
    #[arg(long)]
    tokens_per_word: Option<f64>,
    /// Pid of `switchyard serve`, for its CPU per relayed token.
    #[arg(long)]
    gateway_pid: Option<u32>,
    /// Pid of `switchyard node`, for its CPU per relayed token.
    #[arg(long)]
    agent_pid: Option<u32>,
    /// Pid of the engine, for its CPU per token on each side.
    #[arg(long)]
    engine_pid: Option<u32>,
    /// Write the compare report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Do not draw the progress bar.
    #[arg(long)]
    no_progress: bool,
}

impl CompareArgs {
    fn into_config(self) -> CompareConfig {
        let limit = match (self.requests, self.duration) {
            (Some(n), _) => Limit::Requests(n),
            (None, Some(d)) => Limit::Duration(d),
            (None, None) => Limit::Duration(Duration::from_secs(30)),
        };
        let side = |url: String, key: Option<String>, model: String| {
            let mut cfg = RunConfig::new(url, model);
            cfg.api_key = key.filter(|k| !k.is_empty());
            cfg.streams = self.streams;
            cfg.limit = limit;
            cfg.prompt_tokens = self.prompt_tokens;
            cfg.max_tokens = self.max_tokens;
            cfg.time_scale = self.time_scale;
            cfg.timeout = self.timeout;
            cfg.tokens_per_word = self.tokens_per_word;
            cfg.progress = !self.no_progress;
            cfg
        };
        let direct = side(
            self.direct_url.clone(),
            self.direct_key.clone(),
            self.direct_model.clone(),
        );
        let gateway = side(
            self.gateway_url.clone(),
            self.gateway_key.clone(),
            self.gateway_model.clone(),
        );
        let pids = [
            (Role::Gateway, self.gateway_pid),
            (Role::Agent, self.agent_pid),
            (Role::Engine, self.engine_pid),
        ]
        .into_iter()
        .filter_map(|(role, pid)| pid.map(|p| (role, p)))
        .collect();
        CompareConfig {
            direct,
            gateway,
            rounds: self.rounds,
            pids,
        }
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    /// OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (requests go to {url}/chat/completions).
    #[arg(long)]
    url: String,
    /// API key, sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    key: Option<String>,
    /// Concurrent workers, each with one request in flight.
    #[arg(long)]
    streams: usize,
    /// Stop starting requests after this long (90s, 2m, 500ms, plain seconds). Default 60s.
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    duration: Option<Duration>,
    /// Start exactly this many requests in total.
    #[arg(long)]
    requests: Option<u64>,
    /// Target prompt size in the endpoint's tokens (calibrated with two probes).
    #[arg(long)]
    prompt_tokens: u32,
    /// max_tokens of every request.
    #[arg(long)]
    max_tokens: u32,
    /// Model for all workers.
    #[arg(long, required_unless_present = "mix", conflicts_with = "mix")]
    model: Option<String>,
    /// Models with weights, e.g. small=140,medium=50,large=10; workers split by largest remainder.
    #[arg(long, value_parser = |s: &str| parse_mix(s).map(Mix))]
    mix: Option<Mix>,
    /// Write the whole report as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// The target runs F times faster than real (simulator --time-scale); figures are converted back.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Per-request deadline, send to end of stream.
    #[arg(long, value_parser = parse_duration, default_value = "300s")]
    timeout: Duration,
    /// Skip calibration probes and assume this many prompt tokens per word.
    #[arg(long)]
    tokens_per_word: Option<f64>,
    /// Do not draw the progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Send a fresh Idempotency-Key with every request (Switchyard's generation lifecycle).
    #[arg(long)]
    idempotency_keys: bool,
    /// Start the workers evenly over this long rather than all at once (e.g. 30s).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    ramp: Duration,
}

/// Wrapper so clap treats a parsed mix as one value, not a repeated option.
#[derive(Debug, Clone)]
struct Mix(Vec<ModelWeight>);

impl RunArgs {
    fn into_config(self) -> RunConfig {
        let models = match (self.mix, self.model) {
            (Some(Mix(mix)), _) => mix,
            (None, Some(name)) => vec![ModelWeight { name, weight: 1 }],
            (None, None) => Vec::new(),
        };
        let limit = match (self.requests, self.duration) {
            (Some(n), _) => Limit::Requests(n),
            (None, Some(d)) => Limit::Duration(d),
            (None, None) => Limit::Duration(Duration::from_secs(60)),
        };
        RunConfig {
            url: self.url,
            api_key: self.key.filter(|k| !k.is_empty()),
            streams: self.streams,
            limit,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            models,
            time_scale: self.time_scale,
            timeout: self.timeout,
            tokens_per_word: self.tokens_per_word,
            progress: !self.no_progress,
            idempotency_keys: self.idempotency_keys,
            ramp: self.ramp,
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match execute(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain is the message; a backtrace would bury it.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A seed from the clock, for a bank check not given one.
fn rand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

async fn execute(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(args) => {
            let out = args.out.clone();
            let report = switchyard_loadtest::run(args.into_config()).await?;
            if let Some(path) = out {
                let json = serde_json::to_vec_pretty(&report).context("serializing report")?;
                std::fs::write(&path, json)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let mut stdout = std::io::stdout().lock();
            report.print(&mut stdout)?;
            stdout.flush()?;
        }
        Command::Drill(args) => {
            let bin = switchyard_bin(args.stack.bin)?;
            let opts = switchyard_loadtest::drill::DrillOptions {
                bin,
                database: args.stack.database,
                load: args.load,
                progress: !args.no_progress,
                keep_logs: args.keep_logs,
                abandon: args.abandon,
            };
            let reports = switchyard_loadtest::drill::drill(&args.name, &opts).await?;
            if let Some(path) = args.json {
                let json = serde_json::to_vec_pretty(&reports).context("serializing reports")?;
                std::fs::write(&path, json)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let mut stdout = std::io::stdout().lock();
            for r in &reports {
                r.print(&mut stdout)?;
            }
            if reports.len() > 1 {
                switchyard_loadtest::drill::print_table(&reports, &mut stdout)?;
            }
            stdout.flush()?;
            if reports.iter().any(|r| !r.passed) {
                anyhow::bail!("a drill failed");
            }
        }
        Command::Bank(args) => {
            let opts = switchyard_loadtest::drill::DrillOptions {
                bin: switchyard_bin(args.stack.bin)?,
                database: args.stack.database,
                load: Duration::ZERO,
                progress: !args.no_progress,
                keep_logs: false,
                abandon: 0,
            };
            let seed = args.seed.unwrap_or_else(rand_seed);
            let report = switchyard_loadtest::drill::bank(&opts, args.requests, seed).await?;
            if let Some(path) = args.json {
                let json = serde_json::to_vec_pretty(&report).context("serializing the report")?;
                std::fs::write(&path, json)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let mut stdout = std::io::stdout().lock();
            report.print(&mut stdout)?;
            stdout.flush()?;
            if !report.passed {
                anyhow::bail!("the bank check failed; replay it with --seed {seed}");
            }
        }
        Command::Bench(args) => {
            let opts = args.into_options()?;
            let report = switchyard_loadtest::bench::bench(&opts).await?;
            let mut stdout = std::io::stdout().lock();
            report.print(&mut stdout)?;
            writeln!(
                stdout,
                "wrote {0}/bench.json and {0}/bench.png",
                opts.out.display()
            )?;
            stdout.flush()?;
            if !report.passed() {
                anyhow::bail!("a scenario failed");
            }
        }
        Command::Routing(args) => {
            let build_dir = std::env::current_exe()?
                .parent()
                .and_then(std::path::Path::parent)
                .context("the build directory")?
                .to_owned();
            let quick = args.quick;
            let opts = switchyard_loadtest::routing::RoutingOptions {
                out: args.out.unwrap_or_else(|| build_dir.join("routing")),
                seed: args.seed,
                scenarios: if args.scenarios.is_empty() {
                    vec!["mix".into(), "llm-d".into(), "llm-d-short".into()]
                } else {
                    args.scenarios
                },
                loads: args.loads.iter().map(|l| l / 100.0).collect(),
                warmup: args
                    .warmup
                    .unwrap_or(Duration::from_secs(if quick { 30 } else { 120 })),
                window: args
                    .window
                    .unwrap_or(Duration::from_secs(if quick { 60 } else { 600 })),
                strategies: if args.strategies.is_empty() {
                    switchyard_loadtest::routing::Strategy::ALL.to_vec()
                } else {
                    args.strategies
                        .iter()
                        .map(|s| s.parse())
                        .collect::<Result<_, _>>()?
                },
                llmd_node_concurrency: args.llmd_node_concurrency,
                llmd_shape: switchyard_loadtest::routing::LlmdShape {
                    groups: args.llmd_groups,
                    system: args.llmd_system,
                    question: args.llmd_question,
                },
            };
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let report = tokio::task::spawn_blocking(move || {
                switchyard_loadtest::routing::run(&opts, command).map(|r| (r, opts.out))
            })
            .await??;
            let (report, out) = report;
            let mut stdout = std::io::stdout().lock();
            write!(stdout, "{}", switchyard_loadtest::routing::table(&report))?;
            writeln!(
                stdout,
                "wrote {0}/routing.json, {0}/routing.md and {0}/routing.png in {1:.0} s",
                out.display(),
                report.wall_s
            )?;
            stdout.flush()?;
        }
        Command::Compare(args) => {
            let out = args.json.clone();
            let report = switchyard_loadtest::compare(args.into_config()).await?;
            if let Some(path) = out {
                let json = serde_json::to_vec_pretty(&report).context("serializing report")?;
                std::fs::write(&path, json)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let mut stdout = std::io::stdout().lock();
            report.print(&mut stdout)?;
            stdout.flush()?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<RunConfig, clap::Error> {
        let base = ["switchyard-loadtest", "run", "--url", "http://h:1/v1"];
        let cli = Cli::try_parse_from(base.iter().chain(args))?;
        match cli.command {
            Command::Run(a) => Ok(a.into_config()),
            Command::Compare(_)
            | Command::Drill(_)
            | Command::Bank(_)
            | Command::Bench(_)
            | Command::Routing(_) => {
                panic!("not a run")
            }
        }
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_arguments() {
        let common = [
            "--streams",
            "200",
            "--prompt-tokens",
            "500",
            "--max-tokens",
            "64",
        ];
        let mix: Vec<&str> = common
            .iter()
            .copied()
            .chain(["--mix", "small=140,medium=50,large=10", "--duration", "2m"])
            .chain(["--time-scale", "20", "--timeout", "90s", "--no-progress"])
            .collect();
        let cfg = parse(&mix).unwrap();
        assert_eq!(cfg.models.len(), 3);
        assert_eq!(cfg.limit, Limit::Duration(Duration::from_secs(120)));
        assert_eq!(cfg.timeout, Duration::from_secs(90));
        assert_eq!(cfg.time_scale, 20.0);
        assert!(!cfg.progress);
        assert_eq!(
            switchyard_loadtest::assign_workers(&cfg.models, cfg.streams),
            vec![140, 50, 10]
        );

        let one: Vec<&str> = common
            .iter()
            .copied()
            .chain(["--model", "m", "--requests", "10"])
            .collect();
        let cfg = parse(&one).unwrap();
        assert_eq!(cfg.limit, Limit::Requests(10));
        assert_eq!(cfg.models[0].name, "m");

        let both: Vec<&str> = one.iter().copied().chain(["--mix", "a=1"]).collect();
        assert!(parse(&both).is_err());
        assert!(parse(&common).is_err(), "a model is required");
        let dur_and_count: Vec<&str> = one.iter().copied().chain(["--duration", "5s"]).collect();
        assert!(parse(&dur_and_count).is_err());
    }
}
