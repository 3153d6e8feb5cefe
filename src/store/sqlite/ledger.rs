//! The SQLite ledger: reserve, settle within the row's bounds, cancel, and the row as
//! the actors see it.

use std::collections::{BTreeMap, BTreeSet};

use switchyard_actors::ports::BatchReport;

use super::*;
use crate::store::sql::{BatchPlan, TeamRoom, available, batch_failed};

#[async_trait]
impl Ledger for SqliteStore {
    async fn reserve(&self, r: &Reservation) -> Result<(), LedgerError> {
        let mut w = self.begin_write().await.map_err(ledger_unavailable)?;
        // The balance check runs inside this transaction: `BEGIN IMMEDIATE` already holds
        // the write lock, so no other reservation, settle or credit can slip between the
        // check and the insert. Returning early drops `w`, which rolls back.
        let row = sqlx::query(
            "SELECT balance_microcredits, \
             (SELECT COALESCE(SUM(estimated_cost_microcredits), 0) FROM usage_ledger \
             WHERE team_id = ?1 AND status = 'reserved') AS held, \
             EXISTS (SELECT 1 FROM usage_ledger WHERE request_id = ?2) AS taken \
             FROM teams WHERE id = ?1",
        )
        .bind(r.team_id)
        .bind(&r.request_id)
        .fetch_optional(&mut *w.tx)
        .await
        .map_err(ledger_unavailable)?
        .ok_or_else(|| LedgerError::Unavailable(format!("no team {}", r.team_id)))?;
        let balance: i64 = row
            .try_get("balance_microcredits")
            .map_err(ledger_unavailable)?;
        let held: i64 = row.try_get("held").map_err(ledger_unavailable)?;
        let taken: bool = row.try_get("taken").map_err(ledger_unavailable)?;
        // A retried reservation is a duplicate even when its own estimate fills the balance.
        if taken {
            return Err(LedgerError::Duplicate);
        }
        if !covers(balance, held, r.estimated_cost) {
            return Err(LedgerError::InsufficientBalance);
        }
        insert_reservation(&mut w, r, self.now_millis()).await?;
        w.tx.commit().await.map_err(ledger_unavailable)
    }

    async fn reserve_batch_report(&self, batch: &[Reservation]) -> BatchReport {
        if batch.is_empty() {
            return BatchReport::default();
        }
        let (mut w, plan, teams) = match self.plan_batch(batch).await {
            Ok(planned) => planned,
            Err(e) => {
                return BatchReport {
                    results: batch.iter().map(|_| Err(e.clone())).collect(),
                    available: BTreeMap::new(),
                };
            }
        };
        let mut written = Ok(());
        for r in plan.accepted.iter().filter_map(|&i| batch.get(i)) {
            // No unique violation can happen: the write lock has been held since the ids
            // were checked. Any failure leaves the transaction unusable, so it ends it.
            written = insert_reservation(&mut w, r, self.now_millis()).await;
            if written.is_err() {
                break;
            }
        }
        // One commit (one fsync) for the whole batch.
        let committed = match written {
            Ok(()) => w.tx.commit().await.map_err(ledger_unavailable),
            Err(e) => Err(e),
        };
        match committed {
            Ok(()) => BatchReport {
                results: plan.results,
                available: available(&teams),
            },
            Err(e) => BatchReport {
                results: batch_failed(plan, &e),
                available: BTreeMap::new(),
            },
        }
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleOutcome, LedgerError> {
        self.finish(&s.request_id, Some(s)).await
    }

    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        self.finish(request_id, None).await
    }

    async fn entry(
        &self,
        request_id: &str,
    ) -> Result<Option<crate::store::LedgerEntry>, LedgerError> {
        let row = Store::ledger_row(self, request_id)
            .await
            .map_err(|e| LedgerError::Unavailable(e.to_string()))?;
        Ok(row.map(|r| r.entry()))
    }
}

impl SqliteStore {
    /// Takes the write lock, reads each team's balance and open reservations and each id's
    /// existence once, and decides every reservation of `batch` against running totals.
    async fn plan_batch(
        &self,
        batch: &[Reservation],
    ) -> Result<(WriteTx, BatchPlan, BTreeMap<i64, TeamRoom>), LedgerError> {
        let mut w = self.begin_write().await.map_err(ledger_unavailable)?;
        let mut teams = BTreeMap::new();
        for team_id in batch.iter().map(|r| r.team_id).collect::<BTreeSet<_>>() {
            let room: Option<(i64, i64)> = sqlx::query_as(
                "SELECT balance_microcredits, \
                 (SELECT COALESCE(SUM(estimated_cost_microcredits), 0) FROM usage_ledger \
                 WHERE team_id = ?1 AND status = 'reserved') \
                 FROM teams WHERE id = ?1",
            )
            .bind(team_id)
            .fetch_optional(&mut *w.tx)
            .await
            .map_err(ledger_unavailable)?;
            if let Some((balance, held)) = room {
                teams.insert(team_id, TeamRoom { balance, held });
            }
        }
        let mut taken = BTreeSet::new();
        for r in batch {
            let exists: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM usage_ledger WHERE request_id = ?)",
            )
            .bind(&r.request_id)
            .fetch_one(&mut *w.tx)
            .await
            .map_err(ledger_unavailable)?;
            if exists {
                taken.insert(r.request_id.clone());
            }
        }
        let plan = crate::store::sql::plan_batch(batch, &mut teams, &taken, |_| None);
        Ok((w, plan, teams))
    }
}

/// Inserts `r` as a `reserved` row in the write transaction `w`.
async fn insert_reservation(
    w: &mut WriteTx,
    r: &Reservation,
    now_ms: i64,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO usage_ledger \
         (request_id, team_id, key_id, model, estimated_cost_microcredits, \
         price_input_per_mtok, price_output_per_mtok, status, created_at, \
         prompt_token_bound, completion_token_bound) \
         VALUES (?, ?, ?, ?, ?, ?, ?, 'reserved', ?, ?, ?)",
    )
    .bind(&r.request_id)
    .bind(r.team_id)
    .bind(r.key_id)
    .bind(&r.model)
    .bind(r.estimated_cost)
    .bind(r.price_input_per_mtok)
    .bind(r.price_output_per_mtok)
    .bind(now_ms)
    // A bound beyond the ledger's range is no bound: the same as `i64::MAX`.
    .bind(saturated(r.bounds.prompt_tokens))
    .bind(saturated(r.bounds.completion_tokens))
    .execute(&mut *w.tx)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => LedgerError::Duplicate,
        _ => ledger_unavailable(e),
    })?;
    Ok(())
}
