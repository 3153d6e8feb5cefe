//! `compare` end to end: two in-process simulators, one as the engine and a
//! slower one (half the time scale) standing in for the gateway, in-process
//! and through the CLI binary with `--json`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use switchyard::sim::{Profile, SimConfig, SimServer};
use switchyard_loadtest::{CompareConfig, Limit, Role, RunConfig, compare};

/// A simulator of `model` running `time_scale` times faster than real.
async fn start_sim(model: &str, time_scale: f64) -> SimServer {
    let config = SimConfig {
        model: model.into(),
        profile: Profile::B8,
        time_scale,
        ..SimConfig::default()
    };
    SimServer::start(config).await.unwrap()
}

fn side(sim: &SimServer, model: &str) -> RunConfig {
    let mut cfg = RunConfig::new(format!("{}/v1", sim.base_url()), model);
    cfg.streams = 4;
    cfg.limit = Limit::Requests(8);
    cfg.prompt_tokens = 100;
    cfg.max_tokens = 16;
    cfg.time_scale = 20.0;
    cfg.timeout = Duration::from_secs(60);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slower_gateway_adds_latency_and_loses_throughput() {
    // The "gateway" runs at half the speed: every latency doubles in wall clock. Slow
    // enough (time scale 4) that the difference is milliseconds, above the noise of a busy
    // 2-core machine running the rest of the suite.
    let direct = start_sim("engine-model", 4.0).await;
    let gateway = start_sim("gw-model", 2.0).await;
    let scaled = |mut cfg: RunConfig| {
        cfg.time_scale = 4.0;
        cfg
    };
    let cfg = CompareConfig {
        direct: scaled(side(&direct, "engine-model")),
        gateway: scaled(side(&gateway, "gw-model")),
        rounds: 2,
        pids: vec![(Role::Gateway, std::process::id())],
    };
    let report = compare(cfg).await.unwrap();
    direct.shutdown().await;
    gateway.shutdown().await;

    assert_eq!(report.phases.len(), 4);
    let order: Vec<_> = report.phases.iter().map(|p| p.side).collect();
    assert_eq!(order, report.config.order);
    assert_ne!(order[0], order[2], "rounds alternate which side goes first");
    assert_eq!(report.direct.completed, 16);
    assert_eq!(report.gateway.completed, 16);
    assert_eq!(report.direct.completion_tokens_sum, 16 * 16);
    assert_ne!(report.config.direct.url, report.config.gateway.url);

    let t = &report.added_ttft_ms;
    // The median is robust at 16 requests a side; the tails are one or two requests each and
    // follow the machine's noise, so they are only checked to be there.
    assert!(t.p50 > 0.0, "{t:?}");
    assert!(t.p90.is_finite() && t.p99.is_finite(), "{t:?}");
    assert!(report.added_itl_ms.p50 > 0.0, "{:?}", report.added_itl_ms);
    let ratio = report.throughput_ratio.unwrap();
    assert!(ratio > 0.0 && ratio < 1.0, "throughput ratio {ratio}");

    let cpu = &report.cpu[0];
    assert_eq!(cpu.role, Role::Gateway);
    assert_eq!(cpu.gateway.completion_tokens, 16 * 16);
    for c in [&cpu.direct, &cpu.gateway] {
        let us = c.us_per_token.unwrap();
        assert!(us.is_finite() && us >= 0.0, "{c:?}");
    }
    let added = report.added_cpu_us_per_token.unwrap();
    // A difference of two coarse CPU readings (10 ms ticks): finite, sign not guaranteed.
    assert!(added.is_finite(), "{added}");

    let mut out = Vec::new();
    report.print(&mut out).unwrap();
    let table = String::from_utf8(out).unwrap();
    assert!(table.contains("TTFT p90 (ms)"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_speed_sides_are_close_and_bad_input_fails_early() {
    let a = start_sim("small", 20.0).await;
    let b = start_sim("small", 20.0).await;
    let mut cfg = CompareConfig {
        direct: side(&a, "small"),
        gateway: side(&b, "small"),
        rounds: 1,
        pids: vec![],
    };
    let report = compare(cfg.clone()).await.unwrap();
    let ratio = report.throughput_ratio.unwrap();
    // Same speed: the ratio is near 1 (loose: a loaded 2-core machine).
    assert!((0.3..3.0).contains(&ratio), "ratio {ratio}");
    assert!(report.cpu.is_empty());
    assert_eq!(report.added_cpu_us_per_token, None);

    cfg.rounds = 0;
    assert!(compare(cfg.clone()).await.is_err());
    cfg.rounds = 1;
    cfg.pids = vec![(Role::Engine, u32::MAX)];
    let msg = format!("{:#}", compare(cfg.clone()).await.unwrap_err());
    assert!(msg.contains("/proc"), "{msg}");
    cfg.pids.clear();
    cfg.gateway.models[0].name = "missing".into();
    let msg = format!("{:#}", compare(cfg).await.unwrap_err());
    assert!(msg.contains("gateway side"), "{msg}");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_compare_prints_the_table_and_writes_json() {
    let direct = start_sim("small", 20.0).await;
    let gateway = start_sim("small", 10.0).await;
    let dir = std::env::temp_dir().join(format!("loadtest-compare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("compare.json");
    let pid = std::process::id().to_string();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard-loadtest"))
        .arg("compare")
        .args(["--direct-url", &format!("{}/v1", direct.base_url())])
        .args(["--direct-model", "small"])
        .args(["--gateway-url", &format!("{}/v1", gateway.base_url())])
        .args(["--gateway-model", "small", "--gateway-key", "k"])
        .args(["--rounds", "2", "--streams", "2", "--requests", "4"])
        .args(["--prompt-tokens", "50", "--max-tokens", "8"])
        .args(["--time-scale", "20", "--timeout", "60s", "--no-progress"])
        .args([
            "--gateway-pid",
            &pid,
            "--agent-pid",
            &pid,
            "--engine-pid",
            &pid,
        ])
        .arg("--json")
        .arg(&out)
        .env_remove("SWITCHYARD_API_KEY")
        .output()
        .await
        .unwrap();
    direct.shutdown().await;
    gateway.shutdown().await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for s in [
        "TTFT p50 (ms)",
        "ITL p99 (ms)",
        "total tok/s",
        "CPU us/token",
        "formulas",
    ] {
        assert!(stdout.contains(s), "{s}: {stdout}");
    }

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    for key in ["p50", "p90", "p99"] {
        assert!(
            json["added_ttft_ms"][key].is_number(),
            "added_ttft_ms.{key}"
        );
    }
    for key in ["p50", "p99"] {
        assert!(json["added_itl_ms"][key].is_number(), "added_itl_ms.{key}");
    }
    assert!(json["throughput_ratio"].as_f64().unwrap() > 0.0);
    assert_eq!(json["direct"]["completed"], 8);
    assert_eq!(json["gateway"]["completed"], 8);
    assert!(json["direct"]["ttft_ms"]["p90"].is_number());
    assert_eq!(json["time_scale"], 20.0);
    assert_eq!(json["config"]["rounds"], 2);
    assert_eq!(json["config"]["order"].as_array().unwrap().len(), 4);
    assert_eq!(json["config"]["direct"]["streams"], 2);
    assert_eq!(json["phases"].as_array().unwrap().len(), 4);
    assert!(json["phases"][0]["completion_tokens"].is_number());
    let cpu = json["cpu"].as_array().unwrap();
    let roles: Vec<&str> = cpu.iter().map(|p| p["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["gateway", "agent", "engine"]);
    for p in cpu {
        for side in ["direct", "gateway"] {
            let us = p[side]["us_per_token"].as_f64().unwrap();
            assert!(us.is_finite() && us >= 0.0, "{p}");
            assert!(p[side]["cpu_s"].is_number());
            assert_eq!(p[side]["completion_tokens"], 8 * 8);
        }
    }
    assert!(json["added_cpu_us_per_token"].is_number());
    for key in [
        "added_ttft_ms",
        "added_itl_ms",
        "throughput_ratio",
        "cpu_us_per_token",
        "ttft_ms",
    ] {
        assert!(json["formulas"][key].is_string(), "formula {key}");
    }
    assert!(!String::from_utf8_lossy(&std::fs::read(&out).unwrap_or_default()).contains("\"k\""));
}
