//! Integration tests of the SQLite store: configuration round trips, the ledger's
//! exactly-once transitions under concurrency, and `balance = credits - settled cost` after a
//! seeded random mix. Real SQLite files live in a fresh directory under the temp dir.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use chrono::{DateTime, TimeZone, Utc};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sqlx::SqlitePool;

use switchyard::store::conformance::{self, reservation, settlement};
use switchyard::store::{
    API_KEY_PREFIX, Ledger, LedgerError, LedgerStatus, NODE_TOKEN_PREFIX, NewApiKey, SettleOutcome,
    SqliteStore, Store, StoreError, cost_of, display_prefix, hash_secret, new_secret,
};
use switchyard_actors::ports::Clock;
use switchyard_actors::ports::memory::MemoryLedger;

/// A database file in its own fresh directory, removed with it.
struct TempDb {
    dir: PathBuf,
}

impl TempDb {
    fn new(name: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "switchyard-store-{}-{}-{name}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self { dir }
    }

    /// The directory does not exist yet: `connect` creates it.
    fn url(&self) -> String {
        format!(
            "sqlite://{}?mode=rwc",
            self.dir.join("nested/switchyard.db").display()
        )
    }

    /// A second, independent pool on the same file, to check the tables with plain SQL.
    async fn raw(&self) -> SqlitePool {
        SqlitePool::connect(&self.url()).await.unwrap()
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn memory_store() -> SqliteStore {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    store
}

async fn file_store(db: &TempDb) -> SqliteStore {
    let store = SqliteStore::connect(&db.url()).await.unwrap();
    store.migrate().await.unwrap();
    store
}

fn new_key(team_id: i64, secret: &str) -> NewApiKey {
    NewApiKey {
        team_id,
        hash: hash_secret(secret),
        prefix: display_prefix(secret),
        ..NewApiKey::default()
    }
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

#[tokio::test]
async fn file_database_persists_in_wal_mode_and_migrates_idempotently() {
    let db = TempDb::new("persist");
    let store = file_store(&db).await;
    store.migrate().await.unwrap();
    store.ping().await.unwrap();
    let team = store.create_team("persisted").await.unwrap();
    store.close().await;

    let reopened = file_store(&db).await;
    assert_eq!(
        reopened.team_by_name("persisted").await.unwrap(),
        Some(team)
    );
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&db.raw().await)
        .await
        .unwrap();
    assert_eq!(mode, "wal");
}

#[tokio::test]
async fn a_closed_store_is_unavailable_and_fails_closed() {
    let store = memory_store().await;
    let team = store.create_team("t").await.unwrap();
    store.close().await;
    assert!(matches!(
        store.ping().await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.reserve(&reservation("r", team.id)).await,
        Err(LedgerError::Unavailable(_))
    ));
    assert!(matches!(
        store.settle(&settlement("r", 1, 1)).await,
        Err(LedgerError::Unavailable(_))
    ));
}

#[tokio::test]
async fn a_bad_url_is_invalid() {
    assert!(matches!(
        SqliteStore::connect("postgres://nope").await,
        Err(StoreError::Invalid(_))
    ));
}

#[tokio::test]
async fn teams_round_trip() {
    let store = memory_store().await;
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

#[tokio::test]
async fn credits_append_entries_and_move_the_balance() {
    let db = TempDb::new("credits");
    let store = file_store(&db).await;
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
    let entries: Vec<(i64, String)> = sqlx::query_as(
        "SELECT amount_microcredits, note FROM credit_entries WHERE team_id = ? ORDER BY id",
    )
    .bind(team.id)
    .fetch_all(&db.raw().await)
    .await
    .unwrap();
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

#[tokio::test]
async fn api_keys_round_trip_by_hash_and_revoke() {
    let store = memory_store().await;
    let team = store.create_team("keys").await.unwrap();
    let other = store.create_team("others").await.unwrap();
    let expires = Utc.with_ymd_and_hms(2030, 1, 2, 3, 4, 5).unwrap();

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
    assert_eq!(full.expires_at, Some(expires));
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
    assert_eq!(store.api_keys(other.id).await.unwrap(), vec![closed]);

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

    assert!(store.revoke_api_key(full.id).await.unwrap());
    assert!(!store.revoke_api_key(full.id).await.unwrap());
    assert!(!store.revoke_api_key(999).await.unwrap());
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

#[tokio::test]
async fn nodes_register_drain_revoke_and_reissue() {
    let store = memory_store().await;
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
    let gpus = serde_json::json!([{"index": 0, "name": "L40S", "memory_mib": 46068}]);
    let models = vec!["llama-3.1-8b-instruct".to_owned()];
    store
        .record_node_registration("gpu-b", gpus.clone(), &models, "replica-1", at)
        .await
        .unwrap();
    store.mark_node_drained("gpu-b", at).await.unwrap();
    let registered = store.node("gpu-b").await.unwrap().unwrap();
    assert_eq!(registered.gpus, gpus);
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

    let ids: Vec<String> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| n.id)
        .collect();
    assert_eq!(ids, vec![first.id, "gpu-b".to_owned()]);
}

#[tokio::test]
async fn ledger_prices_settles_from_the_row_and_debits_once() {
    let store = memory_store().await;
    let team = store.create_team("ledger").await.unwrap();
    let key = store
        .create_api_key(new_key(team.id, "sk-sy-ledger"))
        .await
        .unwrap();
    store
        .add_credits(team.id, 10_000_000, "start")
        .await
        .unwrap();

    let mut r = reservation("req-1", team.id);
    r.key_id = Some(key.id);
    r.estimated_cost = 4_321;
    r.price_input_per_mtok = 150_000;
    r.price_output_per_mtok = 600_000;
    store.reserve(&r).await.unwrap();
    store.reserve(&reservation("req-2", team.id)).await.unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 2);

    let open = store.ledger_row("req-1").await.unwrap().unwrap();
    assert_eq!(open.status, LedgerStatus::Reserved);
    assert_eq!(open.key_id, Some(key.id));
    assert_eq!(open.model, r.model);
    assert_eq!(open.estimated_cost_microcredits, 4_321);
    assert_eq!(open.price_input_per_mtok, 150_000);
    assert_eq!(open.price_output_per_mtok, 600_000);
    assert_eq!(
        (
            open.prompt_tokens,
            open.completion_tokens,
            open.cost_microcredits
        ),
        (0, 0, 0)
    );
    assert_eq!(open.settled_at, None);

    assert_eq!(
        store
            .settle(&settlement("req-1", 1_234, 567))
            .await
            .unwrap(),
        SettleOutcome::Applied
    );
    let cost = cost_of(1_234, 567, 150_000, 600_000);
    assert_eq!(cost, 526, "185.1 + 340.2 microcredits, rounded up");
    let settled = store.ledger_row("req-1").await.unwrap().unwrap();
    assert_eq!(settled.status, LedgerStatus::Settled);
    assert_eq!(
        (settled.prompt_tokens, settled.completion_tokens),
        (1_234, 567)
    );
    assert_eq!(settled.cost_microcredits, cost);
    assert!(settled.settled_at.is_some());
    let balance = || async {
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits
    };
    assert_eq!(balance().await, 10_000_000 - cost);

    // Retries and late cancels change nothing.
    assert_eq!(
        store
            .settle(&settlement("req-1", 9_999, 9_999))
            .await
            .unwrap(),
        SettleOutcome::AlreadyFinal
    );
    assert_eq!(
        store.cancel("req-1").await.unwrap(),
        SettleOutcome::AlreadyFinal
    );
    assert_eq!(store.ledger_row("req-1").await.unwrap(), Some(settled));
    assert_eq!(balance().await, 10_000_000 - cost);
    assert_eq!(store.open_reservations().await.unwrap(), 1);

    // A cancel debits nothing, and a settle after it is refused.
    assert_eq!(store.cancel("req-2").await.unwrap(), SettleOutcome::Applied);
    assert_eq!(
        store.settle(&settlement("req-2", 10, 10)).await.unwrap(),
        SettleOutcome::AlreadyFinal
    );
    let cancelled = store.ledger_row("req-2").await.unwrap().unwrap();
    assert_eq!(cancelled.status, LedgerStatus::Cancelled);
    assert_eq!(cancelled.cost_microcredits, 0);
    assert!(cancelled.settled_at.is_some());
    assert_eq!(balance().await, 10_000_000 - cost);
    assert_eq!(store.open_reservations().await.unwrap(), 0);

    assert_eq!(
        store.settle(&settlement("nope", 1, 1)).await.unwrap(),
        SettleOutcome::Unknown
    );
    assert_eq!(store.cancel("nope").await.unwrap(), SettleOutcome::Unknown);
    assert_eq!(store.ledger_row("nope").await.unwrap(), None);
    assert_eq!(
        store.reserve(&reservation("req-1", team.id)).await,
        Err(LedgerError::Duplicate)
    );

    let other = store.create_team("other").await.unwrap();
    store
        .reserve(&reservation("req-3", other.id))
        .await
        .unwrap();
    let ids = |rows: Vec<switchyard::store::LedgerRow>| {
        rows.into_iter().map(|r| r.request_id).collect::<Vec<_>>()
    };
    assert_eq!(
        ids(store.ledger_rows(Some(team.id)).await.unwrap()),
        ["req-1", "req-2"]
    );
    assert_eq!(
        ids(store.ledger_rows(None).await.unwrap()),
        ["req-1", "req-2", "req-3"]
    );
    assert_eq!(store.open_reservations().await.unwrap(), 1);
}

#[tokio::test]
async fn a_reservation_for_an_unknown_team_fails_closed() {
    let store = memory_store().await;
    assert!(matches!(
        store.reserve(&reservation("orphan", 999)).await,
        Err(LedgerError::Unavailable(_))
    ));
    assert_eq!(store.ledger_row("orphan").await.unwrap(), None);
}

#[tokio::test]
async fn store_timestamps_come_from_the_injected_clock() {
    let at = Utc.with_ymd_and_hms(2026, 11, 6, 12, 30, 0).unwrap();
    let store = memory_store().await.with_clock(Arc::new(FixedClock(at)));
    let team = store.create_team("clocked").await.unwrap();
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

#[tokio::test]
async fn the_store_is_usable_as_dyn_store_and_dyn_ledger() {
    let store: Arc<dyn Store> = Arc::new(memory_store().await);
    let team = store.create_team("dyn").await.unwrap();
    let ledger: Arc<dyn Ledger> = store.clone();
    ledger.reserve(&reservation("dyn", team.id)).await.unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 1);
}

#[tokio::test]
async fn ledger_conformance_in_memory_reference() {
    conformance::ledger_conformance_suite(&MemoryLedger::default(), 1, "c:")
        .await
        .unwrap();
}

#[tokio::test]
async fn ledger_conformance_sqlite_in_memory() {
    let store = memory_store().await;
    let team = store.create_team("conformance").await.unwrap();
    conformance::ledger_conformance_suite(&store, team.id, "c:")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_conformance_sqlite_file() {
    let db = TempDb::new("conformance");
    let store = file_store(&db).await;
    let team = store.create_team("conformance").await.unwrap();
    conformance::ledger_conformance_suite(&store, team.id, "c:")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_settles_of_one_row_debit_once() {
    let db = TempDb::new("race");
    let store = Arc::new(file_store(&db).await);
    let team = store.create_team("racers").await.unwrap();
    store
        .add_credits(team.id, 1_000_000, "start")
        .await
        .unwrap();
    let mut r = reservation("contended", team.id);
    r.price_input_per_mtok = 1_000_000;
    r.price_output_per_mtok = 1_000_000;
    store.reserve(&r).await.unwrap();

    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.settle(&settlement("contended", 100, 200)).await })
        })
        .collect();
    let mut outcomes = BTreeMap::new();
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        *outcomes.entry(format!("{outcome:?}")).or_insert(0) += 1;
    }
    assert_eq!(
        outcomes,
        BTreeMap::from([("AlreadyFinal".to_owned(), 49), ("Applied".to_owned(), 1)])
    );
    assert_eq!(
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits,
        1_000_000 - 300
    );
    assert_eq!(store.open_reservations().await.unwrap(), 0);
}

