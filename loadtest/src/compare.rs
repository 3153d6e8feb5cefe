//! The `compare` scenario: the same load directly against an engine and
//! through the gateway, in alternating phases of equal size within one
//! invocation (ABBA order, so drift and machine noise hit both sides alike),
//! reporting what the gateway adds: TTFT, ITL, throughput ratio and, given
//! pids, each process's CPU time per relayed completion token.

use std::collections::BTreeMap;
use std::io::{self, Write};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::config::RunConfig;
use crate::report::{ConfigSummary, Figures, RequestRecord};
use crate::run::{calibrate_models, run_calibrated};

/// `/proc/<pid>/stat` counts CPU time in USER_HZ ticks, 100 per second on Linux.
pub const CLOCK_TICKS_PER_S: f64 = 100.0;

/// Formula of each compare figure, printed under the table and stored in the JSON.
pub const COMPARE_FORMULAS: [(&str, &str); 5] = [
    (
        "added_ttft_ms",
        "added TTFT pN = gateway TTFT pN - direct TTFT pN, each over all completed requests of that side's phases (engine time); positive = the gateway is slower",
    ),
    (
        "added_itl_ms",
        "added ITL pN = gateway ITL pN - direct ITL pN (per-stream mean gap between content chunks, engine time)",
    ),
    (
        "throughput_ratio",
        "gateway total tok/s / direct total tok/s, each = completion tokens of that side's phases / sum of their wall times; < 1 = the gateway relays fewer tokens per second",
    ),
    (
        "cpu_us_per_token",
        "CPU per token = (utime+stime after - before, /proc/<pid>/stat of the process and its descendants, summed over the side's phases) / completion tokens relayed in those phases, in CPU microseconds",
    ),
    (
        "added_cpu_us_per_token",
        "gateway cost per token = gateway process (gateway phases) + agent process (gateway phases) + engine (gateway phases - direct phases); terms for pids not given are left out",
    ),
];

/// Which way a phase's requests went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// Straight to the engine.
    Direct,
    /// Through the gateway.
    Gateway,
}

/// A process whose CPU time is measured, and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// `--gateway-pid`: `switchyard serve`.
    Gateway,
    /// `--agent-pid`: `switchyard node`, the agent next to the engine.
    Agent,
    /// `--engine-pid`: the engine itself (vLLM, `switchyard sim`).
    Engine,
}

/// Everything [`compare`] needs: two run configurations that differ only in
/// where requests go (URL, key, model) and how many rounds to alternate.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// The direct side: the engine's own URL and model name.
    pub direct: RunConfig,
    /// The gateway side: the gateway's URL, key and model name.
    pub gateway: RunConfig,
    /// Rounds; each runs one phase of each side, the load of `limit` each.
    pub rounds: u32,
    /// Processes whose CPU time is read before and after each phase.
    pub pids: Vec<(Role, u32)>,
}

/// One side's CPU cost of one process.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CpuCost {
    /// CPU seconds (user + system) the process used during this side's phases.
    pub cpu_s: f64,
    /// Completion tokens relayed during those phases.
    pub completion_tokens: u64,
    /// `cpu_s` in microseconds / `completion_tokens`; `None` with no tokens.
    pub us_per_token: Option<f64>,
}

/// CPU cost of one process on each side.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessCpu {
    /// What the process is.
    pub role: Role,
    /// Its pid.
    pub pid: u32,
    /// During the direct phases.
    pub direct: CpuCost,
    /// During the gateway phases.
    pub gateway: CpuCost,
}

/// One phase as it ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phase {
    /// Round number, from 0.
    pub round: u32,
    /// Which side ran.
    pub side: Side,
    /// First send to last end, wall clock.
    pub wall_time_s: f64,
    /// Requests that ended.
    pub requests: u64,
    /// Requests that completed (`200 ok`).
    pub completed: u64,
    /// Completion tokens relayed.
    pub completion_tokens: u64,
    /// Completion tokens / wall time, engine time.
    pub total_tokens_per_s: f64,
    /// Most requests in flight at once (sent, not yet ended), from the records.
    pub peak_streams: u64,
}

/// Gateway minus direct at three percentiles, milliseconds of engine time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AddedTtft {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Gateway minus direct at two percentiles, milliseconds of engine time.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AddedItl {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// The compare configuration as recorded (never the keys).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareSummary {
    /// Rounds run.
    pub rounds: u32,
    /// The sides in the order they ran.
    pub order: Vec<Side>,
    /// The direct side's run configuration (load fields are shared).
    pub direct: ConfigSummary,
    /// The gateway side's run configuration.
    pub gateway: ConfigSummary,
}

