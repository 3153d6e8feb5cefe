//! The drift report's data (`GET /admin/reports/drift`): what the ledger billed per model
//! over a time range, which rows a node's report put under review, and what those nodes
//! claimed against what was billed. Both SQL stores run the statements here, so the report
//! reads the same on either backend.
//!
//! The comparison with the engines' own generation-token counters (SPEC section 6) is not
//! here: no node reports those counters yet.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{ColumnIndex, Decode, Row, Type};

use super::{Microcredits, ReviewReason, StoreError};

/// The most reviewed rows one report lists (newest first); [`DriftReport::reviewed_truncated`]
/// says when the range holds more.
pub const DRIFT_REVIEWED_LIMIT: usize = 100;

/// Settled usage and the rows under review over `[from, to)` by settlement time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DriftReport {
    /// Start of the range (inclusive).
    pub from: DateTime<Utc>,
    /// End of the range (exclusive).
    pub to: DateTime<Utc>,
    /// One entry per model with a settlement in the range, by model name.
    pub models: Vec<ModelDrift>,
    /// Rows under review settled in the range, newest first, at most
    /// [`DRIFT_REVIEWED_LIMIT`].
    pub reviewed: Vec<ReviewedRow>,
    /// The range holds more reviewed rows than [`Self::reviewed`] lists (the totals in
    /// [`Self::models`] count them all).
    pub reviewed_truncated: bool,
}

/// One model's settlements in the range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelDrift {
    /// The resolved model version.
    pub model: String,
    /// Rows settled in the range.
    pub settled_requests: u64,
    /// Tokens billed by those rows.
    pub settled: TokenTotals,
    /// Of those rows, the ones under review, by reason.
    pub under_review: ReviewCounts,
    /// What the nodes reported for the rows under review (a clamped row's claim, otherwise
    /// its bill, which was the report).
    pub reviewed_claimed: TokenTotals,
    /// What the rows under review were billed.
    pub reviewed_billed: TokenTotals,
}

/// Rows under review, by [`ReviewReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReviewCounts {
    /// [`ReviewReason::UsageOverBound`].
    pub usage_over_bound: u64,
    /// [`ReviewReason::UsageUnrepresentable`].
    pub usage_unrepresentable: u64,
    /// [`ReviewReason::UnverifiedNode`].
    pub unverified_node: u64,
}

impl ReviewCounts {
    /// Rows under review for any reason.
    pub fn total(&self) -> u64 {
        self.usage_over_bound
            .saturating_add(self.usage_unrepresentable)
            .saturating_add(self.unverified_node)
    }
}

/// Token totals over many rows: each row's counts fit in i64, their sum need not.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenTotals {
    /// Prompt tokens.
    pub prompt_tokens: u128,
    /// Completion tokens.
    pub completion_tokens: u128,
}

/// One row's token counts, as the ledger stores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenCounts {
    /// Prompt tokens.
    pub prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
}

/// A settled row under review.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReviewedRow {
    /// The request.
    pub request_id: String,
    /// The team that paid.
    pub team_id: i64,
    /// The resolved model version.
    pub model: String,
    /// Why it is under review.
    pub review: ReviewReason,
    /// What the node reported (a count beyond `i64::MAX` reads as `i64::MAX`).
    pub claimed: TokenCounts,
    /// What the ledger billed.
    pub billed: TokenCounts,
    /// The row's bounds; `None` for a row admitted before bounds existed.
    pub bounds: Option<TokenCounts>,
    /// What the team was charged.
    pub cost_microcredits: Microcredits,
    /// When it settled.
    pub settled_at: DateTime<Utc>,
}

/// A SUM of a token column split into its high and low 32 bits, `{name}_hi` and `{name}_lo`:
/// each part sums below i64 for 2^31 rows, where one SUM of counts near `i64::MAX` would
/// overflow (an error on SQLite, NUMERIC on PostgreSQL). [`wide_sum`] puts them together.
macro_rules! split_sum {
    ($expr:literal, $name:literal) => {
        concat!(
            "CAST(SUM((",
            $expr,
            ") / 4294967296) AS BIGINT) AS ",
            $name,
            "_hi, CAST(SUM((",
            $expr,
            ") % 4294967296) AS BIGINT) AS ",
            $name,
            "_lo"
        )
    };
}

pub(crate) use split_sum;

/// A row under review counted once for its reason.
macro_rules! count_reason {
    ($reason:literal) => {
        concat!(
            "CAST(SUM(CASE WHEN review = '",
            $reason,
            "' THEN 1 ELSE 0 END) AS BIGINT) AS ",
            $reason
        )
    };
}

