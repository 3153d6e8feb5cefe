//! The SQLite side of `node_days` and the per-node ledger sums (see `store::node_days`):
//! days are TEXT `YYYY-MM-DD`, a settlement's day is `date(settled_at / 1000, 'unixepoch')`.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};

use super::SqliteStore;
use super::rows::{col, unavailable};
use crate::store::drift::{DRIFT_TOTALS, check_range, model_drift_from_row};
use crate::store::node_days::{
    ADD_NODE_DAY, NODE_DAYS, NodeDay, NodeDayLedger, NodeDayUsage, by_model, day_start,
    node_day_from_row, node_day_ledger_from_row, node_day_ledger_sql, parse_day,
    sort_node_day_ledger, sort_node_days, valid_pool,
};
use crate::store::sql::found;
use crate::store::{StoreError, TokenTotals};

/// A day as stored.
fn day_text(day: NaiveDate) -> String {
    day.format("%Y-%m-%d").to_string()
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl SqliteStore {
    pub(super) async fn settled_by_model_impl(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<BTreeMap<String, TokenTotals>, StoreError> {
        check_range(from, to)?;
        let models = sqlx::query(DRIFT_TOTALS)
            .bind(from.timestamp_millis())
            .bind(to.timestamp_millis())
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(model_drift_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(by_model(models))
    }

    pub(super) async fn add_node_day_impl(&self, u: &NodeDayUsage) -> Result<(), StoreError> {
        let _turn = self.writer.lock().await;
        sqlx::query(ADD_NODE_DAY)
            .bind(&u.node_id)
            .bind(day_text(u.day))
            .bind(&u.model)
            .bind(int(u.connected_seconds))
            .bind(i64::from(u.gpus))
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
            .bind(day_text(from))
            .bind(day_text(to))
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| node_day_from_row(row, parse_day(&col::<String>(row, "day")?)?))
            .collect::<Result<Vec<_>, _>>()?;
        sort_node_days(&mut rows);
        Ok(rows)
    }

    pub(super) async fn node_day_ledger_impl(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> Result<Vec<NodeDayLedger>, StoreError> {
        const SQL: &str = node_day_ledger_sql!("date(settled_at / 1000, 'unixepoch')");
        let mut rows = sqlx::query(SQL)
            .bind(day_start(from).timestamp_millis())
            .bind(day_start(to).timestamp_millis())
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| node_day_ledger_from_row(row, parse_day(&col::<String>(row, "day")?)?))
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
        let _turn = self.writer.lock().await;
        let done = sqlx::query("UPDATE nodes SET pool = ? WHERE id = ?")
            .bind(pool)
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        found(done.rows_affected())
    }
}