/// Everything a compare produced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareReport {
    /// What was run.
    pub config: CompareSummary,
    /// Latencies ×, rates ÷ this (see the run report's `time_scale`).
    pub time_scale: f64,
    /// Formula of each figure, keyed by name (compare's and run's).
    pub formulas: BTreeMap<String, String>,
    /// Figures of all direct phases together, engine time.
    pub direct: Figures,
    /// Figures of all gateway phases together, engine time.
    pub gateway: Figures,
    /// Gateway TTFT minus direct TTFT.
    pub added_ttft_ms: AddedTtft,
    /// Gateway ITL minus direct ITL.
    pub added_itl_ms: AddedItl,
    /// Gateway total tok/s over direct total tok/s; `None` when direct relayed nothing.
    pub throughput_ratio: Option<f64>,
    /// CPU per relayed token of each process given by pid.
    pub cpu: Vec<ProcessCpu>,
    /// See [`COMPARE_FORMULAS`]; `None` without pids or tokens.
    pub added_cpu_us_per_token: Option<f64>,
    /// Every phase, in the order run.
    pub phases: Vec<Phase>,
}

/// The fields of `/proc/<pid>/stat` after the command name: index 0 is field 3 (state).
fn stat_fields(pid: u32) -> anyhow::Result<Vec<String>> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .with_context(|| format!("{path}: no command name"))?;
    Ok(rest.split_whitespace().map(str::to_owned).collect())
}

/// User + system CPU seconds of `pid` so far, from `/proc/<pid>/stat`.
pub fn process_cpu_s(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let fields = stat_fields(pid)?;
    // rest starts at field 3 (state): utime is field 14, stime field 15.
    let tick = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("{path}: field {} is not a number", i + 3))
    };
    Ok((tick(11)? + tick(12)?) as f64 / CLOCK_TICKS_PER_S)
}

