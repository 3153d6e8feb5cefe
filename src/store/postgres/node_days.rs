//! The PostgreSQL side of `node_days` and the per-node ledger sums (see `store::node_days`):
//! days are `DATE`, a settlement's day is `(settled_at AT TIME ZONE 'UTC')::date`.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::Row;

use super::PostgresStore;
use super::rows::{millis, storable, unavailable};
use crate::store::drift::{DRIFT_TOTALS, check_range, model_drift_from_row};
use crate::store::node_days::{
    ADD_NODE_DAY, NODE_DAYS, NodeDay, NodeDayLedger, NodeDayUsage, by_model, day_start,
    node_day_from_row, node_day_ledger_from_row, node_day_ledger_sql, sort_node_day_ledger,
    sort_node_days, valid_pool,
};
use crate::store::sql::found;
use crate::store::{StoreError, TokenTotals};

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn day_of(row: &sqlx::postgres::PgRow) -> Result<NaiveDate, StoreError> {
    row.try_get("day")
        .map_err(|e| StoreError::Invalid(format!("column day: {e}")))
}

impl PostgresStore {
    pub(super) async fn settled_by_model_impl(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<BTreeMap<String, TokenTotals>, StoreError> {
        check_range(from, to)?;
        let models = sqlx::query(DRIFT_TOTALS)
            .bind(millis(from))
            .bind(millis(to))
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(model_drift_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(by_model(models))
    }

    pub(super) async fn add_node_day_impl(&self, u: &NodeDayUsage) -> Result<(), StoreError> {
        if !storable(&u.node_id) || !storable(&u.model) {
            return Err(StoreError::Invalid(
                "a node id or model holds NUL".to_owned(),
            ));
        }
        sqlx::query(ADD_NODE_DAY)
            .bind(&u.node_id)
            .bind(u.day)
            .bind(&u.model)
            .bind(int(u.connected_seconds))
            .bind(i32::try_from(u.gpus).unwrap_or(i32::MAX))
            .bind(int(u.engine_prompt_tokens))
            .bind(int(u.engine_generation_tokens))
            .bind(u.engine_counters)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    pub(super) async fn node_days_impl(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> Result<Vec<NodeDay>, StoreError> {
        let mut rows = sqlx::query(NODE_DAYS)
            .bind(from)
            .bind(to)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| node_day_from_row(row, day_of(row)?))
            .collect::<Result<Vec<_>, _>>()?;
        sort_node_days(&mut rows);
        Ok(rows)
    }

    pub(super) async fn node_day_ledger_impl(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> Result<Vec<NodeDayLedger>, StoreError> {
        const SQL: &str = node_day_ledger_sql!("(settled_at AT TIME ZONE 'UTC')::date");
        let mut rows = sqlx::query(SQL)
            .bind(day_start(from))
            .bind(day_start(to))
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| node_day_ledger_from_row(row, day_of(row)?))
            .collect::<Result<Vec<_>, _>>()?;
        sort_node_day_ledger(&mut rows);
        Ok(rows)
    }

    pub(super) async fn set_node_pool_impl(
        &self,
        id: &str,
        pool: Option<&str>,
    ) -> Result<(), StoreError> {
        if pool.is_some_and(|p| !valid_pool(p)) {
            return Err(StoreError::Invalid(
                "a pool name is 1 to 63 characters of a-z, 0-9 and -".to_owned(),
            ));
        }
        if !storable(id) {
            return Err(StoreError::NotFound);
        }
        let done = sqlx::query("UPDATE nodes SET pool = $1 WHERE id = $2")
            .bind(pool)
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        found(done.rows_affected())
    }
}
