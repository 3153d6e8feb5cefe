//! `switchyard-loadtest bench`: the benchmark suite as one on-demand command. Each scenario
//! starts the processes it needs ([`crate::drill::Stack`], LiteLLM's proxy in a virtualenv of
//! its own), runs the same load directly against the engine and through the gateway in one
//! run ([`crate::compare`]), and keeps every figure beside its direct baseline and the ratio;
//! the result is `bench.json` and a plot, `bench.png`.

mod litellm;
pub(crate) mod plot;
mod sample;
mod scenarios;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio::time::Instant;

pub use litellm::LiteLlm;
pub use plot::draw;
pub use sample::{Peaks, Watch};

/// The scenarios, in the order the suite runs them.
pub const SCENARIOS: &[&str] = &["overhead", "admission", "10k", "relay"];

/// Formula of each figure name, stored in the JSON beside the figures.
pub const BENCH_FORMULAS: [(&str, &str); 14] = [
    (
        "direct, added, ratio",
        "every figure: value = through the subject; direct = the same load straight to the same engine in the same run (alternating phases, ABBA); added = value - direct; ratio = value / direct",
    ),
    (
        "ttft_p50_ms, ttft_p99_ms",
        "TTFT pN over all completed requests of the side's phases (send to first content chunk)",
    ),
    (
        "itl_p50_ms, itl_p99_ms",
        "ITL pN: per stream, the mean gap between content chunks; percentiles over streams",
    ),
    (
        "tokens_per_s",
        "completion tokens of the side's phases / the sum of their wall times; its ratio is the throughput ratio",
    ),
    (
        "cpu_us_per_token",
        "CPU µs (utime + stime from /proc, descendants included) of the subject's processes in its phases / completion tokens relayed in them; Switchyard = every serve replica + the node agent, LiteLLM = the proxy and its workers; direct = the engine's own CPU per token in the direct phases",
    ),
    (
        "cpu_us_per_stream",
        "as cpu_us_per_token, divided by completed requests instead of tokens",
    ),
    (
        "tokens_per_core_s",
        "completion tokens / CPU seconds of the subject's processes in its phases: relayed tokens per second per fully used core; direct = the engine's tokens per CPU second",
    ),
    (
        "peak_rss_mib",
        "sum over the subject's processes of each one's highest VmRSS, read every 250 ms during the run (descendants included); direct = the engine's",
    ),
    (
        "serve_peak_rss_mib, agent_peak_rss_mib",
        "highest VmRSS of `switchyard serve` / `switchyard node` during the run; direct = the engine's",
    ),
    (
        "new_streams_per_s",
        "requests completed (`200 ok`, max_tokens 1) / wall time of the side's phases: streams admitted, run and settled per second with a closed loop of N workers",
    ),
    (
        "peak_streams",
        "most requests in flight at once (sent, not ended) in one phase, from the harness's records",
    ),
    (
        "completed",
        "requests that ended with `200 ok` in the side's phases",
    ),
    (
        "failed",
        "requests of the side's phases that did not end with `200 ok` (the outcomes are in runs[].compare)",
    ),
    (
        "subject",
        "switchyard: serve on PostgreSQL and Redis with a key whose rpm, tokens/day and max_streams are all set, one node agent; litellm: LiteLLM's proxy (no database, master key); `local`/`relayed`: the request enters the replica holding the node's socket and the team's budget / another replica owning the team's budget, so the assign and every frame cross Redis",
    ),
];

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The `switchyard` binary.
    pub bin: PathBuf,
    /// A PostgreSQL URL whose server each scenario makes its database on.
    pub database: String,
    /// Where `bench.json`, `bench.png` and the logs go.
    pub out: PathBuf,
    /// The scenarios to run, from [`SCENARIOS`].
    pub scenarios: Vec<String>,
    /// Shorter phases and fewer streams: a check that everything runs, not figures.
    pub quick: bool,
    /// Length of every phase.
    pub phase: Duration,
    /// Rounds of every comparison (each a direct and a gateway phase).
    pub rounds: u32,
    /// Streams of the `10k` scenario.
    pub many: usize,
    /// Measure LiteLLM's proxy beside Switchyard.
    pub litellm: bool,
    /// LiteLLM's worker processes.
    pub litellm_workers: u32,
    /// Where LiteLLM's virtualenv is made.
    pub peers: PathBuf,
    /// Progress bars of the phases.
    pub progress: bool,
    /// The command line, recorded in the JSON.
    pub command: String,
}

impl BenchOptions {
    /// Checks the scenario names.
    pub fn validate(&self) -> anyhow::Result<()> {
        for s in &self.scenarios {
            if !SCENARIOS.contains(&s.as_str()) {
                anyhow::bail!(
                    "unknown scenario `{s}`; the scenarios: {}",
                    SCENARIOS.join(", ")
                );
            }
        }
        if self.rounds == 0 {
            anyhow::bail!("--rounds must be at least 1");
        }
        Ok(())
    }
}

