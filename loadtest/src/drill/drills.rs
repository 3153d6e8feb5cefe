//! The drills themselves: each drives load through a [`Stack`], injects its fault, and
//! records what it checked in [`Found`]. The ledger checks every drill ends with are in
//! [`super`].

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use indicatif::ProgressBar;
use serde_json::json;
use tokio::time::Instant;

use super::{
    DrillOptions, Found, MODEL, Stack, books_closed_since, completed_or_cut, load, load_a_third,
    outcomes, start_load, wait_books_closed,
};
use crate::Report;

/// kill -9 one of three replicas under load through all of them.
pub(super) async fn kill_replica(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 8).await;
    bar.set_message("kill -9 the last replica");
    let doomed = stack.replicas.len() - 1;
    stack.kill_replica(doomed).await?;
    let killed = Instant::now();
    let back = stack.wait_nodes_ready(Duration::from_secs(30)).await;
    found.check(
        "nodes reconnect to the survivors",
        back.is_ok(),
        match &back {
            Ok(_) => format!(
                "every node routable on every survivor {:.1} s after the kill",
                killed.elapsed().as_secs_f64()
            ),
            Err(e) => format!("{e:#}"),
        },
    );
    if back.is_ok() {
        found.figure("nodes_back_seconds", json!(killed.elapsed().as_secs_f64()));
    }
    let reports = runs.each().await?;
    let survivors: Vec<&Report> = reports[..doomed]
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .collect();
    let survived = outcomes(survivors.iter().copied());
    let (ok, detail) = completed_or_cut(&survived);
    found.check(
        "the survivors' clients complete (or are cut with an error event)",
        ok && survivors.len() == doomed,
        detail,
    );
    found.figure("survivor_outcomes", json!(survived));
    if let Some(Ok(r)) = reports.get(doomed) {
        found.figure("doomed_outcomes", json!(r.outcomes));
    }
    bar.set_message("waiting for the sweeper");
    books_closed_since(stack, found, killed).await;
    Ok(())
}

/// An engine killed mid-stream and started again: its streams end with an error event, the
/// rest run elsewhere, and the node serves again once its engine is back.
pub(super) async fn kill_engine(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 8).await;
    bar.set_message("kill -9 an engine");
    stack.kill_engine(0).await?;
    tokio::time::sleep(opts.load / 3).await;
    bar.set_message("the engine starts again");
    stack.restart_engine(0).await?;
    let reports = runs.all().await?;
    let all = outcomes(&reports);
    let (ok, detail) = completed_or_cut(&all);
    found.check(
        "every client completes or is cut with an error event",
        ok,
        detail,
    );
    found.figure("outcomes", json!(all));
    // Once back, the engine takes work again. An engine that refused work twice is out of
    // routing until its node's next heartbeat (every 5 s): a few rounds of load find it back.
    bar.set_message("the restarted engine serves");
    let mut after = BTreeMap::new();
    let mut served = 0;
    for _ in 0..4 {
        let url = stack.replicas[0].url.clone();
        let round = crate::run(load(stack, &url, 8, Duration::from_secs(3))).await?;
        for (k, n) in round.outcomes {
            *after.entry(k).or_default() += n;
        }
        served = engine_requests(stack.engine_ports[0]).await;
        if served > 0 {
            break;
        }
    }
    let (ok_after, detail_after) = completed_or_cut(&after);
    found.check(
        "after its restart the node serves again",
        ok_after && served > 0,
        format!("{detail_after}; the restarted engine ran {served} requests"),
    );
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// Requests a simulated engine has run since it started (its `vllm:request_success_total`).
async fn engine_requests(port: u16) -> u64 {
    let Ok(resp) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await else {
        return 0;
    };
    let text = resp.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
/// Every replica killed at once under load and started again under new names: the nodes
/// come back to all of them, and requests after the restart complete.
pub(super) async fn restart_all(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 8).await;
    bar.set_message("kill -9 every replica, then start them again");
    for i in 0..stack.replicas.len() {
        stack.kill_replica(i).await?;
    }
    let killed = Instant::now();
    for i in 0..stack.replicas.len() {
        stack
            .restart_replica(i, &format!("drill-{i}-again"))
            .await?;
    }
    let back = stack.wait_nodes_ready(Duration::from_secs(60)).await;
    found.check(
        "every node back on every replica",
        back.is_ok(),
        match &back {
            Ok(_) => format!("{:.1} s after the kill", killed.elapsed().as_secs_f64()),
            Err(e) => format!("{e:#}"),
        },
    );
    found.figure("nodes_back_seconds", json!(killed.elapsed().as_secs_f64()));
    let during: Vec<Report> = runs
        .each()
        .await?
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    found.figure("outcomes_across_the_restart", json!(outcomes(&during)));
    bar.set_message("load after the restart");
    let after = after_load(stack).await?;
    let (ok, detail) = only_completed(&after);
    found.check("requests after the restart complete", ok, detail);
    bar.set_message("waiting for the killed replicas' rows");
    books_closed_since(stack, found, killed).await;
    Ok(())
}

