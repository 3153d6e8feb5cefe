#![expect(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use super::plot::{series, table_rows};
use super::scenarios::figure_of;
use super::*;
use crate::compare::{AddedItl, AddedTtft, CompareSummary, CpuCost, ProcessCpu, Role};
use crate::{ConfigSummary, Figures, Percentiles};

fn options(scenarios: &[&str]) -> BenchOptions {
    BenchOptions {
        bin: PathBuf::from("switchyard"),
        database: "postgres://127.0.0.1/postgres".to_owned(),
        out: std::env::temp_dir(),
        scenarios: scenarios.iter().map(|s| (*s).to_owned()).collect(),
        quick: true,
        phase: Duration::from_secs(3),
        rounds: 1,
        many: 1000,
        litellm: false,
        litellm_workers: 2,
        peers: PathBuf::from("peers"),
        progress: false,
        command: "switchyard-loadtest bench --quick".to_owned(),
    }
}

fn summary() -> ConfigSummary {
    ConfigSummary {
        url: "http://127.0.0.1:1/v1".to_owned(),
        endpoint: "http://127.0.0.1:1/v1/chat/completions".to_owned(),
        streams: 50,
        duration_s: Some(3.0),
        requests: None,
        prompt_tokens: 500,
        max_tokens: 64,
        models: Vec::new(),
        time_scale: 1.0,
        timeout_s: 300.0,
        tokens_per_word: None,
    }
}

fn side(ttft_p50: f64, tokens: u64, tokens_per_s: f64) -> Figures {
    Figures {
        requests: 100,
        completed: 98,
        ttft_ms: Percentiles {
            p50: ttft_p50,
            p99: ttft_p50 * 2.0,
            ..Percentiles::default()
        },
        completion_tokens_sum: tokens,
        total_tokens_per_s: tokens_per_s,
        ..Figures::default()
    }
}

fn cpu(role: Role, direct_s: f64, gateway_s: f64) -> ProcessCpu {
    let cost = |cpu_s| CpuCost {
        cpu_s,
        completion_tokens: 0,
        us_per_token: None,
    };
    ProcessCpu {
        role,
        pid: 1,
        direct: cost(direct_s),
        gateway: cost(gateway_s),
    }
}

/// Direct: TTFT p50 50 ms, 10,000 tokens at 1,000 tok/s; through the gateway: 54 ms,
/// 9,000 tokens at 900 tok/s. The gateway's processes spent 0.9 s, the engine 0.5 s.
fn run() -> Run {
    let compare = crate::CompareReport {
        config: CompareSummary {
            rounds: 1,
            order: Vec::new(),
            direct: summary(),
            gateway: summary(),
        },
        time_scale: 1.0,
        formulas: BTreeMap::new(),
        direct: side(50.0, 10_000, 1000.0),
        gateway: side(54.0, 9_000, 900.0),
        added_ttft_ms: AddedTtft::default(),
        added_itl_ms: AddedItl::default(),
        throughput_ratio: Some(0.9),
        cpu: vec![
            cpu(Role::Gateway, 0.0, 0.6),
            cpu(Role::Agent, 0.0, 0.3),
            cpu(Role::Engine, 0.5, 0.6),
        ],
        added_cpu_us_per_token: None,
        phases: Vec::new(),
    };
    let mib = 1024.0 * 1024.0;
    Run {
        subject: "switchyard".to_owned(),
        streams: 50,
        peaks: BTreeMap::from([
            ("rss_bytes.serve-0".to_owned(), 30.0 * mib),
            ("rss_bytes.agent".to_owned(), 20.0 * mib),
            ("rss_bytes.engine".to_owned(), 25.0 * mib),
            ("streams.serve-0".to_owned(), 48.0),
            ("streams.engine".to_owned(), 50.0),
        ]),
        compare,
    }
}

#[test]
fn a_figure_carries_its_direct_baseline_and_ratio() {
    let f = Figure::new("overhead", "switchyard", 1, "ttft_p50_ms", 55.0, 50.0);
    assert_eq!(f.added, 5.0);
    assert!((f.ratio.unwrap() - 1.1).abs() < 1e-12);
    let none = Figure::new("10k", "switchyard", 10, "failed", 3.0, 0.0);
    assert_eq!(none.ratio, None);
}

