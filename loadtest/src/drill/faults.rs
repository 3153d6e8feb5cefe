//! Drills that cut a link with a [`super::CutProxy`] (a node's socket, the replicas'
//! PostgreSQL) and the drill of one key's 500 streams.

use std::time::Duration;

use indicatif::ProgressBar;
use serde_json::json;
use tokio::time::Instant;

use super::drills::{after_outage, fails_closed, serves_again};
use super::{
    DrillOptions, Found, MODEL, Stack, completed_or_cut, load_a_third, outcomes, wait_books_closed,
};

/// Waits until `node_id` is (or is not) routable on every live replica; the time it took.
async fn wait_node(
    stack: &Stack,
    node_id: &str,
    ready: bool,
    within: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        let mut all = true;
        for r in stack.live_replicas() {
            let nodes = stack.ready_nodes(&r.url).await.unwrap_or_default();
            all &= nodes.iter().any(|n| n == node_id) == ready;
        }
        if all {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Requests the engines of every node but node 0 have completed.
async fn other_engines_done(stack: &Stack) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for i in 1..stack.node_ids.len() {
        sum += stack
            .engine_metric_read(i, "vllm:request_success_total")
            .await?;
    }
    Ok(sum)
}

fn seconds(t: Option<Duration>, otherwise: &str) -> String {
    t.map_or_else(
        || otherwise.to_owned(),
        |t| format!("{:.1} s", t.as_secs_f64()),
    )
}

/// Node 0's socket cut under load, then restored: it leaves routing everywhere, gets
/// nothing while gone, its streams end with an error event or run elsewhere, and it comes
/// back once its agent can reach the replica again.
pub(super) async fn cut_node(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let node = stack.node_ids[0].clone();
    let runs = load_a_third(stack, opts, bar, 8).await;
    bar.set_message("cut node 0's socket");
    if let Some(p) = &stack.node_proxy {
        p.cut();
    }
    let left = wait_node(stack, &node, false, Duration::from_secs(20)).await;
    found.check(
        "the cut node leaves routing on every replica",
        left.is_some(),
        format!("after {}", seconds(left, "more than 20 s")),
    );
    found.figure("node_left_seconds", json!(left.map(|t| t.as_secs_f64())));
    // What it was running when cut ends within a second (the engine finishes or the agent
    // cancels); from then on nothing reaches it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let done = "vllm:request_success_total";
    let before = stack.engine_metric_read(0, done).await?;
    let running_before = stack
        .engine_metric_read(0, "vllm:num_requests_running")
        .await?;
    let others_before = other_engines_done(stack).await?;
    tokio::time::sleep(opts.load / 4).await;
    let after = stack.engine_metric_read(0, done).await?;
    let others_after = other_engines_done(stack).await?;
    found.check(
        "nothing is sent to the node while it is cut off",
        after == before && running_before == 0.0 && others_after > others_before,
        format!(
            "its engine completed {before} before and {after} after ({running_before} running); \
             the other engines {others_before} and {others_after}"
        ),
    );
    bar.set_message("restore the link");
    if let Some(p) = &stack.node_proxy {
        p.restore();
    }
    let back = wait_node(stack, &node, true, Duration::from_secs(40)).await;
    found.check(
        "the node comes back once its link does",
        back.is_some(),
        format!("after {}", seconds(back, "more than 40 s")),
    );
    found.figure("node_back_seconds", json!(back.map(|t| t.as_secs_f64())));
    let reports = runs.all().await?;
    let all = outcomes(&reports);
    let (ok, detail) = completed_or_cut(&all);
    found.check(
        "every client completes or is cut with an error event",
        ok,
        detail,
    );
    found.figure("outcomes", json!(all));
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// PostgreSQL unreachable from every replica under load, then reachable again: admission
/// fails closed meanwhile, and the platform serves again once it is back.
pub(super) async fn postgres_down(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 4).await;
    bar.set_message("cut PostgreSQL off");
    if let Some(p) = &stack.database_proxy {
        p.cut();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    fails_closed(stack, found, "PostgreSQL is unreachable").await;
    tokio::time::sleep(opts.load / 3).await;
    bar.set_message("PostgreSQL reachable again");
    if let Some(p) = &stack.database_proxy {
        p.restore();
    }
    serves_again(stack, found, "PostgreSQL is back").await;
    after_outage(stack, found, runs).await
}

/// Streams a key may run at once in `max-streams-500`.
const MAX_STREAMS: u32 = 40;
/// What reading three gauges one after another may add to their sum.
const SAMPLING_SLACK: f64 = 2.0;

/// 500 streams on one key with `max_streams` 40, entering every replica: never more than
/// 40 run at once across the cluster, the rest are refused with `concurrency_limited`.
pub(super) async fn max_streams(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let key = stack.key_with_max_streams(MAX_STREAMS).await?;
    bar.set_message("500 streams on one key");
    // One run over every replica (one clock for every request): its workers take the
    // replicas in turn.
    let urls: Vec<String> = stack
        .replicas
        .iter()
        .map(|r| format!("{}/v1", r.url))
        .collect();
    let mut cfg = crate::RunConfig::new(urls.join(","), MODEL);
    cfg.api_key = Some(key);
    cfg.streams = 500;
    cfg.limit = crate::Limit::Duration(opts.load);
    cfg.prompt_tokens = 200;
    // Long streams, so that the key's 40 places stay taken.
    cfg.max_tokens = 400;
    cfg.timeout = Duration::from_secs(30);
    let run = tokio::spawn(crate::run(cfg));
    let mut peak = 0.0_f64;
    while !run.is_finished() {
        let mut running = 0.0;
        for n in 0..stack.node_ids.len() {
            running += stack.engine_metric(n, "vllm:num_requests_running").await;
        }
        peak = peak.max(running);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = run.await??;
    let all = report.outcomes.clone();
    // How many streams the clients saw streaming at once (a figure, not a bound: a stream's
    // place frees when its generation ends, and a busy client may still be reading the
    // buffered rest of it).
    let mut edges: Vec<(u64, i64)> = report
        .requests
        .iter()
        .filter(|r| r.completed)
        .filter_map(|r| {
            let first = r.send_us + r.ttft_us?;
            let last = r.send_us + r.last_content_us?;
            Some([(first, 1), (last, -1)])
        })
        .flatten()
        .collect();
    edges.sort_unstable();
    let (mut open, mut overlap) = (0_i64, 0_i64);
    for (_, d) in edges {
        open += d;
        overlap = overlap.max(open);
    }
    found.figure("outcomes", json!(all));
    found.figure("peak_streams_seen_by_clients", json!(overlap));
    found.figure("peak_running_on_engines", json!(peak));
    // The engines are read one after another: a place freed on one and taken on another
    // between two reads counts twice, so their sum may exceed the bound by a read or two.
    found.check(
        "never more than max_streams run at once across the cluster",
        peak > 0.0 && peak <= f64::from(MAX_STREAMS) + SAMPLING_SLACK,
        format!("at most {peak} ran on the engines at once; max_streams {MAX_STREAMS}"),
    );
    let unexpected: Vec<&String> = all
        .keys()
        .filter(|k| *k != "200 ok" && *k != "429 concurrency_limited")
        .collect();
    found.check(
        "the rest are refused with concurrency_limited",
        unexpected.is_empty() && all.contains_key("429 concurrency_limited"),
        format!("{all:?}"),
    );
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}
