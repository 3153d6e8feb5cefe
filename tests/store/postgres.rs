//! PostgreSQL's locking, checked deterministically: a plain connection holds the lock the
//! store needs, the store's call is seen waiting on it (in `pg_stat_activity`), the holder
//! commits, and the store must act on what was committed — not on the snapshot it had
//! before the wait.

use std::time::Duration;

use sqlx::PgPool;

use super::*;

/// Waits until `n` sessions of this database wait on a lock.
async fn lock_waiters(pool: &PgPool, n: i64) {
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} sessions never waited on a lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_behind_a_committed_cancel_is_a_no_op() {
    let db = Db::new(Backend::Postgres, "behind_cancel").await;
    let store = db.store();
    let team = funded(store.as_ref(), "t", 1_000_000).await;
    store.reserve(&reservation("held", team)).await.unwrap();

    let raw = db.raw().await;
    let mut holder = raw.postgres().begin().await.unwrap();
    sqlx::query(
        "UPDATE usage_ledger SET status = 'cancelled', settled_at = now() \
         WHERE request_id = 'held'",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let settle = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.settle(&settlement("held", 100, 100)).await }
    });
    lock_waiters(raw.postgres(), 1).await;
    holder.commit().await.unwrap();

    assert_eq!(settle.await.unwrap(), Ok(SettleOutcome::AlreadyFinal));
    let row = store.ledger_row("held").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.cost_microcredits),
        (LedgerStatus::Cancelled, 0)
    );
    assert_eq!(balance(store.as_ref(), team).await, 1_000_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_settles_queued_on_one_row_the_second_is_a_no_op() {
    let db = Db::new(Backend::Postgres, "two_settles").await;
    let store = db.store();
    let team = funded(store.as_ref(), "t", 1_000_000).await;
    store.reserve(&reservation("held", team)).await.unwrap();

    let raw = db.raw().await;
    let mut holder = raw.postgres().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM usage_ledger WHERE request_id = 'held' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let settles: Vec<_> = (0..2)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.settle(&settlement("held", 100, 100)).await })
        })
        .collect();
    lock_waiters(raw.postgres(), 2).await;
    holder.commit().await.unwrap();

    let mut outcomes = Vec::new();
    for settle in settles {
        outcomes.push(settle.await.unwrap().unwrap());
    }
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        [SettleOutcome::AlreadyFinal, SettleOutcome::Applied]
    );
    // 100 prompt tokens at 1 and 100 completion tokens at 2 microcredits each, once.
    assert_eq!(balance(store.as_ref(), team).await, 1_000_000 - 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_behind_the_team_lock_counts_what_the_holder_reserved() {
    let db = Db::new(Backend::Postgres, "behind_team").await;
    let store = db.store();
    let team = funded(store.as_ref(), "t", 1_000).await;

    // Another replica's reservation, mid-transaction: it holds the team row and has
    // inserted a row that takes the whole balance.
    let raw = db.raw().await;
    let mut holder = raw.postgres().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM teams WHERE id = $1 FOR UPDATE")
        .bind(team)
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO usage_ledger (request_id, team_id, model, estimated_cost_microcredits, \
         price_input_per_mtok, price_output_per_mtok, created_at) \
         VALUES ('first', $1, 'm', 1000, 0, 0, now())",
    )
    .bind(team)
    .execute(&mut *holder)
    .await
    .unwrap();
    let reserve = tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            let r = Reservation {
                estimated_cost: 1_000,
                ..reservation("second", team)
            };
            store.reserve(&r).await
        }
    });
    lock_waiters(raw.postgres(), 1).await;
    holder.commit().await.unwrap();

    assert_eq!(
        reserve.await.unwrap(),
        Err(LedgerError::InsufficientBalance)
    );
    assert_eq!(store.ledger_row("second").await.unwrap(), None);
    assert_eq!(store.open_reservations().await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schema_holds_its_rules() {
    let db = Db::new(Backend::Postgres, "schema").await;
    let store = db.store();
    let team = funded(store.as_ref(), "t", 1_000).await;
    let raw = db.raw().await;
    let pool = raw.postgres();
    // Status outside the three, settled_at out of step with status, negative money: refused.
    for sql in [
        "UPDATE usage_ledger SET status = 'open'",
        "UPDATE usage_ledger SET settled_at = now()",
        "UPDATE usage_ledger SET status = 'settled'",
        "UPDATE usage_ledger SET cost_microcredits = -1",
    ] {
        store
            .reserve(&reservation("rules", team))
            .await
            .or_else(|e| match e {
                LedgerError::Duplicate => Ok(()),
                e => Err(e),
            })
            .unwrap();
        let err = sqlx::query(sql).execute(pool).await.unwrap_err();
        assert!(
            matches!(&err, sqlx::Error::Database(d) if d.is_check_violation()),
            "{sql}: {err}"
        );
    }
    let err = sqlx::query(
        "INSERT INTO api_keys (team_id, hash, prefix, model_allowlist, created_at) \
         VALUES ($1, 'h', 'p', ARRAY['a', NULL], now())",
    )
    .bind(team)
    .execute(pool)
    .await
    .unwrap_err();
    assert!(matches!(&err, sqlx::Error::Database(d) if d.is_check_violation()));
    let types: Vec<(String, String)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text FROM information_schema.columns \
         WHERE table_name = 'usage_ledger' AND column_name IN \
         ('cost_microcredits', 'created_at', 'request_id') ORDER BY column_name",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        types,
        [
            ("cost_microcredits".to_owned(), "bigint".to_owned()),
            (
                "created_at".to_owned(),
                "timestamp with time zone".to_owned()
            ),
            ("request_id".to_owned(), "text".to_owned()),
        ]
    );
}