#[test]
fn a_comparison_becomes_figures() {
    let run = run();
    assert_eq!(figure_of(&run, "ttft_p50_ms"), Some((54.0, 50.0)));
    assert_eq!(figure_of(&run, "ttft_p99_ms"), Some((108.0, 100.0)));
    assert_eq!(figure_of(&run, "tokens_per_s"), Some((900.0, 1000.0)));
    // Serve + agent: 0.9 s over 9,000 tokens = 100 µs; the engine: 0.5 s over 10,000 = 50 µs.
    let (value, direct) = figure_of(&run, "cpu_us_per_token").unwrap();
    assert!((value - 100.0).abs() < 1e-9 && (direct - 50.0).abs() < 1e-9);
    let (value, direct) = figure_of(&run, "tokens_per_core_s").unwrap();
    assert!((value - 10_000.0).abs() < 1e-6 && (direct - 20_000.0).abs() < 1e-6);
    assert_eq!(figure_of(&run, "peak_rss_mib"), Some((50.0, 25.0)));
    assert_eq!(figure_of(&run, "serve_peak_rss_mib"), Some((30.0, 25.0)));
    assert_eq!(figure_of(&run, "agent_peak_rss_mib"), Some((20.0, 25.0)));
    assert_eq!(figure_of(&run, "peak_streams"), Some((48.0, 50.0)));
    assert_eq!(figure_of(&run, "failed"), Some((2.0, 2.0)));
    assert_eq!(figure_of(&run, "no_such_figure"), None);

    let mut idle = run;
    idle.compare.gateway.completion_tokens_sum = 0;
    assert_eq!(
        figure_of(&idle, "cpu_us_per_token"),
        None,
        "no tokens, no figure"
    );
}

/// A report as the suite would write it: the overhead at three concurrencies through both
/// gateways, and one figure of each other scenario.
fn report() -> BenchReport {
    let machine = Machine {
        cores: 2,
        date: "2026-12-03T12:00:00Z".to_owned(),
        git_commit: Some("0123456789abcdef".to_owned()),
        ..Machine::default()
    };
    let mut report = BenchReport::new(machine, &options(SCENARIOS));
    for (subject, added, ratio) in [("switchyard", 3.0, 0.99), ("litellm", 800.0, 0.4)] {
        for streams in [200u64, 1, 50] {
            let grow = streams as f64;
            let f = |name: &str, value: f64, direct: f64| {
                Figure::new("overhead", subject, streams, name, value, direct)
            };
            report
                .figures
                .push(f("ttft_p50_ms", 50.0 + added * grow.sqrt(), 50.0));
            report
                .figures
                .push(f("ttft_p99_ms", 60.0 + added * grow, 60.0));
            report
                .figures
                .push(f("tokens_per_s", 1000.0 * ratio, 1000.0));
            report.figures.push(f("cpu_us_per_token", 60.0, 5.0));
            report.figures.push(f("failed", 0.0, 0.0));
        }
    }
    report.figures.push(Figure::new(
        "admission",
        "switchyard",
        200,
        "new_streams_per_s",
        400.0,
        2000.0,
    ));
    report.figures.push(Figure::new(
        "10k",
        "switchyard",
        10_000,
        "serve_peak_rss_mib",
        550.0,
        120.0,
    ));
    report
        .figures
        .push(Figure::new("10k", "switchyard", 10_000, "failed", 0.0, 0.0));
    report
}

#[test]
fn the_report_serializes_every_figure_with_machine_and_formulas() {
    let report = report();
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["machine"]["cores"], 2);
    assert_eq!(json["machine"]["git_commit"], "0123456789abcdef");
    assert_eq!(
        json["figures"].as_array().unwrap().len(),
        report.figures.len()
    );
    let first = &json["figures"][0];
    for field in [
        "scenario", "subject", "streams", "name", "value", "direct", "added", "ratio",
    ] {
        assert!(first.get(field).is_some(), "{field} missing: {first}");
    }
    assert!(json["formulas"]["cpu_us_per_token"].is_string());
    assert!(report.passed(), "no scenario ran, none failed");
    let mut text = Vec::new();
    report.print(&mut text).unwrap();
    assert!(
        String::from_utf8(text)
            .unwrap()
            .contains("new_streams_per_s")
    );
}

#[test]
fn the_plot_reads_the_overhead_lines_and_tabulates_the_rest() {
    let report = report();
    let added = series(&report, "litellm", "ttft_p99_ms", |f| Some(f.added));
    assert_eq!(
        added,
        vec![(1.0, 800.0), (50.0, 40_000.0), (200.0, 160_000.0)]
    );
    let ratio = series(&report, "switchyard", "tokens_per_s", |f| f.ratio);
    assert_eq!(ratio.len(), 3);
    assert!(ratio.iter().all(|&(_, r)| (r - 0.99).abs() < 1e-9));

    let rows = table_rows(&report);
    // Overhead: CPU per token for 2 subjects × 3 concurrencies; admission; 10k's memory; no
    // `failed` row where nothing failed.
    assert_eq!(rows.len(), 6 + 2, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r[3] != "failed" && r[3] != "ttft_p50_ms")
    );
    let admission = rows.iter().find(|r| r[0] == "admission").unwrap();
    assert_eq!(admission[4..], ["400.0", "2000", "0.200"]);
}

#[test]
fn the_plot_is_a_png() {
    let dir = std::env::temp_dir().join(format!("switchyard-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bench.png");
    draw(&report(), &path).expect("drawing (a TrueType font must be installed)");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(bytes[..8], *b"\x89PNG\r\n\x1a\n");
    assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
}

#[test]
fn unknown_scenarios_are_refused() {
    assert!(options(&["overhead", "relay"]).validate().is_ok());
    let err = options(&["overhead", "nope"]).validate().unwrap_err();
    assert!(err.to_string().contains("unknown scenario `nope`"), "{err}");
}
