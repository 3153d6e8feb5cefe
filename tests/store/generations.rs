//! The generation store on both backends: every check of
//! `switchyard::store::generations_conformance` as its own test (the in-memory reference
//! runs the same suite in `store.rs`), then what only a database has: the schema's rules,
//! a reopen, a closed pool, and the store serving as `dyn GenerationStore`.

use switchyard::store::GenerationStore;
use switchyard::store::generations_conformance as gc;
use switchyard_actors::lifecycle::{
    Decision, Event, LifecycleError, MessagePolicy, NewGeneration, Status, WindowCounters,
};

use super::*;

/// Each check of the suite as a body for `on_both!`, on its own fresh database: `ref`
/// checks take `&dyn GenerationStore`, `arc` checks spawn tasks and take the `Arc`.
macro_rules! conformance_checks {
    (ref: $($check:ident),+; arc: $($racing:ident),+ $(,)?) => {
        $(
            async fn $check(store: Arc<dyn Store>) {
                let generations: Arc<dyn GenerationStore> = store;
                gc::$check(generations.as_ref(), "g:").await.unwrap();
            }
        )+
        $(
            async fn $racing(store: Arc<dyn Store>) {
                gc::$racing(store, "g:").await.unwrap();
            }
        )+
        on_both!(store: $($check),+, $($racing),+);
    };
}

conformance_checks!(
    ref:
        same_key_same_fingerprint_is_existing,
        different_fingerprint_conflicts,
        rejected_generation_readmits,
        concurrency_limit,
        burst_bucket,
        window_limit,
        fixed_window_boundary,
        reservation_stays_in_its_window,
        terminal_records_never_change,
        outputs_keep_every_character,
        unknown_generations,
        sweep_expires_and_forgets;
    arc:
        concurrent_admissions_stop_at_the_limit,
        concurrent_replays_admit_once,
        concurrent_fingerprints_conflict,
        concurrent_events_apply_once,
);

on_both!(store:
    the_whole_suite_twice_on_one_database,
    the_store_serves_as_dyn_generation_store,
    generation_names_with_nul_are_absent,
);
on_both!(db:
    generations_survive_a_reopen,
    a_closed_generation_store_is_unavailable,
    the_generation_schema_holds_its_rules,
);

fn new_generation(id: &str, subject: &str, key: &str) -> NewGeneration {
    NewGeneration {
        id: id.to_owned(),
        subject: subject.to_owned(),
        idempotency_key: key.to_owned(),
        fingerprint: "fp".to_owned(),
        model: "m".to_owned(),
    }
}

async fn admit(store: &dyn GenerationStore, new: &NewGeneration) -> Decision {
    store
        .admit_generation(new, &MessagePolicy::default(), gc::T0)
        .await
        .unwrap()
}

/// Prefixes keep two runs apart (run one after the other: the sweeper is global).
async fn the_whole_suite_twice_on_one_database(store: Arc<dyn Store>) {
    gc::generations_conformance_suite(store.clone(), "first:")
        .await
        .unwrap();
    gc::generations_conformance_suite(store, "second:")
        .await
        .unwrap();
}

async fn the_store_serves_as_dyn_generation_store(store: Arc<dyn Store>) {
    let generations: Arc<dyn GenerationStore> = store.clone();
    let new = new_generation("gen-dyn", "alice", "k");
    let Decision::Admitted(rec) = admit(generations.as_ref(), &new).await else {
        panic!("not admitted");
    };
    assert_eq!(store.get_generation("gen-dyn").await.unwrap(), Some(rec));
    // The same database serves the ledger through the same handle.
    let team = funded(store.as_ref(), "dyn", 1).await;
    store.reserve(&reservation("gen-dyn", team)).await.unwrap();
}

async fn generation_names_with_nul_are_absent(store: Arc<dyn Store>) {
    assert_eq!(store.get_generation("a\0b").await.unwrap(), None);
    assert_eq!(store.find_generation("a\0b", "k").await.unwrap(), None);
    assert_eq!(store.find_generation("s", "a\0b").await.unwrap(), None);
    assert_eq!(
        store
            .apply_generation("a\0b", &Event::RequestCancel, 0)
            .await,
        Err(LifecycleError::Unknown)
    );
    assert_eq!(
        store.message_window("a\0b", 0).await.unwrap(),
        WindowCounters::default()
    );
}

