//! The PostgreSQL ledger: reserve, settle within the row's bounds, cancel, and the row as
//! the actors see it.

use std::collections::{BTreeMap, BTreeSet};

use switchyard_actors::ports::BatchReport;

use super::*;
use crate::store::sql::{BatchPlan, TeamRoom, available, batch_failed};

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

    async fn reserve_batch_report(&self, batch: &[Reservation]) -> BatchReport {
        if batch.is_empty() {
            return BatchReport::default();
        }
        let mut teams = BTreeMap::new();
        let plan = match self.plan_batch(batch, &mut teams).await {
            Ok(planned) => planned,
            Err(e) => {
                return BatchReport {
                    results: batch.iter().map(|_| Err(e.clone())).collect(),
                    available: BTreeMap::new(),
                };
            }
        };
        let (mut tx, plan) = plan;
        if plan.accepted.is_empty() {
            // Nothing to write: dropping `tx` rolls back and releases the locks.
            return BatchReport {
                results: plan.results,
                available: available(&teams),
            };
        }
        let inserted = match insert_accepted(&mut tx, batch, &plan.accepted, self.now()).await {
            Ok(inserted) => inserted,
            Err(e) => {
                return BatchReport {
                    results: batch_failed(plan, &e),
                    available: BTreeMap::new(),
                };
            }
        };
        if let Err(e) = tx.commit().await.map_err(ledger_unavailable) {
            return BatchReport {
                results: batch_failed(plan, &e),
                available: BTreeMap::new(),
            };
        }
        let mut results = plan.results;
        for &i in &plan.accepted {
            if let (Some(r), Some(slot)) = (batch.get(i), results.get_mut(i))
                && !inserted.contains(&r.request_id)
            {
                // The same id committed by another team's transaction after our check
                // (we don't hold that team's lock). Its estimate stays counted in this
                // batch's running total, which only ever refuses more, never admits beyond
                // the balance.
                *slot = Err(LedgerError::Duplicate);
                if let Some(room) = teams.get_mut(&r.team_id) {
                    room.held = room.held.saturating_sub(r.estimated_cost);
                }
            }
        }
        BatchReport {
            results,
            available: available(&teams),
        }
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
            .bind(s.node_id.as_deref())
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

impl PostgresStore {
    /// Opens a batch's transaction, locks the batch's teams (in id order, so two batches
    /// over the same teams cannot deadlock), reads their balances, open reservations and
    /// the batch's taken ids once, and decides every reservation against running totals.
    async fn plan_batch(
        &self,
        batch: &[Reservation],
        teams: &mut BTreeMap<i64, TeamRoom>,
    ) -> Result<(Transaction<'static, Postgres>, BatchPlan), LedgerError> {
        let team_ids: Vec<i64> = batch
            .iter()
            .map(|r| r.team_id)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let ids: Vec<&str> = batch
            .iter()
            .filter(|r| storable(&r.request_id))
            .map(|r| r.request_id.as_str())
            .collect();
        let mut tx = self.begin().await.map_err(ledger_unavailable)?;
        // The same lock the single-row reserve takes: a batch and single reservations,
        // settles and credits of these teams see no rival between the check and the insert.
        let locked: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT id, balance_microcredits FROM teams WHERE id = ANY($1) \
             ORDER BY id FOR UPDATE",
        )
        .bind(&team_ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(ledger_unavailable)?;
        // A separate statement, so its snapshot starts after the locks were granted; one
        // statement for both reads, since every round trip here is spent holding the lock.
        let read: Vec<(Option<i64>, Option<i64>, Option<String>)> = sqlx::query_as(
            "SELECT team_id, COALESCE(SUM(estimated_cost_microcredits), 0)::BIGINT, \
             NULL::TEXT FROM usage_ledger WHERE team_id = ANY($1) AND status = 'reserved' \
             GROUP BY team_id \
             UNION ALL \
             SELECT NULL::BIGINT, NULL::BIGINT, request_id FROM usage_ledger \
             WHERE request_id = ANY($2)",
        )
        .bind(&team_ids)
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(ledger_unavailable)?;
        let mut held = Vec::new();
        let mut taken = BTreeSet::new();
        for row in read {
            match row {
                (Some(team), Some(sum), _) => held.push((team, sum)),
                (_, _, Some(id)) => {
                    taken.insert(id);
                }
                _ => {}
            }
        }
        let held: BTreeMap<i64, i64> = held.into_iter().collect();
        for (id, balance) in locked {
            let held = held.get(&id).copied().unwrap_or(0);
            teams.insert(id, TeamRoom { balance, held });
        }
        let plan = crate::store::sql::plan_batch(batch, teams, &taken, |r| {
            (!storable(&r.request_id) || !storable(&r.model)).then(|| {
                LedgerError::Unavailable("request id or model contains a NUL character".into())
            })
        });
        Ok((tx, plan))
    }
}

/// Inserts the accepted reservations in one statement; returns the ids it inserted. An id
/// another transaction committed meanwhile is skipped (`ON CONFLICT DO NOTHING`) rather
/// than failing the batch, and reported `Duplicate` by the caller.
async fn insert_accepted(
    tx: &mut Transaction<'static, Postgres>,
    batch: &[Reservation],
    accepted: &[usize],
    now: DateTime<Utc>,
) -> Result<BTreeSet<String>, LedgerError> {
    let rows: Vec<&Reservation> = accepted.iter().filter_map(|&i| batch.get(i)).collect();
    let column = |f: fn(&Reservation) -> i64| rows.iter().map(|r| f(r)).collect::<Vec<i64>>();
    let ids: Vec<&str> = rows.iter().map(|r| r.request_id.as_str()).collect();
    let models: Vec<&str> = rows.iter().map(|r| r.model.as_str()).collect();
    let keys: Vec<Option<i64>> = rows.iter().map(|r| r.key_id).collect();
    let inserted: Vec<String> = sqlx::query_scalar(
        "INSERT INTO usage_ledger \
         (request_id, team_id, key_id, model, estimated_cost_microcredits, \
         price_input_per_mtok, price_output_per_mtok, status, created_at, \
         prompt_token_bound, completion_token_bound) \
         SELECT r.request_id, r.team_id, r.key_id, r.model, r.estimate, r.price_in, \
         r.price_out, 'reserved', $8, r.prompt_bound, r.completion_bound \
         FROM UNNEST($1::TEXT[], $2::BIGINT[], $3::BIGINT[], $4::TEXT[], $5::BIGINT[], \
         $6::BIGINT[], $7::BIGINT[], $9::BIGINT[], $10::BIGINT[]) \
         AS r(request_id, team_id, key_id, model, estimate, price_in, price_out, \
         prompt_bound, completion_bound) \
         ON CONFLICT (request_id) DO NOTHING RETURNING request_id",
    )
    .bind(&ids)
    .bind(column(|r| r.team_id))
    .bind(&keys)
    .bind(&models)
    .bind(column(|r| r.estimated_cost))
    .bind(column(|r| r.price_input_per_mtok))
    .bind(column(|r| r.price_output_per_mtok))
    .bind(now)
    // A bound beyond the ledger's range is no bound: the same as `i64::MAX`.
    .bind(column(|r| saturated(r.bounds.prompt_tokens)))
    .bind(column(|r| saturated(r.bounds.completion_tokens)))
    .fetch_all(&mut **tx)
    .await
    .map_err(ledger_unavailable)?;
    Ok(inserted.into_iter().collect())
}
