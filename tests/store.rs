//! Integration tests of the store, each behaviour run on both backends: SQLite (a file in a
//! fresh temp directory) and PostgreSQL (a fresh database per test, see `store/harness.rs`).
//! Here: connecting, migrating and configuration round trips; the ledger's bodies are in
//! `store/ledger.rs`, the generation lifecycle's in `store/generations.rs`, PostgreSQL's
//! lock waits in `store/postgres.rs`. Each body is a plain
//! async fn; `on_both!` runs it once per backend, as `<body>::sqlite` and
//! `<body>::postgres`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "store/harness.rs"]
mod harness;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use switchyard::store::conformance::{self, reservation, settlement};
use switchyard::store::generations_conformance;
use switchyard::store::{
    API_KEY_PREFIX, Ledger, LedgerError, LedgerStatus, NODE_TOKEN_PREFIX, NewApiKey, PostgresStore,
    Reservation, SettleOutcome, SqliteStore, Store, StoreError, connect_store, cost_of,
    display_prefix, hash_secret, new_secret,
};
use switchyard_actors::lifecycle::memory::MemoryGenerations;
use switchyard_actors::ports::Clock;
use switchyard_actors::ports::memory::MemoryLedger;

use harness::{Backend, Db};

/// Runs each named body on both backends, in a fresh database each: bodies taking
/// `Arc<dyn Store>` under `store:`, bodies that need the database itself (a second
/// connection, plain SQL) under `db:`.
macro_rules! on_both {
    ($arg:ident: $($body:ident),+ $(,)?) => {
        $(
            mod $body {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    let db = Db::new(Backend::Sqlite, stringify!($body)).await;
                    on_both!(@call $arg, $body, db);
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let db = Db::new(Backend::Postgres, stringify!($body)).await;
                    on_both!(@call $arg, $body, db);
                }
            }
        )+
    };
    (@call store, $body:ident, $db:ident) => {
        super::$body($db.store()).await
    };
    (@call db, $body:ident, $db:ident) => {
        super::$body(&$db).await
    };
}

#[path = "store/console.rs"]
mod console;
#[path = "store/generations.rs"]
mod generations;
#[path = "store/ledger.rs"]
mod ledger;
#[path = "store/postgres.rs"]
mod postgres;
#[path = "store/upgrade.rs"]
mod upgrade;

on_both!(store:
    teams_round_trip,
    api_keys_round_trip_by_hash_and_revoke,
    nodes_register_drain_revoke_and_reissue,
);
on_both!(db:
    reopening_finds_the_data_and_migrating_again_changes_nothing,
    a_closed_store_is_unavailable_and_fails_closed,
    credits_append_entries_and_move_the_balance,
    store_timestamps_come_from_the_injected_clock,
);

fn new_key(team_id: i64, secret: &str) -> NewApiKey {
    NewApiKey {
        team_id,
        hash: hash_secret(secret),
        prefix: display_prefix(secret),
        ..NewApiKey::default()
    }
}

/// A team named `name` holding `credits`.
async fn funded(store: &dyn Store, name: &str, credits: i64) -> i64 {
    let team = store.create_team(name).await.unwrap();
    store.add_credits(team.id, credits, "start").await.unwrap();
    team.id
}

async fn balance(store: &dyn Store, team_id: i64) -> i64 {
    store
        .team(team_id)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits
}

/// A wall clock stuck at one instant, to check the timestamps the store writes itself.
#[derive(Debug)]
struct FixedClock(DateTime<Utc>);

impl Clock for FixedClock {
    fn now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
    fn wall(&self) -> DateTime<Utc> {
        self.0
    }
}

// ---------------------------------------------------------------------------------------
// Backend-specific and backend-free checks.

#[tokio::test]
async fn sqlite_file_database_runs_in_wal_mode() {
    let db = Db::new(Backend::Sqlite, "wal").await;
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(db.raw().await.sqlite())
        .await
        .unwrap();
    assert_eq!(mode, "wal");
}

