//! Error mapping and row decoding for the PostgreSQL store: SQL types to domain types,
//! with every conversion checked.

#[allow(unused_imports)]
use super::*;
use crate::store::ReviewedRow;
use crate::store::drift::{parse_review, reviewed_from_row};

/// PostgreSQL text cannot hold NUL, and refuses it with an error; SQLite stores it. A key
/// that cannot be stored cannot be found either, so lookups answer "absent" without asking.
pub(super) fn storable(text: &str) -> bool {
    !text.contains('\0')
}

/// `at` truncated to the millisecond (towards the past, as `timestamp_millis` does).
pub(super) fn millis(at: DateTime<Utc>) -> DateTime<Utc> {
    at.with_nanosecond(at.nanosecond() / 1_000_000 * 1_000_000)
        .unwrap_or(at)
}

pub(super) use crate::store::sql::{found, ledger_unavailable, unavailable};

/// A unique violation becomes `Conflict(message())`; a check violation or a value PostgreSQL
/// cannot hold (SQLSTATE class 22: NUL in text, a timestamp beyond its range) is `Invalid`;
/// anything else is `Unavailable`.
pub(super) fn conflict_or(e: sqlx::Error, message: impl FnOnce() -> String) -> StoreError {
    match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict(message()),
        sqlx::Error::Database(d)
            if d.is_check_violation() || d.code().is_some_and(|c| c.starts_with("22")) =>
        {
            StoreError::Invalid(d.to_string())
        }
        sqlx::Error::Encode(err) => StoreError::Invalid(err.to_string()),
        _ => unavailable(e),
    }
}

/// Reads a column, mapping a decode failure (a corrupt or foreign row) to `Invalid`.
pub(super) fn col<'r, T>(row: &'r PgRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(name)
        .map_err(|e| StoreError::Invalid(format!("column {name}: {e}")))
}

/// Reads a nullable BIGINT column into a narrower unsigned type.
pub(super) fn opt_int<T: TryFrom<i64>>(row: &PgRow, name: &str) -> Result<Option<T>, StoreError> {
    col::<Option<i64>>(row, name)?
        .map(|v| {
            T::try_from(v)
                .map_err(|_| StoreError::Invalid(format!("column {name}: {v} out of range")))
        })
        .transpose()
}

pub(super) fn team_from_row(row: &PgRow) -> Result<Team, StoreError> {
    Ok(Team {
        id: col(row, "id")?,
        name: col(row, "name")?,
        balance_microcredits: col(row, "balance_microcredits")?,
    })
}

pub(super) fn key_from_row(row: &PgRow) -> Result<ApiKeyRecord, StoreError> {
    let (service_tiers, service_tier) =
        stored_tiers(col(row, "service_tiers")?, col(row, "service_tier")?)?;
    Ok(ApiKeyRecord {
        id: col(row, "id")?,
        team_id: col(row, "team_id")?,
        prefix: col(row, "prefix")?,
        model_allowlist: col(row, "model_allowlist")?,
        rpm: opt_int(row, "rpm")?,
        tokens_per_day: opt_int(row, "tokens_per_day")?,
        max_streams: opt_int(row, "max_streams")?,
        expires_at: col(row, "expires_at")?,
        revoked_at: col(row, "revoked_at")?,
        message_quota: opt_int(row, "message_quota")?,
        burst_capacity: opt_int(row, "burst_capacity")?,
        burst_refill_seconds: opt_int(row, "burst_refill_seconds")?,
        service_tiers,
        service_tier,
        created_at: col(row, "created_at")?,
    })
}

pub(super) fn node_from_row(row: &PgRow) -> Result<NodeRecord, StoreError> {
    let gpus: String = col(row, "gpus")?;
    Ok(NodeRecord {
        id: col(row, "id")?,
        location: col(row, "location")?,
        token_hash: col(row, "token_hash")?,
        gpus: serde_json::from_str(&gpus)
            .map_err(|e| StoreError::Invalid(format!("column gpus: {e}")))?,
        models: col(row, "models")?,
        last_seen: col(row, "last_seen")?,
        orchestrator_id: col(row, "orchestrator_id")?,
        drained_at: col(row, "drained_at")?,
        pool: col(row, "pool")?,
        created_at: col(row, "created_at")?,
    })
}

pub(super) fn ledger_from_row(row: &PgRow) -> Result<LedgerRow, StoreError> {
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
        created_at: col(row, "created_at")?,
        settled_at: col(row, "settled_at")?,
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
pub(super) fn reviewed_from_pg_row(row: &PgRow) -> Result<ReviewedRow, StoreError> {
    reviewed_from_row(row, col(row, "settled_at")?)
}
