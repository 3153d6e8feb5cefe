//! The short version of every drill (`switchyard-loadtest drill NAME`), as the test command
//! runs it: a few seconds of load on a local cluster of `switchyard` processes with its own
//! Redis and a fresh database, the fault, and every invariant the drill checks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::time::Duration;

use switchyard_loadtest::drill::{DrillOptions, DrillReport, PeakShape, bank, drill, peak_200};

/// `target/<profile>/switchyard`, built with the workspace's tests.
fn switchyard_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    profile_dir.join("switchyard")
}

fn short_options() -> DrillOptions {
    DrillOptions {
        bin: switchyard_bin(),
        database: std::env::var("SWITCHYARD_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned()),
        load: Duration::from_secs(6),
        progress: false,
        keep_logs: false,
        abandon: 400,
    }
}

async fn short(name: &str) {
    let reports = drill(name, &short_options()).await.unwrap();
    assert_eq!(reports.len(), 1);
    passed(&reports[0]);
}

/// Prints the report and asserts it passed; returns what it printed.
fn passed(report: &DrillReport) -> String {
    let mut out = Vec::new();
    report.print(&mut out).unwrap();
    let printed = String::from_utf8(out).unwrap();
    println!("{printed}");
    assert!(report.passed, "{printed}");
    // Every drill ends with the books checked.
    assert!(
        report
            .checks
            .iter()
            .any(|c| c.name.starts_with("balance = credits")),
        "{printed}"
    );
    printed
}

/// A quarter of the peak (50 streams on nodes carrying a quarter each, queues of 16): the
/// SLOs hold, and past the nodes and the queue the queue is seen rising before the first
/// `queue_full`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peak_200_quarter() {
    let report = peak_200(&short_options(), PeakShape::QUARTER)
        .await
        .unwrap();
    let printed = passed(&report);
    for check in [
        "every stream of the peak completes",
        "llama-3.1-8b-instruct: TTFT p50",
        "qwen2.5-32b-instruct: TTFT p50",
        "llama-3.3-70b-instruct: TTFT p50",
        "past the bound, refusals are 429 queue_full",
        "switchyard_queue_depth rises",
    ] {
        assert!(
            report.checks.iter().any(|c| c.name.starts_with(check)),
            "no check {check:?}: {printed}"
        );
    }
    let refused = &report.figures["overload"]["llama-3.1-8b-instruct"];
    assert!(refused["queue_full"].as_u64().unwrap() > 0, "{printed}");
    assert!(
        refused["queue_depth_before_first_refusal"]
            .as_f64()
            .unwrap()
            >= 8.0,
        "{printed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_replica() {
    short("kill-replica").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_engine() {
    short("kill-engine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_all() {
    short("restart-all").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down() {
    short("redis-down").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_reclaim() {
    short("spot-reclaim").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_10k() {
    short("abandon-10k").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_node() {
    short("cut-node").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down() {
    short("postgres-down").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_streams_500() {
    short("max-streams-500").await;
}

/// Redis restarted empty under load that keeps both nodes full: one queue owner everyone
/// follows, both nodes full again within the run, nobody stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_empty() {
    short("redis-restart-empty").await;
}

/// The replica holding both nodes' sockets frozen past its leases, then woken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeze_socket_holder() {
    short("freeze-socket-holder").await;
}

/// The queue's owner, holding a node's socket, killed under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_queue_owner() {
    short("kill-queue-owner").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bank_check_balances_under_random_faults() {
    let opts = DrillOptions {
        bin: switchyard_bin(),
        database: std::env::var("SWITCHYARD_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned()),
        load: Duration::ZERO,
        progress: false,
        keep_logs: false,
        abandon: 0,
    };
    let report = bank(&opts, 1500, 11).await.unwrap();
    let mut out = Vec::new();
    report.print(&mut out).unwrap();
    let printed = String::from_utf8(out).unwrap();
    println!("{printed}");
    assert!(report.passed, "{printed}");
    // Faults were injected, and the poor teams ran out of credit.
    assert!(
        !report.figures["faults"].as_array().unwrap().is_empty(),
        "{printed}"
    );
    assert!(
        report.figures["outcomes"]
            .get("402 insufficient_balance")
            .is_some(),
        "{printed}"
    );
}

#[tokio::test]
async fn an_unknown_drill_names_the_drills() {
    let opts = DrillOptions {
        bin: switchyard_bin(),
        database: String::new(),
        load: Duration::from_secs(1),
        progress: false,
        keep_logs: false,
        abandon: 1,
    };
    let err = drill("no-such-drill", &opts).await.unwrap_err().to_string();
    assert!(
        err.contains("kill-replica") && err.contains("abandon-10k"),
        "{err}"
    );
}