/// Another replica's admission, mid-transaction: it created the principal's lock row and
/// reserved the window's last message. An admission of the same principal waits on it and
/// then counts that reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_behind_the_principal_lock_counts_what_the_holder_reserved() {
    use switchyard_actors::lifecycle::{Decision, MessagePolicy, NewGeneration};

    let db = Db::new(Backend::Postgres, "behind_principal").await;
    let store = db.store();
    let raw = db.raw().await;
    let mut holder = raw.postgres().begin().await.unwrap();
    for sql in [
        "INSERT INTO generation_principals (subject) VALUES ('alice')",
        "INSERT INTO message_windows (subject, window_start_ms, used, reserved) \
         VALUES ('alice', 0, 0, 1)",
    ] {
        sqlx::query(sql).execute(&mut *holder).await.unwrap();
    }
    let policy = MessagePolicy {
        limit: 1,
        ..MessagePolicy::default()
    };
    let admit = tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            let new = NewGeneration {
                id: "gen-second".to_owned(),
                subject: "alice".to_owned(),
                idempotency_key: "k".to_owned(),
                fingerprint: "fp".to_owned(),
                model: "m".to_owned(),
            };
            store.admit_generation(&new, &policy, 1_000).await
        }
    });
    lock_waiters(raw.postgres(), 1).await;
    holder.commit().await.unwrap();

    assert_eq!(
        admit.await.unwrap().unwrap(),
        Decision::QuotaExhausted {
            limit: 1,
            remaining: 0,
            reset_at_ms: policy.window_ms,
        }
    );
    assert_eq!(store.get_generation("gen-second").await.unwrap(), None);
}

/// A transition queued behind another that ended the generation acts on the committed end:
/// it is refused as final and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transition_behind_a_committed_end_is_refused() {
    use switchyard_actors::lifecycle::{
        Decision, Event, MessagePolicy, NewGeneration, Refusal, Status, WindowCounters,
    };

    let db = Db::new(Backend::Postgres, "behind_end").await;
    let store = db.store();
    let new = NewGeneration {
        id: "gen-1".to_owned(),
        subject: "bob".to_owned(),
        idempotency_key: "k".to_owned(),
        fingerprint: "fp".to_owned(),
        model: "m".to_owned(),
    };
    let Decision::Admitted(_) = store
        .admit_generation(&new, &MessagePolicy::default(), 0)
        .await
        .unwrap()
    else {
        panic!("not admitted");
    };
    store
        .apply_generation("gen-1", &Event::Dispatch { attempt: 1 }, 1)
        .await
        .unwrap();

    let raw = db.raw().await;
    let mut holder = raw.postgres().begin().await.unwrap();
    sqlx::query(
        "UPDATE generations SET status = 'cancelled', slot_held = false, \
         attempt_state = 'fenced', terminal_ms = 2 WHERE id = 'gen-1'",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let accept = tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            store
                .apply_generation("gen-1", &Event::Accept { attempt: 1 }, 3)
                .await
        }
    });
    lock_waiters(raw.postgres(), 1).await;
    holder.commit().await.unwrap();

    let applied = accept.await.unwrap().unwrap();
    assert_eq!(applied.result, Err(Refusal::Final));
    assert_eq!(applied.record.status, Status::Cancelled);
    // The accept's consume never happened.
    assert_eq!(
        store.message_window("bob", 0).await.unwrap(),
        WindowCounters {
            used: 0,
            reserved: 1
        }
    );
}
