//! Ledger invariants after a randomized run on PostgreSQL and Redis: 2,000 requests with
//! client drops and engine crashes mixed in. Every row ends settled or cancelled exactly
//! once, the balance equals credits minus settled cost, no reservation stays open, and the
//! settled tokens match what the engines produced.

use std::time::Duration;

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::json;
use switchyard::sim::FaultSpec;
use switchyard::store::LedgerStatus;

use crate::common::{clean_redis, drop_pg, fresh_pg, http, redis_url, wait_for};

const REQUESTS: usize = 2000;
const CREDITS: i64 = 1_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_invariants_hold_after_2000_requests_with_drops_and_crashes() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swtest:{:08x}:", rand::random::<u32>());
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 3)],
        time_scale: 50.0,
        credits: CREDITS,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    config.server.timeouts.cancel_grace_ms = 100;
    let fleet = switchyard::demo::Fleet::start(config, &db_url)
        .await
        .unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    // One engine of three crashes every stream after 5 tokens.
    fleet.nodes[2].sim.set_faults(&FaultSpec {
        crash_after_tokens: Some(5),
        ..FaultSpec::default()
    });

    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2026);
    let plan: Vec<(u32, bool, bool)> = (0..REQUESTS)
        .map(|_| {
            (
                rng.random_range(1..24),
                rng.random_bool(0.5),
                rng.random_bool(0.2),
            )
        })
        .collect();
    let dropped: usize = futures::stream::iter(plan)
        .map(|(max_tokens, stream, drop_early)| {
            let (url, key) = (url.clone(), fleet.api_key.clone());
            async move {
                let body = json!({"model": "small", "messages": [{"role": "user", "content": "count"}],
                                  "max_tokens": max_tokens, "stream": stream});
                let resp = http().post(url).bearer_auth(key).json(&body).send().await.unwrap();
                if drop_early && stream {
                    let mut bytes = resp.bytes_stream();
                    let _ = bytes.next().await;
                    return 1;
                }
                let _ = resp.bytes().await;
                0
            }
        })
        .buffer_unordered(48)
        .collect::<Vec<usize>>()
        .await
        .into_iter()
        .sum();

    let store = fleet.store.clone();
    wait_for(
        Duration::from_secs(60),
        "every reservation to close",
        || {
            let store = store.clone();
            async move { store.open_reservations().await.unwrap() == 0 }
        },
    )
    .await;
    let rows = fleet.store.ledger_rows(None).await.unwrap();
    assert_eq!(rows.len(), REQUESTS, "one row per request");
    assert!(
        rows.iter()
            .all(|r| matches!(r.status, LedgerStatus::Settled | LedgerStatus::Cancelled))
    );
    let settled_cost: i64 = rows
        .iter()
        .filter(|r| r.status == LedgerStatus::Settled)
        .map(|r| r.cost_microcredits)
        .sum();
    let balance = fleet
        .store
        .team(fleet.team_id)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    assert_eq!(
        balance,
        CREDITS - settled_cost,
        "balance = credits - settled cost"
    );

    let settled_tokens: i64 = rows.iter().map(|r| r.completion_tokens).sum();
    let engine_tokens: i64 = fleet
        .nodes
        .iter()
        .map(|n| n.sim.stats().generation_tokens as i64)
        .sum();
    let drift = engine_tokens - settled_tokens;
    // A client that leaves mid-stream is settled with the last usage its node saw; the engine
    // may have produced up to a couple of tokens more before the abort reached it.
    assert!(
        drift >= 0 && drift <= 2 * dropped as i64,
        "drift {drift} over {dropped} dropped streams"
    );
    println!(
        "requests {REQUESTS}, dropped {dropped}, engine tokens {engine_tokens}, settled {settled_tokens}, drift {drift}"
    );

    fleet.shutdown(Duration::from_secs(1)).await;
    clean_redis(&prefix).await;
    drop_pg(&db_name).await;
}
