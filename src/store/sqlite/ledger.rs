//! The SQLite ledger: reserve, settle within the row's bounds, cancel, and the row as
//! the actors see it.

use super::*;

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
        .bind(self.now_millis())
        // A bound beyond the ledger's range is no bound: the same as `i64::MAX`.
        .bind(saturated(r.bounds.prompt_tokens))
        .bind(saturated(r.bounds.completion_tokens))
        .execute(&mut *w.tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_unique_violation() => LedgerError::Duplicate,
            _ => ledger_unavailable(e),
        })?;
        w.tx.commit().await.map_err(ledger_unavailable)
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
