//! Operators' reports (SPEC section 6). `GET /admin/reports/drift?from=&to=`: per model, what
//! the ledger settled over a time range, which rows a node's usage report put under review
//! and what those nodes claimed against what was billed, with the reviewed rows themselves.
//!
//! The SPEC's comparison with the engines' own generation-token counters is not made yet: no
//! node reports those counters. The answer says so in `engine_counters`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use switchyard_actors::error::ErrorCode;

use super::admin::Admin;
use super::error::{ApiError, Query};
use crate::server::AppState;
use crate::store::{DriftReport, ModelDrift, ReviewedRow, StoreError};

/// The drift report's query: both ends required, RFC 3339, `from` before `to`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriftQuery {
    from: Option<String>,
    to: Option<String>,
}

/// What the report says of the engines' own counters until nodes report them.
#[derive(Debug, Serialize)]
struct EngineCounters {
    /// Whether settled tokens were compared with the engines' own counters.
    compared: bool,
    /// Why not, for the operator reading the answer.
    note: &'static str,
}

const NOT_COMPARED: EngineCounters = EngineCounters {
    compared: false,
    note: "Nodes do not report their engines' generation-token counters yet; this report \
           compares what nodes claimed with what the ledger billed.",
};

/// The answer. Written out rather than `json!`: token totals are u128 (a sum of i64 counts),
/// which serde_json writes as exact integers but cannot hold in a `Value`.
#[derive(Debug, Serialize)]
struct DriftBody<'a> {
    object: &'static str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    engine_counters: EngineCounters,
    data: &'a [ModelDrift],
    reviewed: &'a [ReviewedRow],
    reviewed_truncated: bool,
}

/// A required RFC 3339 instant named `name` (parsed as `/v1/usage` parses its bounds).
fn instant(value: Option<&str>, name: &str) -> Result<DateTime<Utc>, ApiError> {
    super::usage::bound(value, name)?.ok_or_else(|| {
        ApiError::new(ErrorCode::InvalidRequest, format!("`{name}` is required."))
            .with_param(name.to_owned())
    })
}

/// `GET /admin/reports/drift?from=&to=`, admin only; settlements in `[from, to)`.
#[tracing::instrument(skip_all)]
pub async fn drift(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<DriftQuery>,
) -> Result<Response, ApiError> {
    let from = instant(q.from.as_deref(), "from")?;
    let to = instant(q.to.as_deref(), "to")?;
    if from >= to {
        return Err(
            ApiError::new(ErrorCode::InvalidRequest, "`from` must be before `to`.")
                .with_param("to"),
        );
    }
    let report: DriftReport = state
        .store
        .drift_report(from, to)
        .await
        .map_err(|e| match e {
            StoreError::Invalid(m) => ApiError::new(ErrorCode::InvalidRequest, m),
            other => {
                tracing::error!(error = %other, "drift report read failed");
                ApiError::unavailable("The ledger cannot be read right now.")
            }
        })?;
    Ok(axum::Json(DriftBody {
        object: "drift_report",
        from: report.from,
        to: report.to,
        engine_counters: NOT_COMPARED,
        data: &report.models,
        reviewed: &report.reviewed,
        reviewed_truncated: report.reviewed_truncated,
    })
    .into_response())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_required_rfc3339() {
        assert_eq!(
            instant(Some("2026-01-02T03:04:05Z"), "from")
                .unwrap()
                .to_rfc3339(),
            "2026-01-02T03:04:05+00:00"
        );
        assert_eq!(
            instant(Some("2026-01-02T04:04:05+01:00"), "from").unwrap(),
            instant(Some("2026-01-02T03:04:05Z"), "from").unwrap()
        );
        for bad in [None, Some(""), Some("2026-01-02"), Some("yesterday")] {
            let err = instant(bad, "to").unwrap_err();
            assert_eq!(err.failure.code, ErrorCode::InvalidRequest);
            assert_eq!(err.param.as_deref(), Some("to"));
        }
    }

    #[test]
    fn totals_beyond_u64_serialize_exactly() {
        let model = ModelDrift {
            model: "m".to_owned(),
            settled_requests: 2,
            settled: crate::store::TokenTotals {
                prompt_tokens: u128::from(u64::MAX) + 1,
                completion_tokens: 0,
            },
            under_review: crate::store::ReviewCounts::default(),
            reviewed_claimed: crate::store::TokenTotals::default(),
            reviewed_billed: crate::store::TokenTotals::default(),
        };
        let body = DriftBody {
            object: "drift_report",
            from: DateTime::UNIX_EPOCH,
            to: DateTime::UNIX_EPOCH,
            engine_counters: NOT_COMPARED,
            data: std::slice::from_ref(&model),
            reviewed: &[],
            reviewed_truncated: false,
        };
        let text = serde_json::to_string(&body).unwrap();
        assert!(
            text.contains("\"prompt_tokens\":18446744073709551616"),
            "{text}"
        );
        assert!(text.contains("\"compared\":false"), "{text}");
    }
}
