//! End-to-end runs of the harness against the real simulator from the
//! `switchyard` crate, in-process and through the CLI binary: figures,
//! outcomes for errors and faults, prompt calibration, and the `--out` JSON.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use switchyard::sim::{FaultSpec, Profile, SimConfig, SimServer};
use switchyard_loadtest::{Limit, RunConfig, run};

async fn start_sim(model: &str) -> SimServer {
    let config = SimConfig {
        model: model.into(),
        profile: Profile::B8,
        time_scale: 20.0,
        ..SimConfig::default()
    };
    SimServer::start(config).await.unwrap()
}

fn config(sim: &SimServer, model: &str, streams: usize, requests: u64) -> RunConfig {
    let mut cfg = RunConfig::new(format!("{}/v1/", sim.base_url()), model);
    cfg.streams = streams;
    cfg.limit = Limit::Requests(requests);
    cfg.prompt_tokens = 100;
    cfg.max_tokens = 32;
    cfg.time_scale = 20.0;
    cfg.timeout = Duration::from_secs(60);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_complete_and_figures_match_the_simulator() {
    let sim = start_sim("small").await;
    let report = run(config(&sim, "small", 8, 24)).await.unwrap();
    sim.shutdown().await;

    assert_eq!(report.outcomes.len(), 1, "{:?}", report.outcomes);
    assert_eq!(report.outcomes.get("200 ok"), Some(&24));
    let o = &report.overall;
    assert_eq!(o.completed, 24);
    assert_eq!(o.completion_tokens_sum, 24 * 32);
    assert_eq!(o.completion_tokens_mean, Some(32.0));
    assert!(o.ttft_ms.p50 > 0.0);
    assert_eq!(o.ttft_ms.count, 24);
    assert_eq!(o.itl_ms.count, 24);
    // The simulator emits no faster than its timing (in engine time); how much slower
    // depends on the machine's load, so only the ceiling is checked here.
    let tps = o.per_stream_tokens_per_s.p50;
    assert!(tps > 0.0 && tps <= 120.0, "per-stream tok/s {tps}");
    // Engine time is wall clock times the scale; raw values are kept too.
    let raw = &report.overall_wall_clock;
    assert!((o.ttft_ms.p50 - raw.ttft_ms.p50 * 20.0).abs() < 1e-6);
    assert!((o.total_tokens_per_s * 20.0 - raw.total_tokens_per_s).abs() < 1e-6);
    assert!(o.total_tokens_per_s > 0.0);
    assert_eq!(report.requests.len(), 24);
    assert!(report.per_model.is_empty());
    assert_eq!(report.time_scale, 20.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_counted_not_fatal() {
    let sim = start_sim("small").await;
    let mut cfg = config(&sim, "no-such-model", 4, 12);
    // Calibration would stop the run at the first 404; skip it to load the endpoint.
    cfg.tokens_per_word = Some(1.0);
    let report = run(cfg).await.unwrap();
    assert_eq!(report.outcomes.len(), 1, "{:?}", report.outcomes);
    assert_eq!(report.outcomes.get("404 404"), Some(&12));
    assert_eq!(report.overall.completed, 0);
    assert_eq!(report.overall.completion_tokens_sum, 0);
    assert_eq!(report.overall.ttft_ms.count, 0);
    let mut out = Vec::new();
    report.print(&mut out).unwrap();

    // With calibration the failed probe stops the run with a clear message.
    let err = run(config(&sim, "no-such-model", 4, 12)).await.unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("calibration probe"), "{msg}");
    assert!(msg.contains("404"), "{msg}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_size_is_calibrated_to_the_endpoint_tokenizer() {
    let sim = start_sim("small").await;
    let mut cfg = config(&sim, "small", 4, 12);
    cfg.prompt_tokens = 500;
    cfg.max_tokens = 4;
    let report = run(cfg).await.unwrap();
    sim.shutdown().await;
    assert_eq!(
        report.outcomes.get("200 ok"),
        Some(&12),
        "{:?}",
        report.outcomes
    );
    let mean = report.overall.prompt_tokens_mean.unwrap();
    assert!((425.0..=575.0).contains(&mean), "mean prompt tokens {mean}");
    let cal = &report.calibration[0];
    assert_eq!(cal.probes.len(), 2);
    assert!(cal.tokens_per_word > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_become_outcomes() {
    let sim = start_sim("small").await;
    let mut cfg = config(&sim, "small", 2, 4);
    cfg.tokens_per_word = Some(1.0);

    sim.set_faults(&FaultSpec {
        crash_after_tokens: Some(5),
        ..FaultSpec::default()
    });
    let report = run(cfg.clone()).await.unwrap();
    assert_eq!(
        report.outcomes.get("interrupted"),
        Some(&4),
        "{:?}",
        report.outcomes
    );
    // Cut streams still delivered tokens; they count toward total throughput.
    assert!(report.overall.completion_tokens_sum > 0);

    sim.set_faults(&FaultSpec {
        crash_after_tokens: None,
        stall_after_tokens: Some(3),
        ..FaultSpec::default()
    });
    let mut stall = cfg.clone();
    stall.timeout = Duration::from_millis(1500);
    stall.limit = Limit::Requests(2);
    let report = run(stall).await.unwrap();
    assert_eq!(
        report.outcomes.get("timeout"),
        Some(&2),
        "{:?}",
        report.outcomes
    );
    sim.shutdown().await;

    let sim = start_sim("small").await;
    sim.set_faults(&FaultSpec {
        http_500: Some(2),
        ..FaultSpec::default()
    });
    let mut cfg = config(&sim, "small", 2, 4);
    cfg.tokens_per_word = Some(1.0);
    let report = run(cfg).await.unwrap();
    let failed: u64 = report
        .outcomes
        .iter()
        .filter(|(k, _)| k.starts_with("500 "))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(failed, 2, "{:?}", report.outcomes);
    assert_eq!(report.outcomes.get("200 ok"), Some(&2));
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_prints_the_table_and_writes_json() {
    let sim = start_sim("small").await;
    let dir = std::env::temp_dir().join(format!("loadtest-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("results.json");
    let url = format!("{}/v1", sim.base_url());
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard-loadtest"))
        .args(["run", "--url", &url, "--streams", "4", "--requests", "8"])
        .args([
            "--prompt-tokens",
            "100",
            "--max-tokens",
            "16",
            "--model",
            "small",
        ])
        .args(["--time-scale", "20", "--timeout", "60s", "--no-progress"])
        .arg("--out")
        .arg(&out)
        .env_remove("OPENAI_API_KEY")
        .output()
        .await
        .unwrap();
    sim.shutdown().await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("TTFT (ms)"), "{stdout}");
    assert!(stdout.contains("ENGINE TIME"), "{stdout}");
    assert!(stdout.contains("200 ok"), "{stdout}");

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(json["time_scale"], 20.0);
    assert_eq!(json["outcomes"]["200 ok"], 8);
    assert_eq!(json["overall"]["completion_tokens_sum"], 8 * 16);
    for key in [
        "ttft_ms",
        "itl_ms",
        "per_stream_tokens_per_s",
        "total_tokens_per_s",
    ] {
        assert!(json["formulas"][key].is_string(), "formula {key}");
    }
    assert!(json["overall_wall_clock"]["ttft_ms"]["p50"].is_number());
    assert_eq!(json["requests"].as_array().unwrap().len(), 8);
    assert_eq!(json["config"]["models"][0]["workers"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_limit_stops_the_run() {
    let sim = start_sim("small").await;
    let mut cfg = config(&sim, "small", 4, 1);
    cfg.limit = Limit::Duration(Duration::from_millis(800));
    cfg.tokens_per_word = Some(1.0);
    let started = std::time::Instant::now();
    let report = run(cfg).await.unwrap();
    sim.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(20));
    let ok = report.outcomes.get("200 ok").copied().unwrap_or(0);
    assert!(ok >= 4, "{:?}", report.outcomes);
    assert_eq!(report.outcomes.values().sum::<u64>(), ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mix_reports_each_model() {
    let sim = start_sim("small").await;
    let mut cfg = config(&sim, "small", 4, 12);
    cfg.models = switchyard_loadtest::parse_mix("small=3,missing=1").unwrap();
    cfg.tokens_per_word = Some(1.0);
    let report = run(cfg).await.unwrap();
    sim.shutdown().await;
    let workers: Vec<usize> = report.config.models.iter().map(|m| m.workers).collect();
    assert_eq!(workers, vec![3, 1]);
    assert_eq!(report.per_model.len(), 2);
    let small = &report.per_model["small"];
    let missing = &report.per_model["missing"];
    assert_eq!(small.outcomes.keys().collect::<Vec<_>>(), vec!["200 ok"]);
    assert_eq!(missing.outcomes.keys().collect::<Vec<_>>(), vec!["404 404"]);
    assert_eq!(small.requests + missing.requests, 12);
    assert_eq!(
        small.completion_tokens_sum,
        report.overall.completion_tokens_sum
    );
    assert!(report.per_model_wall_clock.contains_key("missing"));
    let mut out = Vec::new();
    report.print(&mut out).unwrap();
    assert!(String::from_utf8(out).unwrap().contains("model missing"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ramp_starts_the_workers_evenly_over_it() {
    let sim = start_sim("small").await;
    // Each stream outlasts the ramp, so every worker's first request is its only one.
    let mut cfg = config(&sim, "small", 4, 4);
    cfg.max_tokens = 1000;
    cfg.tokens_per_word = Some(1.3);
    cfg.ramp = Duration::from_millis(800);
    let report = run(cfg).await.unwrap();
    sim.shutdown().await;
    let mut sends: Vec<u64> = report.requests.iter().map(|r| r.send_us).collect();
    sends.sort_unstable();
    assert_eq!(sends.len(), 4);
    // Worker i sleeps i × 200 ms before its first send: no send comes before its
    // slot, and the first comes before the second slot (a late one may close the gap
    // to the next, so gaps between neighbours are not asserted).
    assert!(sends[0] < 200_000, "{sends:?}");
    for (i, &send) in sends.iter().enumerate() {
        assert!(send >= i as u64 * 200_000, "{sends:?}");
    }
}
