//! The request path on the production backends: PostgreSQL for the ledger and
//! configuration, Redis for coordination (heartbeats land in `node:{id}` under the key prefix).

use std::time::Duration;

use serde_json::json;
use switchyard::store::LedgerStatus;

use crate::common::{clean_redis, drop_pg, fresh_pg, post_chat, read_events, redis_url};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_settles_in_postgresql_and_heartbeats_reach_redis() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swtest:{:08x}:", rand::random::<u32>());
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 1)],
        time_scale: 20.0,
        heartbeat_interval: Duration::from_millis(200),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    let fleet = switchyard::demo::Fleet::start(config, &db_url)
        .await
        .unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);

    let body = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": true,
                      "stream_options": {"include_usage": true}});
    let resp = post_chat(&fleet, &body).await;
    let (events, done) = read_events(resp).await;
    let id = events[0]["id"].as_str().unwrap().to_owned();
    assert!(done);
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 9);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let row = fleet.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.completion_tokens),
        (LedgerStatus::Settled, 9)
    );

    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("{prefix}k:node:small-1");
    let owner: Option<String> = redis::cmd("HGET")
        .arg(&key)
        .arg("owner")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        owner.as_deref(),
        Some(fleet.server.state().replica_id.as_str()),
        "heartbeat in Redis"
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0 && ttl <= 15_000, "expires within 15 s: {ttl}");

    fleet.shutdown(Duration::from_secs(1)).await;
    clean_redis(&prefix).await;
    drop_pg(&db_name).await;
}
