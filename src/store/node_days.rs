//! Node uptime and engine counters per node and UTC day (`node_days`), and what the ledger
//! billed for each node's work per day: the data of the cost report and of the drift
//! report's per-node rows. Both SQL stores run the statements here; they differ only in how
//! a day is bound (PostgreSQL `DATE`, SQLite `TEXT` `YYYY-MM-DD`) and in the expression that
//! turns a settlement time into its day.

use std::collections::BTreeMap;

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::StoreError;
use super::drift::{TokenTotals, get};

pub use switchyard_actors::ports::NodeDayUsage;

/// A node's pool name: 1 to 63 characters of `[a-z0-9-]` (as the database checks too).
pub fn valid_pool(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// One row of `node_days`, with the node's pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeDay {
    /// The node.
    pub node_id: String,
    /// The UTC day.
    pub day: NaiveDate,
    /// The model it served.
    pub model: String,
    /// Its pool now (`None`: unassigned); a node moved to another pool reports there for
    /// its whole history.
    pub pool: Option<String>,
    /// Seconds connected that day.
    pub connected_seconds: u64,
    /// GPUs it registered with.
    pub gpus: u32,
    /// Growth of its engine's prompt-token counter that day.
    pub engine_prompt_tokens: u64,
    /// Growth of its engine's generation-token counter that day.
    pub engine_generation_tokens: u64,
    /// Whether any heartbeat of the day carried the engine's counters.
    pub engine_counters: bool,
}

/// What the ledger billed for one node's work on one UTC day, for one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeDayLedger {
    /// The node recorded on the settled rows.
    pub node_id: String,
    /// The UTC day of their settlement.
    pub day: NaiveDate,
    /// The model.
    pub model: String,
    /// Tokens billed.
    pub settled: TokenTotals,
}

/// `a + b`, saturated at the largest BIGINT (a counter near it is a lie, not an error that
/// drops the heartbeat's seconds).
macro_rules! saturating_add_sql {
    ($col:literal) => {
        concat!(
            "CASE WHEN node_days.",
            $col,
            " > 9223372036854775807 - excluded.",
            $col,
            " THEN 9223372036854775807 ELSE node_days.",
            $col,
            " + excluded.",
            $col,
            " END"
        )
    };
}

/// Adds one interval to its node's row of the day, creating it at zero. `$2` is the day in
/// the backend's type; the GPU count is the latest.
pub(super) const ADD_NODE_DAY: &str = concat!(
    "INSERT INTO node_days (node_id, day, model, connected_seconds, gpus, \
     engine_prompt_tokens, engine_generation_tokens, engine_counters) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
     ON CONFLICT (node_id, day, model) DO UPDATE SET connected_seconds = ",
    saturating_add_sql!("connected_seconds"),
    ", gpus = excluded.gpus, engine_prompt_tokens = ",
    saturating_add_sql!("engine_prompt_tokens"),
    ", engine_generation_tokens = ",
    saturating_add_sql!("engine_generation_tokens"),
    ", engine_counters = (node_days.engine_counters OR excluded.engine_counters)"
);

/// The rows of days in `[$1, $2)` with their node's pool.
pub(super) const NODE_DAYS: &str = "SELECT d.node_id, d.day, d.model, n.pool, \
     d.connected_seconds, CAST(d.gpus AS BIGINT) AS gpus, d.engine_prompt_tokens, d.engine_generation_tokens, \
     d.engine_counters FROM node_days d LEFT JOIN nodes n ON n.id = d.node_id \
     WHERE d.day >= $1 AND d.day < $2";

/// The ledger's settled tokens per node, day and model for settlements in `[$1, $2)`;
/// `$day` is the backend's expression for `settled_at`'s UTC day, named `day`.
macro_rules! node_day_ledger_sql {
    ($day:literal) => {
        concat!(
            "SELECT node_id, ",
            $day,
            " AS day, model, ",
            $crate::store::drift::split_sum!("prompt_tokens", "prompt"),
            ", ",
            $crate::store::drift::split_sum!("completion_tokens", "completion"),
            " FROM usage_ledger WHERE status = 'settled' AND node_id IS NOT NULL \
             AND settled_at >= $1 AND settled_at < $2 GROUP BY node_id, ",
            $day,
            ", model"
        )
    };
}
pub(super) use node_day_ledger_sql;

/// The first day and the day after the last of the UTC days that `[from, to)` overlaps.
pub fn days_overlapping(from: DateTime<Utc>, to: DateTime<Utc>) -> (NaiveDate, NaiveDate) {
    let first = from.date_naive();
    let last = to.date_naive();
    let midnight = last.and_hms_opt(0, 0, 0).map(|t| t.and_utc());
    let end = if midnight == Some(to) {
        last
    } else {
        last.succ_opt().unwrap_or(last)
    };
    (first, end.max(first))
}

