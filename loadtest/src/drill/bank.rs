//! The bank check: many randomized requests across replicas and teams, some teams short of
//! credit, some clients leaving mid-stream, with faults injected at random (a replica
//! killed and started again, an engine killed and started again, a node's socket cut and
//! restored). At the end the books must balance exactly for every team, no row may be left
//! reserved, no team may be below zero, no request may be billed twice, and the tokens
//! settled must match the tokens the engines produced, but for the requests a fault or a
//! client cut short (counted, and bounded by their number times the largest `max_tokens`).
//!
//! Seeded: the same seed sends the same requests, to the same replicas and teams, with the
//! same faults in the same order (the processes' timing is the machine's, so a failure
//! reproduces as a scenario, not to the microsecond); a failure prints the seed.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use sqlx::{Connection, Row};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    DrillOptions, DrillReport, Found, MODEL, Stack, StackConfig, ledger_checks, wait_books_closed,
};

/// The largest `max_tokens` a request asks for.
const MAX_TOKENS: u32 = 48;
/// Requests in flight at once.
const CONCURRENCY: usize = 48;

/// One planned request.
#[derive(Debug, Clone)]
struct Planned {
    team: usize,
    replica: usize,
    max_tokens: u32,
    stream: bool,
    /// The client leaves after this many chunks.
    leave_after: Option<u32>,
}

/// How one request ended, as the client saw it.
fn classify(completed: bool, cut: bool, left: bool) -> &'static str {
    match (completed, cut, left) {
        (true, _, _) => "completed",
        (_, _, true) => "left",
        (_, true, _) => "cut",
        _ => "interrupted",
    }
}

/// Runs the bank check with `requests` requests from `seed`.
pub async fn bank(opts: &DrillOptions, requests: usize, seed: u64) -> anyhow::Result<DrillReport> {
    let started = Instant::now();
    let bar = super::progress(opts.progress, "bank");
    let mut found = Found::default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    bar.set_message("starting the cluster");
    let config = StackConfig {
        cut_node: true,
        ..super::short_deadlines()
    };
    let mut stack = Stack::start(&opts.bin, &opts.database, config).await?;
    let checked = check_books(&mut stack, &mut found, &mut rng, requests, seed, &bar).await;
    if let Err(e) = &checked {
        found.check("the bank check ran", false, format!("{e:#}"));
    }
    let logs = (opts.keep_logs || !found.passed()).then(|| stack.work_dir().display().to_string());
    bar.finish_and_clear();
    if let Err(e) = stack.stop(logs.is_some()).await {
        eprintln!("bank: could not drop its database: {e:#}");
    }
    Ok(DrillReport {
        drill: format!("bank (seed {seed})"),
        passed: found.passed(),
        seconds: started.elapsed().as_secs_f64(),
        checks: found.checks,
        figures: found.figures,
        logs,
    })
}