/// Per-model totals of the rows settled in `[$1, $2)`. Both backends run this text (SQLite
/// binds `$n` by number); the partial index `usage_ledger_settled` serves the range. Rows
/// come back in no particular order: the caller sorts by name, in byte order on both.
pub(super) const DRIFT_TOTALS: &str = concat!(
    "SELECT model, COUNT(*) AS requests, ",
    split_sum!("prompt_tokens", "prompt"),
    ", ",
    split_sum!("completion_tokens", "completion"),
    ", ",
    count_reason!("usage_over_bound"),
    ", ",
    count_reason!("usage_unrepresentable"),
    ", ",
    count_reason!("unverified_node"),
    ", ",
    split_sum!(
        "CASE WHEN review IS NULL THEN 0 ELSE COALESCE(claimed_prompt_tokens, prompt_tokens) END",
        "claimed_prompt"
    ),
    ", ",
    split_sum!(
        "CASE WHEN review IS NULL THEN 0 \
         ELSE COALESCE(claimed_completion_tokens, completion_tokens) END",
        "claimed_completion"
    ),
    ", ",
    split_sum!(
        "CASE WHEN review IS NULL THEN 0 ELSE prompt_tokens END",
        "billed_prompt"
    ),
    ", ",
    split_sum!(
        "CASE WHEN review IS NULL THEN 0 ELSE completion_tokens END",
        "billed_completion"
    ),
    " FROM usage_ledger WHERE status = 'settled' AND settled_at >= $1 AND settled_at < $2 \
     GROUP BY model"
);

/// The rows under review settled in `[$1, $2)`, newest first, at most `$3`; served by the
/// partial index `usage_ledger_reviewed` (only settled rows carry a review).
pub(super) const DRIFT_REVIEWED: &str = "SELECT request_id, team_id, model, review, \
     prompt_tokens, completion_tokens, \
     COALESCE(claimed_prompt_tokens, prompt_tokens) AS claimed_prompt_tokens, \
     COALESCE(claimed_completion_tokens, completion_tokens) AS claimed_completion_tokens, \
     prompt_token_bound, completion_token_bound, cost_microcredits, settled_at \
     FROM usage_ledger WHERE review IS NOT NULL AND settled_at >= $1 AND settled_at < $2 \
     ORDER BY settled_at DESC, id DESC LIMIT $3";

/// `LIMIT` of [`DRIFT_REVIEWED`]: one more than listed, to tell a full page from a cut one.
pub(super) fn reviewed_fetch_limit() -> i64 {
    i64::try_from(DRIFT_REVIEWED_LIMIT.saturating_add(1)).unwrap_or(i64::MAX)
}

/// `Invalid` unless `from < to`.
pub(super) fn check_range(from: DateTime<Utc>, to: DateTime<Utc>) -> Result<(), StoreError> {
    if from < to {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "the report's range is empty: from {from} is not before to {to}"
        )))
    }
}

/// Reads a column; a decode failure (a corrupt or foreign row) is `Invalid`.
pub(super) fn get<'r, R, T>(row: &'r R, name: &str) -> Result<T, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    T: Decode<'r, R::Database> + Type<R::Database>,
{
    row.try_get(name)
        .map_err(|e| StoreError::Invalid(format!("column {name}: {e}")))
}

/// A count or partial sum that the schema keeps non-negative.
fn count<R>(row: &R, name: &str) -> Result<u64, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let v: i64 = get(row, name)?;
    u64::try_from(v).map_err(|_| StoreError::Invalid(format!("column {name}: {v} < 0")))
}

/// A [`split_sum!`] put back together.
pub(super) fn wide_sum<R>(row: &R, name: &str) -> Result<u128, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let hi = count(row, &format!("{name}_hi"))?;
    let lo = count(row, &format!("{name}_lo"))?;
    Ok((u128::from(hi) << 32) + u128::from(lo))
}

/// A row of [`DRIFT_TOTALS`].
pub(super) fn model_drift_from_row<R>(row: &R) -> Result<ModelDrift, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let totals = |prompt: &str, completion: &str| -> Result<TokenTotals, StoreError> {
        Ok(TokenTotals {
            prompt_tokens: wide_sum(row, prompt)?,
            completion_tokens: wide_sum(row, completion)?,
        })
    };
    Ok(ModelDrift {
        model: get(row, "model")?,
        settled_requests: count(row, "requests")?,
        settled: totals("prompt", "completion")?,
        under_review: ReviewCounts {
            usage_over_bound: count(row, "usage_over_bound")?,
            usage_unrepresentable: count(row, "usage_unrepresentable")?,
            unverified_node: count(row, "unverified_node")?,
        },
        reviewed_claimed: totals("claimed_prompt", "claimed_completion")?,
        reviewed_billed: totals("billed_prompt", "billed_completion")?,
    })
}

