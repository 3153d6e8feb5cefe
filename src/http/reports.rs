//! Operators' reports (SPEC section 6). `GET /admin/reports/drift?from=&to=`: per model, what
//! the ledger settled over a time range, which rows a node's usage report put under review
//! and what those nodes claimed against what was billed, with the reviewed rows themselves;
//! and per node and UTC day, what the ledger billed for the node's work against its engine's
//! own token counters (heartbeat `engine_counters`). The cost report is in `costs.rs`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use switchyard_actors::error::ErrorCode;

use super::admin::Admin;
use super::error::{ApiError, Query};
use crate::server::AppState;
use crate::store::{
    DriftReport, ModelDrift, NodeDay, NodeDayLedger, ReviewedRow, StoreError, days_overlapping,
};

/// A report's query: both ends required, RFC 3339, `from` before `to`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportQuery {
    from: Option<String>,
    to: Option<String>,
}

/// What the report says of the engines' own counters.
#[derive(Debug, Serialize)]
struct EngineCounters {
    /// Whether any node reported its engine's counters for a day of the range, so that
    /// `nodes` compares them with the ledger.
    compared: bool,
    /// How to read the comparison, for the operator reading the answer.
    note: &'static str,
}

const COMPARED: EngineCounters = EngineCounters {
    compared: true,
    note: "Per node and UTC day, the ledger's settled tokens for the node's work against its \
           engine's own counters. The engine also counts work the gateway did not bill \
           (cancelled requests, other clients, recomputation after preemption), so a \
           positive difference is expected; a negative one is not.",
};

const NOT_COMPARED: EngineCounters = EngineCounters {
    compared: false,
    note: "No node reported its engine's token counters for a day of this range (agents \
           before protocol 2, or engines without vLLM's counters); `data` compares what \
           nodes claimed with what the ledger billed.",
};

/// One node's day: what the ledger billed for its work against its engine's counters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeDrift {
    /// The node.
    pub node_id: String,
    /// The UTC day.
    pub day: chrono::NaiveDate,
    /// The model.
    pub model: String,
    /// Completion tokens the ledger settled for the node's attempts that day.
    pub ledger_completion_tokens: u128,
    /// Prompt tokens the ledger settled for them.
    pub ledger_prompt_tokens: u128,
    /// Growth of the engine's generation-token counter that day; `None` when no heartbeat
    /// of the day carried counters.
    pub engine_generation_tokens: Option<u64>,
    /// Growth of the engine's prompt-token counter that day; `None` likewise.
    pub engine_prompt_tokens: Option<u64>,
    /// Engine generation tokens minus ledger completion tokens.
    pub difference: Option<i128>,
    /// Engine generation tokens over ledger completion tokens (`None` when either is
    /// missing or the ledger has none).
    pub ratio: Option<f64>,
}

/// The per-node rows: every `node_days` row and every node-day the ledger billed, joined
/// on (node, day, model), in that order.
pub fn node_drift(days: &[NodeDay], ledger: &[NodeDayLedger]) -> Vec<NodeDrift> {
    type Key = (Vec<u8>, chrono::NaiveDate, Vec<u8>);
    let key = |node: &str, day, model: &str| -> Key {
        (node.as_bytes().to_vec(), day, model.as_bytes().to_vec())
    };
    let mut rows: std::collections::BTreeMap<Key, NodeDrift> = std::collections::BTreeMap::new();
    let blank = |node: &str, day, model: &str| NodeDrift {
        node_id: node.to_owned(),
        day,
        model: model.to_owned(),
        ledger_completion_tokens: 0,
        ledger_prompt_tokens: 0,
        engine_generation_tokens: None,
        engine_prompt_tokens: None,
        difference: None,
        ratio: None,
    };
    for d in days {
        let row = rows
            .entry(key(&d.node_id, d.day, &d.model))
            .or_insert_with(|| blank(&d.node_id, d.day, &d.model));
        if d.engine_counters {
            row.engine_generation_tokens = Some(d.engine_generation_tokens);
            row.engine_prompt_tokens = Some(d.engine_prompt_tokens);
        }
    }
    for l in ledger {
        let row = rows
            .entry(key(&l.node_id, l.day, &l.model))
            .or_insert_with(|| blank(&l.node_id, l.day, &l.model));
        row.ledger_completion_tokens = l.settled.completion_tokens;
        row.ledger_prompt_tokens = l.settled.prompt_tokens;
    }
    rows.into_values()
        .map(|mut r| {
            if let Some(engine) = r.engine_generation_tokens {
                let ledger = i128::try_from(r.ledger_completion_tokens).unwrap_or(i128::MAX);
                r.difference = Some(i128::from(engine) - ledger);
                r.ratio = (ledger > 0).then(|| engine as f64 / ledger as f64);
            }
            r
        })
        .collect()
}