/// Midnight UTC starting `day`.
pub fn day_start(day: NaiveDate) -> DateTime<Utc> {
    day.and_time(chrono::NaiveTime::MIN).and_utc()
}

/// A non-negative integer column into `T`.
fn count<R, T>(row: &R, name: &str) -> Result<T, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    T: TryFrom<i64>,
{
    let v: i64 = get(row, name)?;
    T::try_from(v).map_err(|_| StoreError::Invalid(format!("column {name}: {v} out of range")))
}

/// A row of [`NODE_DAYS`] whose day the caller read in its backend's type.
pub(super) fn node_day_from_row<R>(row: &R, day: NaiveDate) -> Result<NodeDay, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(NodeDay {
        node_id: get(row, "node_id")?,
        day,
        model: get(row, "model")?,
        pool: get(row, "pool")?,
        connected_seconds: count(row, "connected_seconds")?,
        gpus: count(row, "gpus")?,
        engine_prompt_tokens: count(row, "engine_prompt_tokens")?,
        engine_generation_tokens: count(row, "engine_generation_tokens")?,
        engine_counters: get(row, "engine_counters")?,
    })
}

/// A row of [`node_day_ledger_sql`] whose day the caller read in its backend's type.
pub(super) fn node_day_ledger_from_row<R>(
    row: &R,
    day: NaiveDate,
) -> Result<NodeDayLedger, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let wide = |name: &str| -> Result<u128, StoreError> {
        let hi: u64 = count(row, &format!("{name}_hi"))?;
        let lo: u64 = count(row, &format!("{name}_lo"))?;
        Ok((u128::from(hi) << 32) + u128::from(lo))
    };
    Ok(NodeDayLedger {
        node_id: get(row, "node_id")?,
        day,
        model: get(row, "model")?,
        settled: TokenTotals {
            prompt_tokens: wide("prompt")?,
            completion_tokens: wide("completion")?,
        },
    })
}

/// A stored SQLite day.
pub(super) fn parse_day(text: &str) -> Result<NaiveDate, StoreError> {
    NaiveDate::parse_from_str(text, "%Y-%m-%d")
        .map_err(|e| StoreError::Invalid(format!("column day: {text:?}: {e}")))
}

/// Rows by (node, day, model), in byte order on both backends.
pub(super) fn sort_node_days(rows: &mut [NodeDay]) {
    rows.sort_by(|a, b| {
        (a.node_id.as_bytes(), a.day, a.model.as_bytes()).cmp(&(
            b.node_id.as_bytes(),
            b.day,
            b.model.as_bytes(),
        ))
    });
}

/// Ledger rows by (node, day, model), in byte order on both backends.
pub(super) fn sort_node_day_ledger(rows: &mut [NodeDayLedger]) {
    let key = |r: &NodeDayLedger| {
        (
            r.node_id.clone().into_bytes(),
            r.day,
            r.model.clone().into_bytes(),
        )
    };
    rows.sort_by_cached_key(key);
}

/// The settled tokens per model from the drift report's totals.
pub(super) fn by_model(models: Vec<super::ModelDrift>) -> BTreeMap<String, TokenTotals> {
    models.into_iter().map(|m| (m.model, m.settled)).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn t(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn d(s: &str) -> NaiveDate {
        NaiveDate::parse_from_str(s, "%Y-%m-%d").unwrap()
    }

    #[test]
    fn days_overlapping_a_range() {
        let days = |a, b| days_overlapping(t(a), t(b));
        assert_eq!(
            days("2026-03-01T00:00:00Z", "2026-03-02T00:00:00Z"),
            (d("2026-03-01"), d("2026-03-02"))
        );
        assert_eq!(
            days("2026-03-01T23:00:00Z", "2026-03-02T00:00:01Z"),
            (d("2026-03-01"), d("2026-03-03"))
        );
        assert_eq!(
            days("2026-03-01T10:00:00Z", "2026-03-01T11:00:00Z"),
            (d("2026-03-01"), d("2026-03-02"))
        );
    }

    #[test]
    fn pool_names() {
        for ok in ["gpu-l40s", "a", &"x".repeat(63)] {
            assert!(valid_pool(ok), "{ok}");
        }
        for bad in ["", "GPU", "gpu_l40s", "gpu l40s", "é", &"x".repeat(64)] {
            assert!(!valid_pool(bad), "{bad}");
        }
    }
}
