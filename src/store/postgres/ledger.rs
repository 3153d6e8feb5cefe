//! The PostgreSQL ledger: reserve, settle within the row's bounds, cancel, and the row as
//! the actors see it.

use super::*;

#[async_trait]
impl Ledger for PostgresStore {
    async fn reserve(&self, r: &Reservation) -> Result<(), LedgerError> {
        if !storable(&r.request_id) || !storable(&r.model) {
            return Err(LedgerError::Unavailable(
                "request id or model contains a NUL character".to_owned(),
            ));
        }
        let now = self.now();
        let mut tx = self.begin().await.map_err(ledger_unavailable)?;
        // The team's row lock serialises this team's reservations (and its settles and
        // credits, which update the row): the check below and the insert see no rival.
        // Returning early drops `tx`, which rolls back and releases the lock.
        let balance: i64 =
            sqlx::query_scalar("SELECT balance_microcredits FROM teams WHERE id = $1 FOR UPDATE")
                .bind(r.team_id)
                .fetch_optional(&mut *tx)
                .await
                .map_err(ledger_unavailable)?
                .ok_or_else(|| LedgerError::Unavailable(format!("no team {}", r.team_id)))?;
        // A separate statement, so its snapshot starts after the lock was granted and counts
        // the reservations the previous holder committed.
        let row = sqlx::query(
            "SELECT (SELECT COALESCE(SUM(estimated_cost_microcredits), 0) FROM usage_ledger \
             WHERE team_id = $1 AND status = 'reserved')::BIGINT AS held, \
             EXISTS (SELECT 1 FROM usage_ledger WHERE request_id = $2) AS taken",
        )
        .bind(r.team_id)
        .bind(&r.request_id)
        .fetch_one(&mut *tx)
        .await
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
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'reserved', $8, $9, $10)",
        )
        .bind(&r.request_id)
        .bind(r.team_id)
        .bind(r.key_id)
        .bind(&r.model)
        .bind(r.estimated_cost)
        .bind(r.price_input_per_mtok)
        .bind(r.price_output_per_mtok)
        .bind(now)
        // A bound beyond the ledger's range is no bound: the same as `i64::MAX`.
        .bind(saturated(r.bounds.prompt_tokens))
        .bind(saturated(r.bounds.completion_tokens))
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            // The same id reserved concurrently for another team (whose lock we don't hold).
            sqlx::Error::Database(d) if d.is_unique_violation() => LedgerError::Duplicate,
            _ => ledger_unavailable(e),
        })?;
        tx.commit().await.map_err(ledger_unavailable)
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleOutcome, LedgerError> {
        if !storable(&s.request_id) {
            return Ok(SettleOutcome::Unknown);
        }
        // Any claim settles: a count beyond i64 is bound saturated, which bills the same (no
        // bound exceeds i64::MAX), and `$4` keeps it counted as over the bound.
        let beyond = s.prompt_tokens > MAX_TOKEN_COUNT || s.completion_tokens > MAX_TOKEN_COUNT;
        let now = self.now();
        let mut tx = self.begin().await.map_err(ledger_unavailable)?;
        // Exactly once: a concurrent settle or cancel of the same row waits on this row's
        // lock, then re-checks `status = 'reserved'` against the committed row, matches
        // nothing and reports `AlreadyFinal`. The bill and its price come from the row's
        // own bounds and prices in the statement that claims it, so a settle resent by any
        // replica bills the same; both are checked against the port's rule below.
        let row = sqlx::query(SETTLE)
            .bind(&s.request_id)
            .bind(saturated(s.prompt_tokens))
            .bind(saturated(s.completion_tokens))
            .bind(beyond)
            .bind(s.review.map(|r| r.as_str()))
            .bind(now)
            .fetch_optional(&mut *tx)
            .await
            .map_err(ledger_unavailable)?;
        let Some(row) = row else {
            return Self::unchanged(&s.request_id, &mut *tx).await;
        };
        let team_id: i64 = row.try_get("team_id").map_err(ledger_unavailable)?;
        let get = |name: &str| row.try_get::<i64, _>(name).map_err(ledger_unavailable);
        let get_opt = |name: &str| {
            row.try_get::<Option<i64>, _>(name)
                .map_err(ledger_unavailable)
        };
        let expected = Settled::expected(
            s,
            stored_bounds(
                get_opt("prompt_token_bound")?,
                get_opt("completion_token_bound")?,
            ),
            get("price_input_per_mtok")?,
            get("price_output_per_mtok")?,
        );
        let claimed = match (
            get_opt("claimed_prompt_tokens")?,
            get_opt("claimed_completion_tokens")?,
        ) {
            (Some(p), Some(c)) => Some((p, c)),
            _ => None,
        };
        let written = Settled {
            prompt_tokens: get("prompt_tokens")?,
            completion_tokens: get("completion_tokens")?,
            claimed,
            review: row.try_get("review").map_err(ledger_unavailable)?,
            cost: get("cost_microcredits")?,
        };
        let cost = written.check(&expected, &s.request_id)?.cost;
        // An overflowing balance raises an error and the whole settlement rolls back.
        sqlx::query(
            "UPDATE teams SET balance_microcredits = balance_microcredits - $1 WHERE id = $2",
        )
        .bind(cost)
        .bind(team_id)
        .execute(&mut *tx)
        .await
        .map_err(ledger_unavailable)?;
        tx.commit().await.map_err(ledger_unavailable)?;
        Ok(SettleOutcome::Applied)
    }

    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        if !storable(request_id) {
            return Ok(SettleOutcome::Unknown);
        }
        // One statement, so its own transaction: nothing else changes with a cancel.
        let changed = sqlx::query(
            "UPDATE usage_ledger SET status = 'cancelled', settled_at = $2 \
             WHERE request_id = $1 AND status = 'reserved'",
        )
        .bind(request_id)
        .bind(self.now())
        .execute(&self.pool)
        .await
        .map_err(ledger_unavailable)?
        .rows_affected();
        if changed == 1 {
            Ok(SettleOutcome::Applied)
        } else {
            Self::unchanged(request_id, &self.pool).await
        }
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
