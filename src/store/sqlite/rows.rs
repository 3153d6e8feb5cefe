//! Error mapping and row decoding for the SQLite store: SQL types to domain types,
//! with every conversion checked.

#[allow(unused_imports)]
use super::*;
use crate::store::ReviewedRow;
use crate::store::drift::{parse_review, reviewed_from_row};

pub(super) use crate::store::sql::{found, ledger_unavailable, unavailable};

/// A unique violation becomes `Conflict(message())`; anything else is `Unavailable`.
pub(super) fn conflict_or(e: sqlx::Error, message: impl FnOnce() -> String) -> StoreError {
    match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict(message()),
        sqlx::Error::Database(d) if d.is_check_violation() => StoreError::Invalid(d.to_string()),
        _ => unavailable(e),
    }
}

pub(super) fn time(ms: i64) -> Result<DateTime<Utc>, StoreError> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| StoreError::Invalid(format!("timestamp {ms} out of range")))
}

pub(super) fn opt_time(ms: Option<i64>) -> Result<Option<DateTime<Utc>>, StoreError> {
    ms.map(time).transpose()
}

/// Reads a column, mapping a decode failure (a corrupt or foreign row) to `Invalid`.
pub(super) fn col<'r, T>(row: &'r SqliteRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>,
{
    row.try_get(name)
        .map_err(|e| StoreError::Invalid(format!("column {name}: {e}")))
}

/// Reads a nullable INTEGER column into a narrower unsigned type.
pub(super) fn opt_int<T: TryFrom<i64>>(
    row: &SqliteRow,
    name: &str,
) -> Result<Option<T>, StoreError> {
    col::<Option<i64>>(row, name)?
        .map(|v| {
            T::try_from(v)
                .map_err(|_| StoreError::Invalid(format!("column {name}: {v} out of range")))
        })
        .transpose()
}

pub(super) fn json<T: serde::de::DeserializeOwned>(
    text: &str,
    name: &str,
) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Invalid(format!("column {name}: {e}")))
}

pub(super) fn team_from_row(row: &SqliteRow) -> Result<Team, StoreError> {
    Ok(Team {
        id: col(row, "id")?,
        name: col(row, "name")?,
        balance_microcredits: col(row, "balance_microcredits")?,
    })
}

pub(super) fn key_from_row(row: &SqliteRow) -> Result<ApiKeyRecord, StoreError> {
    let allowlist: Option<String> = col(row, "model_allowlist")?;
    let (service_tiers, service_tier) =
        stored_tiers(col(row, "service_tiers")?, col(row, "service_tier")?)?;
    Ok(ApiKeyRecord {
        id: col(row, "id")?,
        team_id: col(row, "team_id")?,
        prefix: col(row, "prefix")?,
        model_allowlist: allowlist
            .map(|text| json(&text, "model_allowlist"))
            .transpose()?,
        rpm: opt_int(row, "rpm")?,
        tokens_per_day: opt_int(row, "tokens_per_day")?,
        max_streams: opt_int(row, "max_streams")?,
        expires_at: opt_time(col(row, "expires_at")?)?,
        revoked_at: opt_time(col(row, "revoked_at")?)?,
        message_quota: opt_int(row, "message_quota")?,
        burst_capacity: opt_int(row, "burst_capacity")?,
        burst_refill_seconds: opt_int(row, "burst_refill_seconds")?,
        service_tiers,
        service_tier,
        created_at: time(col(row, "created_at")?)?,
    })
}

pub(super) fn node_from_row(row: &SqliteRow) -> Result<NodeRecord, StoreError> {
    let gpus: String = col(row, "gpus")?;
    let models: String = col(row, "models")?;
    Ok(NodeRecord {
        id: col(row, "id")?,
        location: col(row, "location")?,
        token_hash: col(row, "token_hash")?,
        gpus: json(&gpus, "gpus")?,
        models: json(&models, "models")?,
        last_seen: opt_time(col(row, "last_seen")?)?,
        orchestrator_id: col(row, "orchestrator_id")?,
        drained_at: opt_time(col(row, "drained_at")?)?,
        pool: col(row, "pool")?,
        created_at: time(col(row, "created_at")?)?,
    })
}

pub(super) fn ledger_from_row(row: &SqliteRow) -> Result<LedgerRow, StoreError> {
    let status: String = col(row, "status")?;
    Ok(LedgerRow {
        id: col(row, "id")?,
        request_id: col(row, "request_id")?,
        team_id: col(row, "team_id")?,
        key_id: col(row, "key_id")?,
        model: col(row, "model")?,
        prompt_tokens: col(row, "prompt_tokens")?,
        completion_tokens: col(row, "completion_tokens")?,
        cost_microcredits: col(row, "cost_microcredits")?,
        estimated_cost_microcredits: col(row, "estimated_cost_microcredits")?,
        price_input_per_mtok: col(row, "price_input_per_mtok")?,
        price_output_per_mtok: col(row, "price_output_per_mtok")?,
        status: LedgerStatus::from_str(&status)?,
        created_at: time(col(row, "created_at")?)?,
        settled_at: opt_time(col(row, "settled_at")?)?,
        prompt_token_bound: col(row, "prompt_token_bound")?,
        completion_token_bound: col(row, "completion_token_bound")?,
        claimed_prompt_tokens: col(row, "claimed_prompt_tokens")?,
        claimed_completion_tokens: col(row, "claimed_completion_tokens")?,
        review: col::<Option<String>>(row, "review")?
            .as_deref()
            .map(parse_review)
            .transpose()?,
    })
}

/// A row of the drift report's list of reviewed rows.
pub(super) fn reviewed_from_sqlite_row(row: &SqliteRow) -> Result<ReviewedRow, StoreError> {
    reviewed_from_row(row, time(col(row, "settled_at")?)?)
}