async fn generations_survive_a_reopen(db: &Db) {
    let store = db.store();
    let new = new_generation("gen-kept", "alice", "k");
    let Decision::Admitted(rec) = admit(store.as_ref(), &new).await else {
        panic!("not admitted");
    };
    drop(store);
    let reopened = db.reopen().await;
    assert_eq!(
        reopened.find_generation("alice", "k").await.unwrap(),
        Some(rec.clone())
    );
    assert_eq!(
        admit(reopened.as_ref(), &new).await,
        Decision::Existing(rec)
    );
    assert_eq!(
        reopened.message_window("alice", gc::T0).await.unwrap(),
        WindowCounters {
            used: 0,
            reserved: 1
        }
    );
}

async fn a_closed_generation_store_is_unavailable(db: &Db) {
    let concrete = db.concrete().await;
    let store = concrete.store();
    let Decision::Admitted(rec) = admit(store.as_ref(), &new_generation("gen-c", "bob", "k")).await
    else {
        panic!("not admitted");
    };
    concrete.close().await;
    let unavailable =
        |r: Result<_, LifecycleError>| matches!(r, Err(LifecycleError::Unavailable(_)));
    assert!(unavailable(
        store
            .admit_generation(
                &new_generation("gen-d", "bob", "k2"),
                &MessagePolicy::default(),
                gc::T0
            )
            .await
            .map(|_| ())
    ));
    assert!(unavailable(
        store
            .apply_generation(&rec.id, &Event::RequestCancel, gc::T0)
            .await
            .map(|_| ())
    ));
    assert!(unavailable(store.get_generation(&rec.id).await.map(|_| ())));
    assert!(unavailable(
        store.find_generation("bob", "k").await.map(|_| ())
    ));
    assert!(unavailable(
        store.sweep_generations(gc::T0, 0).await.map(|_| ())
    ));
    assert!(unavailable(
        store.message_window("bob", gc::T0).await.map(|_| ())
    ));
    // Nothing happened to the record.
    let kept = db.store().get_generation(&rec.id).await.unwrap().unwrap();
    assert_eq!(
        (kept.status, kept.cancel_requested),
        (Status::Queued, false)
    );
}

async fn the_generation_schema_holds_its_rules(db: &Db) {
    let store = db.store();
    admit(store.as_ref(), &new_generation("gen-s", "carol", "k")).await;
    let raw = db.raw().await;
    let refused = [
        "UPDATE message_windows SET reserved = -1",
        "UPDATE message_windows SET used = -1",
        "UPDATE generations SET status = 'open'",
        "UPDATE generations SET attempt_state = 'lost'",
        "UPDATE generations SET message = 'kept'",
        "UPDATE generations SET output_tokens = -1",
        "UPDATE generation_principals SET bucket_at_ms = NULL",
    ];
    for sql in refused {
        let err = execute(&raw, sql).await.unwrap_err();
        assert!(
            matches!(&err, sqlx::Error::Database(d) if d.is_check_violation()),
            "{sql}: {err}"
        );
    }
    // One generation per (subject, key).
    const DUPLICATE: &str = "INSERT INTO generations SELECT 'gen-t', subject, idempotency_key, \
         fingerprint, model, status, cancel_requested, attempt, attempt_state, message, \
         window_start_ms, slot_held, slot_expires_ms, input_tokens, output_tokens, output, \
         error_code, created_ms, terminal_ms, ledger_id, finish_reason, output_extra \
         FROM generations \
         WHERE id = 'gen-s'";
    let err = execute(&raw, DUPLICATE).await.unwrap_err();
    assert!(
        matches!(&err, sqlx::Error::Database(d) if d.is_unique_violation()),
        "{err}"
    );
}

/// Runs `sql` on either backend; the rows it changed.
async fn execute(raw: &harness::Raw, sql: &'static str) -> Result<u64, sqlx::Error> {
    match raw {
        harness::Raw::Sqlite(pool) => sqlx::query(sql)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()),
        harness::Raw::Postgres(pool) => sqlx::query(sql)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()),
    }
}