/// One figure through a subject beside the same load straight to the engine.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    /// The scenario that measured it.
    pub scenario: String,
    /// What the load went through: `switchyard`, `litellm`, `switchyard relayed`, …
    pub subject: String,
    /// Concurrent streams (closed-loop workers) of the load.
    pub streams: u64,
    /// The figure (its formula is in [`BENCH_FORMULAS`]).
    pub name: String,
    /// Through the subject.
    pub value: f64,
    /// The same load directly against the engine, in the same run.
    pub direct: f64,
    /// `value - direct`.
    pub added: f64,
    /// `value / direct`; `None` when `direct` is 0.
    pub ratio: Option<f64>,
}

impl Figure {
    /// A figure with its difference and ratio to the direct baseline.
    pub fn new(
        scenario: &str,
        subject: &str,
        streams: u64,
        name: &str,
        value: f64,
        direct: f64,
    ) -> Self {
        Self {
            scenario: scenario.to_owned(),
            subject: subject.to_owned(),
            streams,
            name: name.to_owned(),
            value,
            direct,
            added: value - direct,
            ratio: (direct != 0.0 && direct.is_finite()).then(|| value / direct),
        }
    }
}

/// One comparison a scenario ran.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// What the gateway side went through.
    pub subject: String,
    /// Concurrent streams.
    pub streams: u64,
    /// The highest reading over the comparison of each watched value: `rss_bytes.PROCESS`
    /// (VmRSS), `streams.PROCESS` (streams it carried, from its `/metrics`).
    pub peaks: BTreeMap<String, f64>,
    /// The whole comparison: both sides' figures, every phase, CPU per process.
    pub compare: crate::CompareReport,
}

/// What one scenario did.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// Its name, from [`SCENARIOS`].
    pub scenario: String,
    /// It ran to the end.
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
    /// Wall time, processes' start included.
    pub seconds: f64,
    /// The engine and the load, in words.
    pub setup: String,
    /// What was left out and why (LiteLLM not installable, say).
    pub notes: Vec<String>,
    /// Every comparison.
    pub runs: Vec<Run>,
    /// Where the processes' logs are, when kept (after a failure).
    pub logs: Option<String>,
}

/// The machine and the build the suite ran on.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Machine {
    /// Cores the process may use.
    pub cores: usize,
    /// `model name` of /proc/cpuinfo.
    pub cpu: Option<String>,
    /// MemTotal of /proc/meminfo, MiB.
    pub memory_mib: Option<u64>,
    /// /proc/sys/kernel/osrelease.
    pub kernel: Option<String>,
    /// When the suite started, UTC, RFC 3339.
    pub date: String,
    /// `git rev-parse HEAD` where the suite ran.
    pub git_commit: Option<String>,
    /// The work tree had uncommitted changes to tracked files.
    pub git_dirty: Option<bool>,
    /// The `switchyard` binary measured.
    pub switchyard_bin: String,
    /// LiteLLM's version, when it ran.
    pub litellm: Option<String>,
    /// /proc/loadavg when the suite started and when it ended: the machine may be shared.
    pub load_average: [Option<String>; 2],
}

/// Everything the suite produced: `bench.json`.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Where and when.
    pub machine: Machine,
    /// The command line.
    pub command: String,
    /// A `--quick` run: not figures to quote.
    pub quick: bool,
    /// Phase length in seconds and rounds of every comparison.
    pub phase_s: f64,
    /// Rounds of every comparison.
    pub rounds: u32,
    /// Formula of each figure.
    pub formulas: BTreeMap<String, String>,
    /// Every figure with its direct baseline and ratio.
    pub figures: Vec<Figure>,
    /// Every scenario, with its comparisons in full.
    pub scenarios: Vec<ScenarioReport>,
}

impl BenchReport {
    /// A report with no scenario yet.
    pub fn new(machine: Machine, opts: &BenchOptions) -> Self {
        Self {
            machine,
            command: opts.command.clone(),
            quick: opts.quick,
            phase_s: opts.phase.as_secs_f64(),
            rounds: opts.rounds,
            formulas: BENCH_FORMULAS
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            figures: Vec::new(),
            scenarios: Vec::new(),
        }
    }

    /// Every scenario ran to the end.
    pub fn passed(&self) -> bool {
        self.scenarios.iter().all(|s| s.ok)
    }