/// The requests, the faults and the checks, on a started stack.
async fn check_books(
    stack: &mut Stack,
    found: &mut Found,
    rng: &mut ChaCha8Rng,
    requests: usize,
    seed: u64,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    // Four teams: two rich, two that run out within a few hundred requests (a request costs
    // about one microcredit at the stack's prices; their refusals are 402).
    let mut keys = Vec::new();
    for (i, credits) in [1_000_000_000_000_i64, 1_000_000_000_000, 300, 60]
        .iter()
        .enumerate()
    {
        keys.push(stack.add_team(&format!("bank-{i}"), *credits).await?.1);
    }
    let plan: Vec<Planned> = (0..requests)
        .map(|_| Planned {
            team: rng.random_range(0..keys.len()),
            replica: rng.random_range(0..stack.replicas.len()),
            max_tokens: rng.random_range(1..=MAX_TOKENS),
            stream: rng.random_bool(0.8),
            leave_after: rng.random_bool(0.1).then(|| rng.random_range(1..8)),
        })
        .collect();
    let urls: Vec<String> = stack.replicas.iter().map(|r| r.url.clone()).collect();
    let http = stack.http().clone();
    let (stop, stopped) = watch::channel(false);
    bar.set_message(format!("{requests} requests, faults at random"));
    let sends = async {
        let ends: Vec<String> = futures::stream::iter(plan)
            .map(|p| {
                let (http, url, key) =
                    (http.clone(), urls[p.replica].clone(), keys[p.team].clone());
                async move { send(&http, &url, &key, &p).await }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let _ = stop.send(true);
        ends
    };
    let mut fault_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let (ends, faults) = tokio::join!(sends, inject(stack, &mut fault_rng, stopped));
    let (faults, carried) = faults?;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for e in &ends {
        *counts.entry(e.clone()).or_default() += 1;
    }
    found.figure("seed", json!(seed));
    found.figure("requests", json!(requests));
    found.figure("outcomes", json!(counts));
    found.figure("faults", json!(faults));
    bar.set_message("waiting for the books to close");
    wait_books_closed(stack, Duration::from_secs(60)).await;
    ledger_checks(stack, found).await;
    // Engines' tokens: what each produced before it was killed, plus its counter now.
    let mut produced = carried.iter().sum::<f64>();
    for n in 0..stack.node_ids.len() {
        produced += stack.engine_metric(n, "vllm:generation_tokens_total").await;
    }
    let mut conn = sqlx::PgConnection::connect(&stack.db_url).await?;
    let row = sqlx::query(
        "SELECT count(*), \
                coalesce(sum(completion_tokens) FILTER (WHERE status = 'settled'), 0)::BIGINT, \
                (SELECT count(*) FROM teams WHERE balance_microcredits < 0), \
                count(*) FILTER (WHERE status = 'settled') \
         FROM usage_ledger",
    )
    .fetch_one(&mut conn)
    .await?;
    let (rows, settled_tokens, negative, settled_rows): (i64, i64, i64, i64) = (
        row.try_get(0)?,
        row.try_get(1)?,
        row.try_get(2)?,
        row.try_get(3)?,
    );
    conn.close().await?;
    // A request refused before the ledger (402, 429) has no row; every other request has at
    // most one, and every completed one has a settled one.
    let refused: u64 = counts
        .iter()
        .filter(|(k, _)| k.starts_with("402 ") || k.starts_with("429 "))
        .map(|(_, n)| n)
        .sum();
    let may_have_rows = u64::try_from(requests)
        .unwrap_or(u64::MAX)
        .saturating_sub(refused);
    let completed = counts.get("completed").copied().unwrap_or(0);
    let rows = u64::try_from(rows).unwrap_or(u64::MAX);
    found.check(
        "no request billed twice",
        rows <= may_have_rows,
        format!("{rows} ledger rows for {may_have_rows} requests not refused before the ledger"),
    );
    found.check(
        "every completed request is settled",
        u64::try_from(settled_rows).unwrap_or(0) >= completed,
        format!("{settled_rows} settled rows, {completed} completed requests"),
    );
    found.check(
        "no team below zero",
        negative == 0,
        format!("{negative} teams with a negative balance"),
    );
    // Requests a fault or their client cut short, each of which may have produced tokens
    // that were not settled (up to its `max_tokens`), plus, per engine killed, what its
    // running requests produced between the counter's last read and the kill.
    let engines_killed = faults.iter().filter(|f| f.contains("engine")).count();
    let short = ["cut", "left", "interrupted", "transport_error"]
        .iter()
        .map(|k| counts.get(*k).copied().unwrap_or(0))
        .sum::<u64>()
        + u64::try_from(engines_killed * CONCURRENCY).unwrap_or(u64::MAX);
    let bound = short as f64 * f64::from(MAX_TOKENS);
    let diff = produced - settled_tokens as f64;
    found.figure("tokens", json!({"engines_produced": produced, "settled": settled_tokens, "difference": diff, "bound": bound}));
    found.check(
        "settled tokens = tokens the engines produced, but for requests cut short",
        diff.abs() <= bound,
        format!("engines {produced}, settled {settled_tokens}: {diff} apart; requests cut short allow {bound}"),
    );
    Ok(())
}

/// Faults at random until `stopped`: what was injected, and each engine's tokens before it
/// was killed.
async fn inject(
    stack: &mut Stack,
    rng: &mut ChaCha8Rng,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<(Vec<String>, Vec<f64>)> {
    let mut done = Vec::new();
    let mut carried = vec![0.0; stack.node_ids.len()];
    let mut restarts = 0;
    loop {
        let pause = Duration::from_millis(rng.random_range(1500..4000));
        tokio::select! {
            _ = stopped.wait_for(|s| *s) => break,
            () = tokio::time::sleep(pause) => {}
        }
        match rng.random_range(0..3) {
            0 => {
                let r = rng.random_range(0..stack.replicas.len());
                stack.kill_replica(r).await?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                restarts += 1;
                stack
                    .restart_replica(r, &format!("bank-{r}-{restarts}"))
                    .await?;
                done.push(format!("kill -9 replica {r}, started again"));
            }
            1 => {
                let n = rng.random_range(0..stack.node_ids.len());
                carried[n] += stack.engine_metric(n, "vllm:generation_tokens_total").await;
                stack.kill_engine(n).await?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                stack.restart_engine(n).await?;
                done.push(format!("kill -9 engine {n}, started again"));
            }
            _ => {
                if let Some(p) = &stack.node_proxy {
                    p.cut();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    p.restore();
                }
                done.push("cut node 0's socket for 1 s".to_owned());
            }
        }
    }
    Ok((done, carried))
}

/// Sends one planned request; how it ended.
async fn send(http: &reqwest::Client, url: &str, key: &str, p: &Planned) -> String {
    let body = json!({"model": MODEL, "stream": p.stream, "max_tokens": p.max_tokens,
        "messages": [{"role": "user", "content": "count the sheep in the field"}]});
    let resp = match http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => return "transport_error".to_owned(),
    };
    if !resp.status().is_success() {
        let status = resp.status().as_u16();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        return format!("{status} {}", body["error"]["code"].as_str().unwrap_or("-"));
    }
    if !p.stream {
        return match resp.bytes().await {
            Ok(_) => "completed".to_owned(),
            Err(_) => "interrupted".to_owned(),
        };
    }
    let mut chunks = resp.bytes_stream();
    let (mut seen, mut text) = (0u32, Vec::new());
    while let Some(chunk) = chunks.next().await {
        let Ok(chunk) = chunk else {
            break;
        };
        seen += 1;
        text.extend_from_slice(&chunk);
        if p.leave_after.is_some_and(|k| seen >= k) {
            return classify(false, false, true).to_owned();
        }
    }
    let text = String::from_utf8_lossy(&text);
    classify(
        text.contains("data: [DONE]"),
        text.contains("\"error\""),
        false,
    )
    .to_owned()
}