/// A row of [`DRIFT_REVIEWED`]; `settled_at` is read by the caller, in its backend's type.
pub(super) fn reviewed_from_row<R>(
    row: &R,
    settled_at: DateTime<Utc>,
) -> Result<ReviewedRow, StoreError>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    let review: String = get(row, "review")?;
    let bounds = match (
        get::<_, Option<i64>>(row, "prompt_token_bound")?,
        get::<_, Option<i64>>(row, "completion_token_bound")?,
    ) {
        (Some(prompt_tokens), Some(completion_tokens)) => Some(TokenCounts {
            prompt_tokens,
            completion_tokens,
        }),
        _ => None,
    };
    Ok(ReviewedRow {
        request_id: get(row, "request_id")?,
        team_id: get(row, "team_id")?,
        model: get(row, "model")?,
        review: parse_review(&review)?,
        claimed: TokenCounts {
            prompt_tokens: get(row, "claimed_prompt_tokens")?,
            completion_tokens: get(row, "claimed_completion_tokens")?,
        },
        billed: TokenCounts {
            prompt_tokens: get(row, "prompt_tokens")?,
            completion_tokens: get(row, "completion_tokens")?,
        },
        bounds,
        cost_microcredits: get(row, "cost_microcredits")?,
        settled_at,
    })
}

/// A stored `review`.
pub(super) fn parse_review(text: &str) -> Result<ReviewReason, StoreError> {
    ReviewReason::parse(text)
        .ok_or_else(|| StoreError::Invalid(format!("column review: {text:?} is not a reason")))
}

/// The report from its two queries' rows: models by name (byte order, the same on both
/// backends whatever PostgreSQL's collation), the reviewed list cut at the limit.
pub(super) fn assemble(
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    mut models: Vec<ModelDrift>,
    mut reviewed: Vec<ReviewedRow>,
) -> DriftReport {
    models.sort_by(|a, b| a.model.as_bytes().cmp(b.model.as_bytes()));
    let reviewed_truncated = reviewed.len() > DRIFT_REVIEWED_LIMIT;
    reviewed.truncate(DRIFT_REVIEWED_LIMIT);
    DriftReport {
        from,
        to,
        models,
        reviewed,
        reviewed_truncated,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn split_sums_are_exact_past_i64() {
        // Two rows of i64::MAX: the parts a database would return, put back together.
        let max = u128::from(u64::try_from(i64::MAX).unwrap());
        let (hi, lo) = (max >> 32, max & 0xffff_ffff);
        let (hi2, lo2) = (2 * hi, 2 * lo);
        assert!(hi2 < u128::from(u64::MAX) && lo2 < u128::from(u64::MAX));
        assert_eq!((hi2 << 32) + lo2, 2 * max);
    }

    #[test]
    fn an_empty_range_is_invalid() {
        let t = Utc::now();
        assert!(check_range(t, t).is_err());
        assert!(check_range(t, t - chrono::Duration::milliseconds(1)).is_err());
        assert!(check_range(t, t + chrono::Duration::milliseconds(1)).is_ok());
    }

    #[test]
    fn the_reviewed_list_is_cut_at_the_limit() {
        let t = Utc::now();
        let row = |i: usize| ReviewedRow {
            request_id: format!("r{i}"),
            team_id: 1,
            model: "m".to_owned(),
            review: ReviewReason::UsageOverBound,
            claimed: TokenCounts {
                prompt_tokens: 1,
                completion_tokens: 1,
            },
            billed: TokenCounts {
                prompt_tokens: 1,
                completion_tokens: 1,
            },
            bounds: None,
            cost_microcredits: 0,
            settled_at: t,
        };
        let full = assemble(t, t, vec![], (0..DRIFT_REVIEWED_LIMIT).map(row).collect());
        assert_eq!(
            (full.reviewed.len(), full.reviewed_truncated),
            (DRIFT_REVIEWED_LIMIT, false)
        );
        let cut = assemble(t, t, vec![], (0..=DRIFT_REVIEWED_LIMIT).map(row).collect());
        assert_eq!(
            (cut.reviewed.len(), cut.reviewed_truncated),
            (DRIFT_REVIEWED_LIMIT, true)
        );
        assert_eq!(cut.reviewed[0].request_id, "r0", "the newest are kept");
    }
}