#[tokio::test]
async fn a_bad_url_is_invalid() {
    assert!(matches!(
        SqliteStore::connect("postgres://nope").await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        PostgresStore::connect("sqlite::memory:").await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        PostgresStore::connect("postgres://h:notaport/db").await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        connect_store("mysql://localhost/db").await,
        Err(StoreError::Invalid(_))
    ));
}

#[tokio::test]
async fn connect_store_picks_the_backend_by_scheme() {
    let sqlite = connect_store("sqlite::memory:").await.unwrap();
    sqlite.migrate().await.unwrap();
    assert!(format!("{sqlite:?}").starts_with("SqliteStore"));
    // `postgresql://` is PostgreSQL's other spelling.
    let db = Db::new(Backend::Postgres, "scheme").await;
    let url = db.url().replacen("postgres://", "postgresql://", 1);
    let postgres = connect_store(&url).await.unwrap();
    postgres.ping().await.unwrap();
    assert!(format!("{postgres:?}").starts_with("PostgresStore"));
}

#[tokio::test]
async fn an_unreachable_postgres_is_unavailable() {
    // Nothing listens on port 1; the pool retries refused connections until its 5 s
    // acquire timeout, then reports the store unavailable.
    let started = std::time::Instant::now();
    assert!(matches!(
        PostgresStore::connect("postgres://postgres@127.0.0.1:1/postgres").await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[tokio::test]
async fn ledger_conformance_in_memory_reference() {
    conformance::ledger_conformance_suite(&MemoryLedger::default(), 1, "c:")
        .await
        .unwrap();
    conformance::bounded_billing_suite(&MemoryLedger::default(), 1, "bb:")
        .await
        .unwrap();
}

#[tokio::test]
async fn ledger_conformance_sqlite_in_memory() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let team = funded(&store, "conformance", conformance::SUITE_BALANCE).await;
    conformance::ledger_conformance_suite(&store, team, "c:")
        .await
        .unwrap();
    conformance::balance_conformance_suite(&store, "b:")
        .await
        .unwrap();
    conformance::bounded_billing_suite(&store, team, "bb:")
        .await
        .unwrap();
    conformance::drift_conformance_suite(&store, "d:")
        .await
        .unwrap();
}

/// The reference the SQL stores are held to passes its own contract.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_conformance_in_memory_reference() {
    let store = Arc::new(MemoryGenerations::default());
    generations_conformance::generations_conformance_suite(store.clone(), "first:")
        .await
        .unwrap();
    generations_conformance::generations_conformance_suite(store, "second:")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_conformance_sqlite_in_memory() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    generations_conformance::generations_conformance_suite(Arc::new(store), "g:")
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------------------
// Bodies run on both backends.

async fn reopening_finds_the_data_and_migrating_again_changes_nothing(db: &Db) {
    let store = db.store();
    store.migrate().await.unwrap();
    store.ping().await.unwrap();
    let team = store.create_team("persisted").await.unwrap();
    drop(store);

    let reopened = db.reopen().await;
    assert_eq!(
        reopened.team_by_name("persisted").await.unwrap(),
        Some(team)
    );
}

async fn a_closed_store_is_unavailable_and_fails_closed(db: &Db) {
    let concrete = db.concrete().await;
    let store = concrete.store();
    let team = funded(store.as_ref(), "t", 1_000).await;
    store.reserve(&reservation("open", team)).await.unwrap();
    concrete.close().await;
    assert!(matches!(
        store.ping().await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.team(team).await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.reserve(&reservation("r", team)).await,
        Err(LedgerError::Unavailable(_))
    ));
    assert!(matches!(
        store.settle(&settlement("open", 1, 1)).await,
        Err(LedgerError::Unavailable(_))
    ));
    assert!(matches!(
        store.cancel("open").await,
        Err(LedgerError::Unavailable(_))
    ));
    // Nothing happened to the row.
    let row = db.store().ledger_row("open").await.unwrap().unwrap();
    assert_eq!(row.status, LedgerStatus::Reserved);
}

async fn teams_round_trip(store: Arc<dyn Store>) {
    let a = store.create_team("alpha").await.unwrap();
    let b = store.create_team("beta").await.unwrap();
    assert_eq!(a.name, "alpha");
    assert_eq!(a.balance_microcredits, 0);
    assert!(b.id > a.id);

    assert!(matches!(
        store.create_team("alpha").await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store.create_team("  ").await,
        Err(StoreError::Invalid(_))
    ));

    assert_eq!(store.team(a.id).await.unwrap(), Some(a.clone()));
    assert_eq!(store.team(999).await.unwrap(), None);
    assert_eq!(store.team_by_name("beta").await.unwrap(), Some(b.clone()));
    assert_eq!(store.team_by_name("gamma").await.unwrap(), None);
    assert_eq!(store.teams().await.unwrap(), vec![a, b]);
}

async fn credits_append_entries_and_move_the_balance(db: &Db) {
    let store = db.store();
    let team = store.create_team("payers").await.unwrap();

    assert_eq!(
        store
            .add_credits(team.id, 5_000_000, "welcome")
            .await
            .unwrap(),
        5_000_000
    );
    assert_eq!(
        store
            .add_credits(team.id, -1_000_000, "correction")
            .await
            .unwrap(),
        4_000_000
    );
    assert_eq!(
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits,
        4_000_000
    );

    assert_eq!(
        store.add_credits(999, 1, "nobody").await,
        Err(StoreError::NotFound)
    );
    assert!(matches!(
        store.add_credits(team.id, 0, "nothing").await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.add_credits(team.id, i64::MAX, "overflow").await,
        Err(StoreError::Invalid(_))
    ));
    // Refused credits left no entry and no balance change behind.
    let entries = db.raw().await.credit_entries(team.id).await;
    assert_eq!(
        entries,
        vec![
            (5_000_000, "welcome".to_owned()),
            (-1_000_000, "correction".to_owned())
        ]
    );
    assert_eq!(
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits,
        4_000_000
    );
}

async fn api_keys_round_trip_by_hash_and_revoke(store: Arc<dyn Store>) {
    let team = store.create_team("keys").await.unwrap();
    let other = store.create_team("others").await.unwrap();
    // Both backends keep instants to the millisecond.
    let expires = Utc.with_ymd_and_hms(2030, 1, 2, 3, 4, 5).unwrap()
        + chrono::TimeDelta::nanoseconds(123_456_789);
    let expires_ms =
        Utc.with_ymd_and_hms(2030, 1, 2, 3, 4, 5).unwrap() + chrono::TimeDelta::milliseconds(123);

    let secret = new_secret(API_KEY_PREFIX).unwrap();
    let full = store
        .create_api_key(NewApiKey {
            model_allowlist: Some(vec!["small".to_owned(), "medium".to_owned()]),
            rpm: Some(60),
            tokens_per_day: Some(1_000_000),
            max_streams: Some(4),
            expires_at: Some(expires),
            message_quota: Some(40),
            burst_capacity: Some(20),
            burst_refill_seconds: Some(3),
            ..new_key(team.id, &secret)
        })
        .await
        .unwrap();
    assert_eq!(full.team_id, team.id);
    assert_eq!(full.prefix, display_prefix(&secret));
    assert!(full.prefix.starts_with("sk-sy-"));
    assert_eq!(
        full.model_allowlist,
        Some(vec!["small".to_owned(), "medium".to_owned()])
    );
    assert_eq!(full.rpm, Some(60));
    assert_eq!(full.tokens_per_day, Some(1_000_000));
    assert_eq!(full.max_streams, Some(4));
    assert_eq!(full.expires_at, Some(expires_ms));
    assert_eq!(full.message_quota, Some(40));
    assert_eq!(full.burst_capacity, Some(20));
    assert_eq!(full.burst_refill_seconds, Some(3));
    assert_eq!(full.revoked_at, None);

    // No allowlist means every model; an empty one means none.
    let open_secret = new_secret(API_KEY_PREFIX).unwrap();
    let open = store
        .create_api_key(new_key(team.id, &open_secret))
        .await
        .unwrap();
    assert_eq!(open.model_allowlist, None);
    assert_eq!(open.rpm, None);
    let closed = store
        .create_api_key(NewApiKey {
            model_allowlist: Some(vec![]),
            ..new_key(other.id, "sk-sy-another")
        })
        .await
        .unwrap();
    assert_eq!(closed.model_allowlist, Some(vec![]));

    assert_eq!(
        store.api_key_by_hash(&hash_secret(&secret)).await.unwrap(),
        Some(full.clone())
    );
    assert_eq!(
        store
            .api_key_by_hash(&hash_secret("sk-sy-unknown"))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store.api_keys(team.id).await.unwrap(),
        vec![full.clone(), open.clone()]
    );
    // Limits at the top of their types survive the round trip.
    let top = store
        .create_api_key(NewApiKey {
            rpm: Some(u32::MAX),
            tokens_per_day: Some(u64::try_from(i64::MAX).unwrap()),
            max_streams: Some(u32::MAX),
            message_quota: Some(u32::MAX),
            burst_capacity: Some(u32::MAX),
            burst_refill_seconds: Some(u32::MAX),
            ..new_key(other.id, "sk-sy-top")
        })
        .await
        .unwrap();
    assert_eq!(
        (top.rpm, top.tokens_per_day, top.burst_refill_seconds),
        (Some(u32::MAX), Some(i64::MAX as u64), Some(u32::MAX))
    );
    assert_eq!(store.api_keys(other.id).await.unwrap(), vec![closed, top]);

    assert!(matches!(
        store.create_api_key(new_key(team.id, &secret)).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        store.create_api_key(new_key(999, "sk-sy-orphan")).await,
        Err(StoreError::NotFound)
    );
    assert!(matches!(
        store
            .create_api_key(NewApiKey {
                tokens_per_day: Some(u64::MAX),
                ..new_key(team.id, "sk-sy-huge")
            })
            .await,
        Err(StoreError::Invalid(_))
    ));

    use switchyard::store::KeyRevocation;
    assert_eq!(
        store.revoke_api_key(full.id).await.unwrap(),
        KeyRevocation::Revoked
    );
    assert_eq!(
        store.revoke_api_key(full.id).await.unwrap(),
        KeyRevocation::AlreadyRevoked
    );
    assert_eq!(
        store.revoke_api_key(999).await.unwrap(),
        KeyRevocation::Unknown
    );
    let revoked = store
        .api_key_by_hash(&hash_secret(&secret))
        .await
        .unwrap()
        .unwrap();
    assert!(revoked.revoked_at.is_some());
    assert!(!revoked.is_usable(Utc::now()));
    let still_open = store
        .api_key_by_hash(&hash_secret(&open_secret))
        .await
        .unwrap()
        .unwrap();
    assert!(still_open.is_usable(Utc::now()));
}

async fn nodes_register_drain_revoke_and_reissue(store: Arc<dyn Store>) {
    let token = new_secret(NODE_TOKEN_PREFIX).unwrap();
    let node = store
        .create_node("gpu-b", "onprem", &hash_secret(&token))
        .await
        .unwrap();
    assert_eq!(node.id, "gpu-b");
    assert_eq!(node.location, "onprem");
    assert_eq!(node.token_hash, Some(hash_secret(&token)));
    assert_eq!(node.gpus, serde_json::json!([]));
    assert!(node.models.is_empty());
    assert_eq!(node.last_seen, None);
    assert_eq!(node.orchestrator_id, None);
    assert_eq!(node.drained_at, None);
    let first = store.create_node("gpu-a", "cloud", "h-a").await.unwrap();

    assert!(matches!(
        store.create_node("gpu-b", "onprem", "h-other").await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(
        store.create_node("gpu-c", "mars", "h-c").await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.create_node("gpu-c", "cloud", "h-a").await,
        Err(StoreError::Conflict(_))
    ));

    let at = Utc.with_ymd_and_hms(2026, 11, 6, 18, 0, 0).unwrap();
    // Keys out of alphabetical order: the document comes back as the agent sent it.
    let gpus = serde_json::json!([{"name": "L40S", "index": 0, "memory_mib": 46068}]);
    let models = vec!["llama-3.1-8b-instruct".to_owned()];
    store
        .record_node_registration("gpu-b", gpus.clone(), &models, "replica-1", at)
        .await
        .unwrap();
    store.mark_node_drained("gpu-b", at).await.unwrap();
    let registered = store.node("gpu-b").await.unwrap().unwrap();
    assert_eq!(registered.gpus, gpus);
    assert_eq!(registered.gpus.to_string(), gpus.to_string());
    assert_eq!(registered.models, models);
    assert_eq!(registered.orchestrator_id.as_deref(), Some("replica-1"));
    assert_eq!(registered.last_seen, Some(at));
    assert_eq!(registered.drained_at, Some(at));
    assert_eq!(registered.created_at, node.created_at);

    assert_eq!(
        store
            .record_node_registration("ghost", gpus, &models, "replica-1", at)
            .await,
        Err(StoreError::NotFound)
    );
    assert_eq!(
        store.mark_node_drained("ghost", at).await,
        Err(StoreError::NotFound)
    );
    assert_eq!(store.node("ghost").await.unwrap(), None);

    assert!(store.revoke_node_token("gpu-b").await.unwrap());
    assert!(!store.revoke_node_token("gpu-b").await.unwrap());
    assert!(!store.revoke_node_token("ghost").await.unwrap());
    assert_eq!(store.node("gpu-b").await.unwrap().unwrap().token_hash, None);

    // A revoked node gets a new token; its registration history stays.
    let reissued = store
        .create_node("gpu-b", "cloud", &hash_secret("nt-new"))
        .await
        .unwrap();
    assert_eq!(reissued.token_hash, Some(hash_secret("nt-new")));
    assert_eq!(reissued.location, "cloud");
    assert_eq!(reissued.models, models);
    assert_eq!(reissued.created_at, node.created_at);

    // Ids sort by byte, as SQLite compares text: upper case before lower case.
    store
        .create_node("gpu-B", "cloud", "h-upper")
        .await
        .unwrap();
    let ids: Vec<String> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(ids, vec!["gpu-B".to_owned(), first.id, "gpu-b".to_owned()]);
}

async fn store_timestamps_come_from_the_injected_clock(db: &Db) {
    // The clock reads to the nanosecond; both backends keep the millisecond.
    let exact = Utc.with_ymd_and_hms(2026, 11, 6, 12, 30, 0).unwrap()
        + chrono::TimeDelta::nanoseconds(987_654_321);
    let at = Utc.with_ymd_and_hms(2026, 11, 6, 12, 30, 0).unwrap()
        + chrono::TimeDelta::milliseconds(987);
    let store = db
        .concrete()
        .await
        .with_clock(Arc::new(FixedClock(exact)))
        .store();
    let team = store.create_team("clocked").await.unwrap();
    store.add_credits(team.id, 1_000, "start").await.unwrap();
    let key = store
        .create_api_key(new_key(team.id, "sk-sy-clocked"))
        .await
        .unwrap();
    assert_eq!(key.created_at, at);
    store.revoke_api_key(key.id).await.unwrap();
    assert_eq!(
        store.api_keys(team.id).await.unwrap()[0].revoked_at,
        Some(at)
    );
    store
        .reserve(&reservation("clocked", team.id))
        .await
        .unwrap();
    store.settle(&settlement("clocked", 1, 1)).await.unwrap();
    let row = store.ledger_row("clocked").await.unwrap().unwrap();
    assert_eq!((row.created_at, row.settled_at), (at, Some(at)));
    assert_eq!(store.node("x").await.unwrap(), None);
    assert_eq!(
        store
            .create_node("x", "cloud", "h")
            .await
            .unwrap()
            .created_at,
        at
    );
}