/// A read of the store that failed, as the answer says it.
pub(super) fn report_failed(e: StoreError) -> ApiError {
    match e {
        StoreError::Invalid(m) => ApiError::new(ErrorCode::InvalidRequest, m),
        other => {
            tracing::error!(error = %other, "report read failed");
            ApiError::unavailable("The ledger cannot be read right now.")
        }
    }
}

/// The query's range: both ends RFC 3339, `from` before `to`.
pub(super) fn range(q: &ReportQuery) -> Result<(DateTime<Utc>, DateTime<Utc>), ApiError> {
    let from = instant(q.from.as_deref(), "from")?;
    let to = instant(q.to.as_deref(), "to")?;
    if from >= to {
        return Err(
            ApiError::new(ErrorCode::InvalidRequest, "`from` must be before `to`.")
                .with_param("to"),
        );
    }
    Ok((from, to))
}

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
    /// Per node and UTC day, every day the range overlaps.
    nodes: &'a [NodeDrift],
}

/// A required RFC 3339 instant named `name` (parsed as `/v1/usage` parses its bounds).
fn instant(value: Option<&str>, name: &str) -> Result<DateTime<Utc>, ApiError> {
    super::usage::bound(value, name)?.ok_or_else(|| {
        ApiError::new(ErrorCode::InvalidRequest, format!("`{name}` is required."))
            .with_param(name.to_owned())
    })
}

/// `GET /admin/reports/drift?from=&to=`, admin only; settlements in `[from, to)`, and the
/// per-node rows of every UTC day the range overlaps.
#[tracing::instrument(skip_all)]
pub async fn drift(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<ReportQuery>,
) -> Result<Response, ApiError> {
    let (from, to) = range(&q)?;
    let report: DriftReport = state
        .store
        .drift_report(from, to)
        .await
        .map_err(report_failed)?;
    let (first, end) = days_overlapping(from, to);
    let days = state
        .store
        .node_days(first, end)
        .await
        .map_err(report_failed)?;
    let ledger = state
        .store
        .node_day_ledger(first, end)
        .await
        .map_err(report_failed)?;
    let nodes = node_drift(&days, &ledger);
    let compared = days.iter().any(|d| d.engine_counters);
    Ok(axum::Json(DriftBody {
        object: "drift_report",
        from: report.from,
        to: report.to,
        engine_counters: if compared { COMPARED } else { NOT_COMPARED },
        data: &report.models,
        reviewed: &report.reviewed,
        reviewed_truncated: report.reviewed_truncated,
        nodes: &nodes,
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
            nodes: &[],
        };
        let text = serde_json::to_string(&body).unwrap();
        assert!(
            text.contains("\"prompt_tokens\":18446744073709551616"),
            "{text}"
        );
        assert!(text.contains("\"compared\":false"), "{text}");
    }

    #[test]
    fn node_rows_join_the_engine_and_the_ledger() {
        let day = chrono::NaiveDate::from_ymd_opt(2026, 3, 1).unwrap();
        let nd = |node: &str, counters: bool, generation| NodeDay {
            node_id: node.into(),
            day,
            model: "m".into(),
            pool: None,
            connected_seconds: 10,
            gpus: 1,
            engine_prompt_tokens: 50,
            engine_generation_tokens: generation,
            engine_counters: counters,
        };
        let led = |node: &str, completion| NodeDayLedger {
            node_id: node.into(),
            day,
            model: "m".into(),
            settled: crate::store::TokenTotals {
                prompt_tokens: 40,
                completion_tokens: completion,
            },
        };
        let rows = node_drift(
            &[nd("a", true, 120), nd("b", false, 0), nd("c", true, 5)],
            &[led("a", 100), led("b", 7), led("d", 3)],
        );
        let ids: Vec<_> = rows.iter().map(|r| r.node_id.as_str()).collect();
        assert_eq!(ids, ["a", "b", "c", "d"]);
        assert_eq!(rows[0].difference, Some(20));
        assert_eq!(rows[0].ratio, Some(1.2));
        assert_eq!(rows[0].engine_prompt_tokens, Some(50));
        assert_eq!(rows[0].ledger_prompt_tokens, 40);
        assert_eq!(
            (rows[1].engine_generation_tokens, rows[1].difference),
            (None, None)
        );
        assert_eq!(
            (rows[2].difference, rows[2].ratio),
            (Some(5), None),
            "no ledger tokens"
        );
        assert_eq!((rows[3].ledger_completion_tokens, rows[3].ratio), (3, None));
    }
}
