//! The SQLite side of the console's reads (see `store::usage`): times are milliseconds since
//! the epoch, a request's day is `date(created_at / 1000, 'unixepoch')`.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::SqliteStore;
use super::rows::{col, opt_time, time, unavailable};
use crate::store::StoreError;
use crate::store::node_days::parse_day;
use crate::store::usage::{
    CREDIT_ENTRIES, CreditEntry, KEYS_LAST_USED, UsageDay, credit_entry_from_row, usage_by_day_sql,
    usage_day_from_row,
};

impl SqliteStore {
    pub(super) async fn usage_by_day_impl(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        team_id: Option<i64>,
    ) -> Result<Vec<UsageDay>, StoreError> {
        const SQL: &str = usage_by_day_sql!("date(created_at / 1000, 'unixepoch')", "$3 IS NULL");
        sqlx::query(SQL)
            .bind(from.timestamp_millis())
            .bind(to.timestamp_millis())
            .bind(team_id)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| usage_day_from_row(row, parse_day(&col::<String>(row, "day")?)?))
            .collect()
    }

    pub(super) async fn credit_entries_impl(
        &self,
        team_id: i64,
        limit: i64,
    ) -> Result<Vec<CreditEntry>, StoreError> {
        sqlx::query(CREDIT_ENTRIES)
            .bind(team_id)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| credit_entry_from_row(row, time(col(row, "created_at")?)?))
            .collect()
    }

    pub(super) async fn keys_last_used_impl(
        &self,
        team_id: i64,
    ) -> Result<BTreeMap<i64, DateTime<Utc>>, StoreError> {
        let mut out = BTreeMap::new();
        for row in sqlx::query(KEYS_LAST_USED)
            .bind(team_id)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
        {
            if let Some(at) = opt_time(col(&row, "last_used")?)? {
                out.insert(col(&row, "key_id")?, at);
            }
        }
        Ok(out)
    }
}