/// Every process below `pid` (children, their children, …), from the parent pid in each
/// `/proc/<pid>/stat`; empty off Linux.
pub fn descendants(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, stat_fields(p).ok()?.get(1)?.parse().ok()?)))
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while let Some(&parent) = found.get(i) {
        found.extend(
            parents
                .iter()
                .filter(|&&(_, pp)| pp == parent)
                .map(|&(p, _)| p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// CPU seconds of `pid` and of every process below it (a proxy that runs its workers as
/// child processes); a descendant that exited is no longer counted.
pub fn process_tree_cpu_s(pid: u32) -> anyhow::Result<f64> {
    let own = process_cpu_s(pid)?;
    Ok(own
        + descendants(pid)
            .into_iter()
            .filter_map(|p| process_cpu_s(p).ok())
            .sum::<f64>())
}

/// Most records in flight at once: sent and not yet ended.
pub fn peak_in_flight(records: &[RequestRecord]) -> u64 {
    let mut edges: Vec<(u64, i64)> = records
        .iter()
        .flat_map(|r| [(r.send_us, 1), (r.end_us, -1)])
        .collect();
    // At one instant an end is counted before a send: a worker's next request is no overlap.
    edges.sort_unstable();
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in edges {
        now += d;
        peak = peak.max(now);
    }
    peak.max(0) as u64
}

fn per_token(cpu_s: f64, tokens: u64) -> Option<f64> {
    (tokens > 0).then(|| cpu_s * 1e6 / tokens as f64)
}

/// Runs `rounds` rounds, each a phase of each side (direct first in even
/// rounds, gateway first in odd ones), and reports the difference. Fails
/// before the load on a bad config, a failed calibration or an unreadable pid.
pub async fn compare(cfg: CompareConfig) -> anyhow::Result<CompareReport> {
    if cfg.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if cfg.direct.time_scale != cfg.gateway.time_scale {
        bail!("both sides must share one time scale");
    }
    for &(_, pid) in &cfg.pids {
        process_tree_cpu_s(pid)?;
    }
    let direct_cal = calibrate_models(&cfg.direct).await.context("direct side")?;
    let gateway_cal = calibrate_models(&cfg.gateway)
        .await
        .context("gateway side")?;

    let scale = cfg.direct.time_scale;
    let mut records: [Vec<RequestRecord>; 2] = [Vec::new(), Vec::new()];
    let mut wall_us = [0u64; 2];
    let mut cpu_s = vec![[0.0f64; 2]; cfg.pids.len()];
    let mut phases = Vec::new();
    let mut order = Vec::new();
    let mut summaries: [Option<ConfigSummary>; 2] = [None, None];
    for round in 0..cfg.rounds {
        let sides = if round % 2 == 0 {
            [Side::Direct, Side::Gateway]
        } else {
            [Side::Gateway, Side::Direct]
        };
        for side in sides {
            let (i, run_cfg, cal) = match side {
                Side::Direct => (0, &cfg.direct, &direct_cal),
                Side::Gateway => (1, &cfg.gateway, &gateway_cal),
            };
            let before = read_all(&cfg.pids)?;
            let report = run_calibrated(run_cfg.clone(), cal.clone())
                .await
                .with_context(|| format!("round {round}, {side:?} phase"))?;
            let after = read_all(&cfg.pids)?;
            for (k, (b, a)) in before.iter().zip(&after).enumerate() {
                cpu_s[k][i] += (a - b).max(0.0);
            }
            let raw = &report.overall_wall_clock;
            let phase_us = (raw.wall_time_s * 1e6).round() as u64;
            wall_us[i] += phase_us;
            phases.push(Phase {
                round,
                side,
                wall_time_s: raw.wall_time_s,
                requests: raw.requests,
                completed: raw.completed,
                completion_tokens: raw.completion_tokens_sum,
                total_tokens_per_s: report.overall.total_tokens_per_s,
                peak_streams: peak_in_flight(&report.requests),
            });
            order.push(side);
            records[i].extend(report.requests);
            summaries[i] = Some(report.config);
        }
    }

    let [direct_records, gateway_records] = records;
    let direct = Figures::compute(&direct_records, wall_us[0]).to_engine_time(scale);
    let gateway = Figures::compute(&gateway_records, wall_us[1]).to_engine_time(scale);
    let tokens = [direct.completion_tokens_sum, gateway.completion_tokens_sum];
    let cpu: Vec<ProcessCpu> = cfg
        .pids
        .iter()
        .zip(&cpu_s)
        .map(|(&(role, pid), s)| {
            let cost = |i: usize| CpuCost {
                cpu_s: s[i],
                completion_tokens: tokens[i],
                us_per_token: per_token(s[i], tokens[i]),
            };
            ProcessCpu {
                role,
                pid,
                direct: cost(0),
                gateway: cost(1),
            }
        })
        .collect();
    let added_cpu_us_per_token = added_cpu(&cpu);
    let [direct_summary, gateway_summary] = summaries;
    let (Some(direct_summary), Some(gateway_summary)) = (direct_summary, gateway_summary) else {
        bail!("no phase ran");
    };
    Ok(CompareReport {
        config: CompareSummary {
            rounds: cfg.rounds,
            order,
            direct: direct_summary,
            gateway: gateway_summary,
        },
        time_scale: scale,
        formulas: COMPARE_FORMULAS
            .iter()
            .chain(crate::report::FORMULAS.iter())
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        added_ttft_ms: AddedTtft {
            p50: gateway.ttft_ms.p50 - direct.ttft_ms.p50,
            p90: gateway.ttft_ms.p90 - direct.ttft_ms.p90,
            p99: gateway.ttft_ms.p99 - direct.ttft_ms.p99,
        },
        added_itl_ms: AddedItl {
            p50: gateway.itl_ms.p50 - direct.itl_ms.p50,
            p99: gateway.itl_ms.p99 - direct.itl_ms.p99,
        },
        throughput_ratio: (direct.total_tokens_per_s > 0.0)
            .then(|| gateway.total_tokens_per_s / direct.total_tokens_per_s),
        direct,
        gateway,
        cpu,
        added_cpu_us_per_token,
        phases,
    })
}

fn read_all(pids: &[(Role, u32)]) -> anyhow::Result<Vec<f64>> {
    pids.iter()
        .map(|&(role, pid)| process_tree_cpu_s(pid).with_context(|| format!("{role:?} pid {pid}")))
        .collect()
}

/// Gateway + agent in the gateway phases, plus the engine's extra cost per token
/// in the gateway phases over the direct ones.
fn added_cpu(cpu: &[ProcessCpu]) -> Option<f64> {
    let mut sum = None;
    for p in cpu {
        let term = match p.role {
            Role::Gateway | Role::Agent => p.gateway.us_per_token,
            Role::Engine => match (p.gateway.us_per_token, p.direct.us_per_token) {
                (Some(g), Some(d)) => Some(g - d),
                _ => None,
            },
        };
        if let Some(t) = term {
            sum = Some(sum.unwrap_or(0.0) + t);
        }
    }
    sum
}

impl CompareReport {
    /// Writes the plain table: both sides, the differences, CPU, formulas.
    pub fn print(&self, w: &mut impl Write) -> io::Result<()> {
        let c = &self.config;
        let d = &c.direct;
        let limit = match (d.duration_s, d.requests) {
            (_, Some(n)) => format!("requests={n}"),
            (Some(s), None) => format!("duration={s}s"),
            (None, None) => String::new(),
        };
        writeln!(w, "switchyard-loadtest compare")?;
        writeln!(w, "direct:  {}", c.direct.endpoint)?;
        writeln!(w, "gateway: {}", c.gateway.endpoint)?;
        writeln!(
            w,
            "rounds={} (alternating, {} phases) per phase: streams={} {limit} prompt_tokens~{} max_tokens={}",
            c.rounds,
            c.order.len(),
            d.streams,
            d.prompt_tokens,
            d.max_tokens
        )?;
        if self.time_scale != 1.0 {
            writeln!(
                w,
                "time: ENGINE TIME - latencies x{0}, rates /{0}",
                self.time_scale
            )?;
        }
        writeln!(w)?;
        writeln!(
            w,
            "{:<22} {:>12} {:>12} {:>12}",
            "figure", "direct", "gateway", "added"
        )?;
        let (dr, gw) = (&self.direct, &self.gateway);
        let rows = [
            ("TTFT p50 (ms)", dr.ttft_ms.p50, gw.ttft_ms.p50),
            ("TTFT p90 (ms)", dr.ttft_ms.p90, gw.ttft_ms.p90),
            ("TTFT p99 (ms)", dr.ttft_ms.p99, gw.ttft_ms.p99),
            ("ITL p50 (ms)", dr.itl_ms.p50, gw.itl_ms.p50),
            ("ITL p99 (ms)", dr.itl_ms.p99, gw.itl_ms.p99),
        ];
        for (name, a, b) in rows {
            writeln!(w, "{name:<22} {a:>12.3} {b:>12.3} {:>+12.3}", b - a)?;
        }
        let ratio = self
            .throughput_ratio
            .map_or_else(|| "-".to_string(), |r| format!("x{r:.3}"));
        writeln!(
            w,
            "{:<22} {:>12.1} {:>12.1} {ratio:>12}",
            "total tok/s", dr.total_tokens_per_s, gw.total_tokens_per_s
        )?;
        writeln!(
            w,
            "{:<22} {:>12} {:>12}",
            "completed/requests",
            format!("{}/{}", dr.completed, dr.requests),
            format!("{}/{}", gw.completed, gw.requests)
        )?;
        writeln!(
            w,
            "{:<22} {:>12} {:>12}",
            "completion tokens", dr.completion_tokens_sum, gw.completion_tokens_sum
        )?;
        if !self.cpu.is_empty() {
            writeln!(w)?;
            writeln!(
                w,
                "{:<22} {:>12} {:>12}",
                "CPU us/token", "direct", "gateway"
            )?;
            let num = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
            for p in &self.cpu {
                writeln!(
                    w,
                    "{:<22} {:>12} {:>12}",
                    format!("{:?} pid {}", p.role, p.pid).to_lowercase(),
                    num(p.direct.us_per_token),
                    num(p.gateway.us_per_token)
                )?;
            }
            writeln!(
                w,
                "{:<22} {:>12} {:>12}",
                "added by the gateway",
                "",
                num(self.added_cpu_us_per_token)
            )?;
        }
        writeln!(w)?;
        writeln!(w, "formulas")?;
        for (k, v) in COMPARE_FORMULAS {
            writeln!(w, "  {k}: {v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn own_cpu_time_is_readable() {
        let s = process_cpu_s(std::process::id()).unwrap();
        assert!(s.is_finite() && s >= 0.0);
        assert!(process_cpu_s(u32::MAX).is_err());
        let tree = process_tree_cpu_s(std::process::id()).unwrap();
        assert!(tree >= s);
    }

    #[test]
    fn a_child_is_a_descendant() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let found = descendants(std::process::id());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found.contains(&child.id()), "{found:?}");
    }

    #[test]
    fn peak_in_flight_counts_overlaps_not_back_to_back() {
        let r = |send_us, end_us| RequestRecord {
            send_us,
            end_us,
            ..RequestRecord::default()
        };
        // 0-10 and 10-20 follow each other; 5-15 overlaps both.
        assert_eq!(peak_in_flight(&[r(0, 10), r(10, 20)]), 1);
        assert_eq!(peak_in_flight(&[r(0, 10), r(10, 20), r(5, 15)]), 2);
        assert_eq!(peak_in_flight(&[]), 0);
    }

    #[test]
    fn added_cpu_subtracts_the_engines_own_cost() {
        let cost = |us: f64| CpuCost {
            cpu_s: 0.0,
            completion_tokens: 1,
            us_per_token: Some(us),
        };
        let p = |role, d, g| ProcessCpu {
            role,
            pid: 1,
            direct: cost(d),
            gateway: cost(g),
        };
        let cpu = [
            p(Role::Gateway, 0.0, 30.0),
            p(Role::Agent, 0.0, 20.0),
            p(Role::Engine, 100.0, 105.0),
        ];
        assert_eq!(added_cpu(&cpu), Some(55.0));
        assert_eq!(added_cpu(&[]), None);
    }
}
