//! Upgrading a database an older release left: migration 0003 (usage bounds, outputs that
//! keep any text) on tables with rows. An open reservation admitted before bounds existed
//! stays unbounded and settles as before; a retained output stays readable.

use switchyard::store::{LedgerStatus, SettleOutcome, Settlement, cost_of};

use crate::harness::{Backend, Db, Raw};

async fn rows_admitted_before_bounds_survive_the_upgrade(backend: Backend) {
    let db = Db::at_version(backend, "upgrade", 2).await;
    let store = db.store();
    let team = store.create_team("before").await.unwrap();
    store.add_credits(team.id, 1_000_000, "seed").await.unwrap();
    let ledger = "INSERT INTO usage_ledger (request_id, team_id, model, \
                  estimated_cost_microcredits, price_input_per_mtok, price_output_per_mtok, \
                  status, created_at) VALUES ('old-1', $1, 'm', 50, 1000000, 2000000, 'reserved', ";
    let generation = "INSERT INTO generations (id, subject, idempotency_key, fingerprint, model, \
                      status, cancel_requested, attempt, attempt_state, message, window_start_ms, \
                      slot_held, slot_expires_ms, input_tokens, output_tokens, output, created_ms, \
                      terminal_ms, ledger_id) VALUES ('gen-old', 's', 'k', 'f', 'm', 'completed', \
                      FALSE, 1, 'accepted', 'consumed', 0, FALSE, 0, 3, 2, 'old text é', 1, 2, 'gen-old')";
    match db.raw().await {
        Raw::Sqlite(pool) => {
            sqlx::query(sqlx::AssertSqlSafe(format!("{ledger}1700000000000)")))
                .bind(team.id)
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query(generation).execute(&pool).await.unwrap();
        }
        Raw::Postgres(pool) => {
            sqlx::query(sqlx::AssertSqlSafe(format!("{ledger}now())")))
                .bind(team.id)
                .execute(&pool)
                .await
                .unwrap();
            sqlx::query(generation).execute(&pool).await.unwrap();
        }
    }

    store.migrate().await.unwrap();

    let row = store.ledger_row("old-1").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.prompt_token_bound, row.review),
        (LedgerStatus::Reserved, None, None),
        "an old open row is unbounded"
    );
    let settle = Settlement {
        request_id: "old-1".into(),
        prompt_tokens: 10,
        completion_tokens: 20,
        review: None,
        node_id: None,
    };
    assert_eq!(store.settle(&settle).await.unwrap(), SettleOutcome::Applied);
    let row = store.ledger_row("old-1").await.unwrap().unwrap();
    assert_eq!(
        (
            row.prompt_tokens,
            row.completion_tokens,
            row.cost_microcredits
        ),
        (10, 20, cost_of(10, 20, 1_000_000, 2_000_000))
    );
    let rec = store.get_generation("gen-old").await.unwrap().unwrap();
    assert_eq!(
        rec.output.as_deref(),
        Some("old text é"),
        "kept through the BYTEA change"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_upgrade_keeps_old_rows_and_outputs() {
    rows_admitted_before_bounds_survive_the_upgrade(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrade_keeps_old_rows_and_outputs() {
    rows_admitted_before_bounds_survive_the_upgrade(Backend::Postgres).await;
}