/// Redis killed under load, then started again empty: admission fails closed meanwhile
/// (503 `quota_service_unavailable`), and the platform serves again once it is back.
pub(super) async fn redis_down(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 4).await;
    bar.set_message("kill -9 Redis");
    stack.kill_redis().await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    fails_closed(stack, found, "Redis is down").await;
    tokio::time::sleep(opts.load / 3).await;
    bar.set_message("Redis starts again, empty");
    stack.restart_redis().await?;
    serves_again(stack, found, "Redis returns").await;
    after_outage(stack, found, runs).await
}

/// A spot node's two-minute notice: the node is drained under load; what runs on it
/// finishes, nothing new goes to it, and no client sees an error.
pub(super) async fn spot_reclaim(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    let runs = load_a_third(stack, opts, bar, 8).await;
    bar.set_message("the notice: drain a node");
    let reclaimed = stack.node_ids[0].clone();
    stack.drain(&reclaimed).await?;
    let noticed = Instant::now();
    let reports = runs.all().await?;
    let all = outcomes(&reports);
    let (ok, detail) = only_completed(&all);
    found.check("nothing in flight is lost", ok, detail);
    // The drained agent delivers its last results and leaves.
    let mut left = None;
    while noticed.elapsed() < Duration::from_secs(30) {
        let mut gone = true;
        for r in stack.live_replicas() {
            gone &= !stack.ready_nodes(&r.url).await?.contains(&reclaimed);
        }
        if gone {
            left = Some(noticed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    found.check(
        "the drained node leaves routing everywhere",
        left.is_some(),
        match left {
            Some(t) => format!("{:.1} s after the notice", t.as_secs_f64()),
            None => "still routable 30 s after the notice".to_owned(),
        },
    );
    found.figure("node_left_seconds", json!(left.map(|t| t.as_secs_f64())));
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// Clients that leave after the first chunk, `opts.abandon` of them, 200 at a time: every
/// replica's tasks return to their baseline and its memory stays bounded.
pub(super) async fn abandon(
    stack: &mut Stack,
    opts: &DrillOptions,
    bar: &ProgressBar,
    found: &mut Found,
) -> anyhow::Result<()> {
    // Settled first: the first requests start connections and pools that stay.
    let _ = after_load(stack).await?;
    let urls: Vec<String> = stack.replicas.iter().map(|r| r.url.clone()).collect();
    let mut baseline = Vec::new();
    for url in &urls {
        baseline.push(stack.metric(url, "switchyard_tasks_alive").await?);
    }
    let rss_before: Vec<Option<u64>> = (0..urls.len()).map(|i| stack.replica_rss(i)).collect();
    bar.set_message(format!(
        "{} clients leave after the first chunk",
        opts.abandon
    ));
    let started = Instant::now();
    let left: Vec<bool> = futures::stream::iter(0..opts.abandon)
        .map(|i| {
            let (http, url, key) = (
                stack.http().clone(),
                urls[i % urls.len()].clone(),
                stack.key.clone(),
            );
            async move { leave_after_first_chunk(&http, &url, &key).await }
        })
        .buffer_unordered(200)
        .collect()
        .await;
    let abandoned = left.iter().filter(|l| **l).count();
    found.figure("abandoned", json!(abandoned));
    found.figure("abandon_seconds", json!(started.elapsed().as_secs_f64()));
    found.check(
        "the clients got their first chunk before leaving",
        opts.abandon > 0 && abandoned * 10 >= opts.abandon * 9,
        format!("{abandoned} of {}", opts.abandon),
    );
    bar.set_message("waiting for the tasks to end");
    let waited = Instant::now();
    let mut now = Vec::new();
    loop {
        now.clear();
        for url in &urls {
            now.push(stack.metric(url, "switchyard_tasks_alive").await?);
        }
        if now.iter().zip(&baseline).all(|(n, b)| n <= b)
            || waited.elapsed() > Duration::from_secs(60)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    found.check(
        "switchyard_tasks_alive back to its baseline on every replica",
        now.iter().zip(&baseline).all(|(n, b)| n <= b),
        format!(
            "baseline {baseline:?}, after {now:?}, {:.1} s after the last client left",
            waited.elapsed().as_secs_f64()
        ),
    );
    let rss_after: Vec<Option<u64>> = (0..urls.len()).map(|i| stack.replica_rss(i)).collect();
    let grown: Vec<i64> = rss_before
        .iter()
        .zip(&rss_after)
        .filter_map(|(b, a)| {
            Some(i64::try_from(a.as_ref()?.saturating_sub(*b.as_ref()?)).unwrap_or(i64::MAX))
        })
        .collect();
    found.figure("rss_before_bytes", json!(rss_before));
    found.figure("rss_after_bytes", json!(rss_after));
    found.check(
        "every replica's memory grew less than 64 MiB",
        grown.len() == urls.len() && grown.iter().all(|g| *g < 64 << 20),
        format!("grown by {grown:?} bytes"),
    );
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// Three probes through every live replica during an outage of `what`: each must be
/// refused with 503 `quota_service_unavailable` (admission fails closed).
pub(super) async fn fails_closed(stack: &Stack, found: &mut Found, what: &str) {
    let mut refused = BTreeMap::<String, u64>::new();
    for r in stack.live_replicas() {
        for _ in 0..3 {
            *refused.entry(probe(stack, &r.url).await).or_default() += 1;
        }
    }
    let closed = refused.keys().all(|k| k == "503 quota_service_unavailable");
    found.check(
        &format!("admission fails closed while {what}"),
        closed,
        format!("{refused:?}"),
    );
}

/// Probes every live replica until each completes a request (at most 30 s); the time
/// it took is `recovered_seconds`.
pub(super) async fn serves_again(stack: &Stack, found: &mut Found, what: &str) {
    let restored = Instant::now();
    let mut recovered = None;
    while restored.elapsed() < Duration::from_secs(30) {
        let mut all = true;
        for r in stack.live_replicas() {
            all &= probe(stack, &r.url).await == "200 ok";
        }
        if all {
            recovered = Some(restored.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    found.check(
        &format!("every replica serves again once {what}"),
        recovered.is_some(),
        match recovered {
            Some(t) => format!("after {:.1} s", t.as_secs_f64()),
            None => "not within 30 s".to_owned(),
        },
    );
    found.figure(
        "recovered_seconds",
        json!(recovered.map(|t| t.as_secs_f64())),
    );
}

/// After an outage: the outcomes across it, load that must complete, the books closed.
pub(super) async fn after_outage(
    stack: &Stack,
    found: &mut Found,
    runs: super::Loads,
) -> anyhow::Result<()> {
    let during = runs.all().await?;
    found.figure("outcomes_across_the_outage", json!(outcomes(&during)));
    let after = after_load(stack).await?;
    let (ok, detail) = only_completed(&after);
    found.check("requests after the recovery complete", ok, detail);
    wait_books_closed(stack, Duration::from_secs(40)).await;
    Ok(())
}

/// One streaming request dropped after its first chunk; true when a chunk came.
async fn leave_after_first_chunk(http: &reqwest::Client, url: &str, key: &str) -> bool {
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 64,
        "messages": [{"role": "user", "content": "tell me a long story"}]});
    let Ok(resp) = http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
    else {
        return false;
    };
    if !resp.status().is_success() {
        return false;
    }
    let mut chunks = resp.bytes_stream();
    matches!(chunks.next().await, Some(Ok(_)))
}

/// One small request through `url`: its outcome key, as the load harness names them.
pub(super) async fn probe(stack: &Stack, url: &str) -> String {
    let body = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]});
    let resp = stack
        .http()
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(&stack.key)
        .json(&body)
        .send()
        .await;
    match resp {
        Err(_) => "transport_error".to_owned(),
        Ok(r) if r.status().is_success() => "200 ok".to_owned(),
        Ok(r) => {
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            let code = body["error"]["code"].as_str().unwrap_or("-").to_owned();
            format!("{status} {code}")
        }
    }
}

/// Three seconds of load through every live replica, after the fault.
pub(super) async fn after_load(stack: &Stack) -> anyhow::Result<BTreeMap<String, u64>> {
    let reports = start_load(stack, 4, Duration::from_secs(3)).all().await?;
    Ok(outcomes(&reports))
}

/// Every request completed.
pub(super) fn only_completed(outcomes: &BTreeMap<String, u64>) -> (bool, String) {
    let ok = outcomes.get("200 ok").copied().unwrap_or(0);
    (ok > 0 && outcomes.len() == 1, format!("{outcomes:?}"))
}
