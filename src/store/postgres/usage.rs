//! The PostgreSQL side of the console's reads (see `store::usage`): a request's day is
//! `(created_at AT TIME ZONE 'UTC')::date`.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::Row;

use super::PostgresStore;
use super::rows::unavailable;
use crate::store::StoreError;
use crate::store::usage::{
    CREDIT_ENTRIES, CreditEntry, KEYS_LAST_USED, UsageDay, credit_entry_from_row, usage_by_day_sql,
    usage_day_from_row,
};

fn column<'r, T>(row: &'r sqlx::postgres::PgRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    row.try_get(name)
        .map_err(|e| StoreError::Invalid(format!("column {name}: {e}")))
}

impl PostgresStore {
    pub(super) async fn usage_by_day_impl(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        team_id: Option<i64>,
    ) -> Result<Vec<UsageDay>, StoreError> {
        const SQL: &str = usage_by_day_sql!(
            "(created_at AT TIME ZONE 'UTC')::date",
            "$3::BIGINT IS NULL"
        );
        sqlx::query(SQL)
            .bind(from)
            .bind(to)
            .bind(team_id)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(|row| usage_day_from_row(row, column::<NaiveDate>(row, "day")?))
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
            .map(|row| credit_entry_from_row(row, column(row, "created_at")?))
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
            if let Some(at) = column::<Option<DateTime<Utc>>>(&row, "last_used")? {
                out.insert(column(&row, "key_id")?, at);
            }
        }
        Ok(out)
    }
}