/// What the test expects of one row after its actions.
#[derive(Debug, Clone, Copy)]
enum Plan {
    Settle,
    Cancel,
    SettleTwice,
    CancelThenSettle,
    SettleThenCancel,
    LeaveOpen,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_equals_credits_minus_settled_costs_after_a_random_mix() {
    const REQUESTS: usize = 500;
    let db = TempDb::new("mix");
    let store = Arc::new(file_store(&db).await);
    let mut rng = ChaCha8Rng::seed_from_u64(0x5717_c4ad);

    let mut teams = Vec::new();
    let mut credited: BTreeMap<i64, i64> = BTreeMap::new();
    for name in ["red", "green", "blue"] {
        let team = store.create_team(name).await.unwrap();
        store
            .add_credits(team.id, 50_000_000, "start")
            .await
            .unwrap();
        credited.insert(team.id, 50_000_000);
        teams.push(team.id);
    }

    // Reserve everything first, concurrently in batches.
    let mut rows = Vec::new();
    for i in 0..REQUESTS {
        let mut r = reservation(&format!("mix-{i}"), teams[rng.random_range(0..teams.len())]);
        r.price_input_per_mtok = rng.random_range(0..=5_000_000);
        r.price_output_per_mtok = rng.random_range(0..=20_000_000);
        r.estimated_cost = rng.random_range(0..=50_000);
        let plan = match rng.random_range(0..6) {
            0 => Plan::Settle,
            1 => Plan::Cancel,
            2 => Plan::SettleTwice,
            3 => Plan::CancelThenSettle,
            4 => Plan::SettleThenCancel,
            _ => Plan::LeaveOpen,
        };
        let usage = (rng.random_range(0..8_000), rng.random_range(0..2_000));
        rows.push((r, plan, usage));
    }
    for batch in rows.chunks(50) {
        let tasks: Vec<_> = batch
            .iter()
            .map(|(r, _, _)| {
                let (store, r) = (Arc::clone(&store), r.clone());
                tokio::spawn(async move { store.reserve(&r).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
    }
    assert_eq!(
        store.open_reservations().await.unwrap(),
        i64::try_from(REQUESTS).unwrap()
    );

    // Then finish them in a shuffled order, concurrently, with credits arriving meanwhile.
    let mut order: Vec<usize> = (0..REQUESTS).collect();
    order.shuffle(&mut rng);
    for batch in order.chunks(25) {
        let mut tasks = Vec::new();
        for &i in batch {
            let (r, plan, (p, c)) = rows[i].clone();
            let store = Arc::clone(&store);
            tasks.push(tokio::spawn(async move {
                let id = r.request_id.as_str();
                let s = settlement(id, p, c);
                let outcomes = match plan {
                    Plan::Settle => vec![store.settle(&s).await],
                    Plan::Cancel => vec![store.cancel(id).await],
                    Plan::SettleTwice => vec![
                        store.settle(&s).await,
                        store.settle(&settlement(id, p + 1, c + 1)).await,
                    ],
                    Plan::CancelThenSettle => vec![store.cancel(id).await, store.settle(&s).await],
                    Plan::SettleThenCancel => vec![store.settle(&s).await, store.cancel(id).await],
                    Plan::LeaveOpen => vec![],
                };
                outcomes.into_iter().map(|o| o.unwrap()).collect::<Vec<_>>()
            }));
        }
        if rng.random_bool(0.3) {
            let team = teams[rng.random_range(0..teams.len())];
            let amount = rng.random_range(1..1_000_000);
            store.add_credits(team, amount, "top-up").await.unwrap();
            *credited.get_mut(&team).unwrap() += amount;
        }
        for task in tasks {
            let outcomes = task.await.unwrap();
            if let Some((first, rest)) = outcomes.split_first() {
                assert_eq!(*first, SettleOutcome::Applied);
                assert!(rest.iter().all(|o| *o == SettleOutcome::AlreadyFinal));
            }
        }
    }

    // Every row ended as planned, priced from its own prices.
    let mut settled_cost: BTreeMap<i64, i64> = BTreeMap::new();
    let mut open = 0;
    for (r, plan, (p, c)) in &rows {
        let row = store.ledger_row(&r.request_id).await.unwrap().unwrap();
        let (status, cost) = match plan {
            Plan::Settle | Plan::SettleTwice | Plan::SettleThenCancel => (
                LedgerStatus::Settled,
                cost_of(*p, *c, r.price_input_per_mtok, r.price_output_per_mtok),
            ),
            Plan::Cancel | Plan::CancelThenSettle => (LedgerStatus::Cancelled, 0),
            Plan::LeaveOpen => (LedgerStatus::Reserved, 0),
        };
        assert_eq!(
            (row.status, row.cost_microcredits),
            (status, cost),
            "{row:?}"
        );
        *settled_cost.entry(r.team_id).or_insert(0) += cost;
        open += i64::from(status == LedgerStatus::Reserved);
    }
    assert_eq!(store.open_reservations().await.unwrap(), open);

    // balance = sum(credits) - sum(settled cost), by the test's own count and by the tables.
    let raw = db.raw().await;
    for team in &teams {
        let balance = store
            .team(*team)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits;
        let expected = credited[team] - settled_cost.get(team).copied().unwrap_or(0);
        assert_eq!(balance, expected, "team {team}");
        let from_tables: i64 = sqlx::query_scalar(
            "SELECT (SELECT COALESCE(SUM(amount_microcredits), 0) FROM credit_entries \
             WHERE team_id = ?1) - (SELECT COALESCE(SUM(cost_microcredits), 0) \
             FROM usage_ledger WHERE team_id = ?1 AND status = 'settled')",
        )
        .bind(team)
        .fetch_one(&raw)
        .await
        .unwrap();
        assert_eq!(balance, from_tables, "team {team}");
    }
}
