//! What the operator's console reads beside the admin API's records: usage per UTC day, team
//! and model; a team's credit history; when each of a team's keys last admitted a request.
//! One SQL text for both backends but for the day expression and the team filter's typing,
//! and one row reader.

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::StoreError;
use super::drift::{get, wide_sum};

/// Most entries of a team's credit history one call returns (newest first).
pub const CREDIT_HISTORY_LIMIT: i64 = 200;

/// Settled usage of one team and model on one UTC day (of the requests admitted that day).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageDay {
    pub day: NaiveDate,
    pub team_id: i64,
    pub model: String,
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_microcredits: u64,
}

/// One credit (or correction) of a team.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreditEntry {
    pub id: i64,
    pub team_id: i64,
    pub amount_microcredits: i64,
    pub note: String,
    pub created_at: DateTime<Utc>,
}

/// Settled rows admitted in `[$1, $2)`, of team `$3` or of all (`$3` null), per day, team
/// and model, in that order. Sums are split ([`split_sum!`]) so SQLite never overflows.
macro_rules! usage_by_day_sql {
    ($day:literal, $team_null:literal) => {
        concat!(
            "SELECT ",
            $day,
            " AS day, team_id, model, COUNT(*) AS requests, ",
            $crate::store::drift::split_sum!("prompt_tokens", "prompt"),
            ", ",
            $crate::store::drift::split_sum!("completion_tokens", "completion"),
            ", ",
            $crate::store::drift::split_sum!("cost_microcredits", "cost"),
            " FROM usage_ledger WHERE status = 'settled' AND created_at >= $1 \
             AND created_at < $2 AND (",
            $team_null,
            " OR team_id = $3) GROUP BY ",
            $day,
            ", team_id, model ORDER BY day, team_id, model"
        )
    };
}
pub(super) use usage_by_day_sql;

/// A team's credit entries, newest first, at most `$2`.
pub(super) const CREDIT_ENTRIES: &str = "SELECT id, team_id, amount_microcredits, note, \
     created_at FROM credit_entries WHERE team_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2";

/// Each of team `$1`'s keys with the admission time of its newest ledger row (an index-only
/// look-up per key on `usage_ledger_key_created`); keys never used are absent.
pub(super) const KEYS_LAST_USED: &str = "SELECT k.id AS key_id, (SELECT MAX(u.created_at) \
     FROM usage_ledger u WHERE u.key_id = k.id) AS last_used FROM api_keys k WHERE k.team_id = $1";

/// A [`split_sum!`](super::drift::split_sum) put back together, saturating at `u64::MAX`.
fn wide<R>(row: &R, name: &str) -> Result<u64, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(u64::try_from(wide_sum(row, name)?).unwrap_or(u64::MAX))
}

/// A row of [`usage_by_day_sql`] whose day the caller read in its backend's type.
pub(super) fn usage_day_from_row<R>(row: &R, day: NaiveDate) -> Result<UsageDay, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let requests: i64 = get(row, "requests")?;
    Ok(UsageDay {
        day,
        team_id: get(row, "team_id")?,
        model: get(row, "model")?,
        requests: u64::try_from(requests).unwrap_or(0),
        prompt_tokens: wide(row, "prompt")?,
        completion_tokens: wide(row, "completion")?,
        cost_microcredits: wide(row, "cost")?,
    })
}

/// A row of [`CREDIT_ENTRIES`] whose time the caller read in its backend's type.
pub(super) fn credit_entry_from_row<R>(
    row: &R,
    created_at: DateTime<Utc>,
) -> Result<CreditEntry, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(CreditEntry {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        amount_microcredits: get(row, "amount_microcredits")?,
        note: get(row, "note")?,
        created_at,
    })
}