    /// The figures as a table, then each scenario's notes and errors.
    pub fn print(&self, out: &mut impl Write) -> std::io::Result<()> {
        let m = &self.machine;
        writeln!(
            out,
            "switchyard-loadtest bench{}: {} cores, {}, commit {}, load average {} → {}",
            if self.quick { " --quick" } else { "" },
            m.cores,
            m.date,
            m.git_commit.as_deref().unwrap_or("?"),
            m.load_average[0].as_deref().unwrap_or("?"),
            m.load_average[1].as_deref().unwrap_or("?"),
        )?;
        writeln!(
            out,
            "{:<10} {:<22} {:>7} {:<19} {:>12} {:>12} {:>12} {:>8}",
            "scenario", "subject", "streams", "figure", "value", "direct", "added", "ratio"
        )?;
        for f in &self.figures {
            let ratio = f
                .ratio
                .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}"));
            writeln!(
                out,
                "{:<10} {:<22} {:>7} {:<19} {:>12.2} {:>12.2} {:>+12.2} {:>8}",
                f.scenario, f.subject, f.streams, f.name, f.value, f.direct, f.added, ratio
            )?;
        }
        for s in &self.scenarios {
            let verdict = if s.ok { "ok" } else { "FAILED" };
            writeln!(
                out,
                "{}: {verdict} in {:.0} s — {}",
                s.scenario, s.seconds, s.setup
            )?;
            for n in &s.notes {
                writeln!(out, "  note: {n}")?;
            }
            if let Some(e) = &s.error {
                writeln!(out, "  error: {e}")?;
            }
            if let Some(l) = &s.logs {
                writeln!(out, "  logs: {l}")?;
            }
        }
        Ok(())
    }
}

/// Runs the chosen scenarios and writes `bench.json` and `bench.png` to `opts.out`.
pub async fn bench(opts: &BenchOptions) -> anyhow::Result<BenchReport> {
    opts.validate()?;
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    let mut machine = machine(&opts.bin);
    let wants = |s: &str| opts.scenarios.iter().any(|x| x == s);
    let mut peer_note = None;
    let peer = if opts.litellm && wants("overhead") {
        eprintln!("bench: installing LiteLLM into {}", opts.peers.display());
        match litellm::setup(&opts.peers, &opts.out).await {
            Ok(version) => {
                machine.litellm = Some(version);
                true
            }
            Err(e) => {
                peer_note = Some(format!("LiteLLM left out: {e:#}"));
                false
            }
        }
    } else {
        false
    };
    let mut report = BenchReport::new(machine, opts);
    for name in SCENARIOS.iter().filter(|s| wants(s)) {
        let started = Instant::now();
        eprintln!("bench: scenario {name}");
        let mut found = Found::default();
        if *name == "overhead"
            && let Some(n) = &peer_note
        {
            found.notes.push(n.clone());
        }
        let outcome = match *name {
            "overhead" => scenarios::overhead(opts, peer, &mut found).await,
            "admission" => scenarios::admission(opts, &mut found).await,
            "10k" => scenarios::many_streams(opts, &mut found).await,
            _ => scenarios::relay(opts, &mut found).await,
        };
        if let Err(e) = &outcome {
            eprintln!("bench: scenario {name} failed: {e:#}");
        }
        report.figures.append(&mut found.figures);
        report.scenarios.push(ScenarioReport {
            scenario: (*name).to_owned(),
            ok: outcome.is_ok(),
            error: outcome.err().map(|e| format!("{e:#}")),
            seconds: started.elapsed().as_secs_f64(),
            setup: found.setup,
            notes: found.notes,
            runs: found.runs,
            logs: found.logs,
        });
        // Each scenario's figures land on disk as soon as it ends.
        write_json(&report, &opts.out)?;
    }
    report.machine.load_average[1] = load_average();
    write_json(&report, &opts.out)?;
    draw(&report, &opts.out.join("bench.png")).context("drawing bench.png")?;
    Ok(report)
}

/// The first three fields of /proc/loadavg.
fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(
        text.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    )
}

fn write_json(report: &BenchReport, out: &Path) -> anyhow::Result<()> {
    let path = out.join("bench.json");
    let json = serde_json::to_vec_pretty(report).context("serializing the report")?;
    std::fs::write(&path, json).with_context(|| format!("writing {}", path.display()))
}

/// What a scenario gathers.
#[derive(Debug, Default)]
pub(crate) struct Found {
    figures: Vec<Figure>,
    runs: Vec<Run>,
    notes: Vec<String>,
    setup: String,
    logs: Option<String>,
}

/// Cores, CPU, memory, kernel, date and the commit.
fn machine(bin: &Path) -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cpu = read("/proc/cpuinfo").and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_owned())
    });
    let memory_mib = read("/proc/meminfo").and_then(|s| {
        let kib: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib / 1024)
    });
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    Machine {
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        cpu,
        memory_mib,
        kernel: read("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()),
        date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        git_commit: git(&["rev-parse", "HEAD"]),
        git_dirty: git(&["status", "--porcelain", "--untracked-files=no"]).map(|s| !s.is_empty()),
        switchyard_bin: bin.display().to_string(),
        litellm: None,
        load_average: [load_average(), None],
    }
}

#[cfg(test)]
mod tests;
