//! `GET /admin/reports/cost?from=&to=` (SPEC section 6): GPU hours per pool and model from
//! the nodes' connected time, what they cost at the pools' configured prices, USD per million
//! settled tokens per model, and the month's spend against the configured budget with a
//! linear projection to the month's end. And `PUT /admin/nodes/{id}/pool`, which files a
//! node's hours under a pool.
//!
//! Sums are integers (GPU-seconds, micro-USD) so they are exact whatever the order; the
//! answer shows them as decimal hours and dollars.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Datelike, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use switchyard_actors::error::ErrorCode;

use super::admin::{Admin, check_node_id};
use super::error::{ApiError, Json, Path, Query};
use super::reports::{ReportQuery, range, report_failed};
use crate::config::CostSettings;
use crate::server::AppState;
use crate::store::{NodeDay, StoreError, TokenTotals, day_start, days_overlapping, valid_pool};

/// The pool of a node an operator has not filed under one.
pub const UNASSIGNED: &str = "unassigned";

/// One pool and model's GPU time in the range.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolCost {
    /// The pool.
    pub pool: String,
    /// The model.
    pub model: String,
    /// Connected seconds times GPUs, over 3,600.
    pub gpu_hours: f64,
    /// The pool's configured price.
    pub usd_per_gpu_hour: f64,
    /// `gpu_hours` times the price.
    pub usd: f64,
}

/// One model's cost against what it served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCost {
    /// The model.
    pub model: String,
    /// Its GPU hours over every pool.
    pub gpu_hours: f64,
    /// What they cost.
    pub usd: f64,
    /// Settled prompt tokens in the range.
    pub prompt_tokens: u128,
    /// Settled completion tokens in the range.
    pub completion_tokens: u128,
    /// Prompt plus completion.
    pub tokens: u128,
    /// `usd` per million `tokens`; `None` when it served none.
    pub usd_per_million_tokens: Option<f64>,
}

/// The month's spend against the budget.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budget {
    /// The calendar month (UTC), `YYYY-MM`.
    pub month: String,
    /// The configured budget; `None` when there is none.
    pub monthly_usd: Option<f64>,
    /// GPU spend from the month's first day to now.
    pub month_to_date_usd: f64,
    /// `month_to_date_usd` extended linearly to the month's end.
    pub projected_usd: f64,
    /// The projection exceeds the budget (false without one).
    pub over_budget: bool,
}

/// GPU-seconds and micro-USD, summed exactly.
#[derive(Debug, Clone, Copy, Default)]
struct Spend {
    gpu_seconds: u128,
    micro_usd: u128,
}

impl Spend {
    fn add(&mut self, row: &NodeDay, micro_usd_per_hour: i64) {
        let gpu_seconds = u128::from(row.connected_seconds) * u128::from(row.gpus);
        self.gpu_seconds += gpu_seconds;
        // Rounded per row to the micro-dollar: a row is at most one node's day.
        let price = u128::try_from(micro_usd_per_hour).unwrap_or(0);
        self.micro_usd += (gpu_seconds * price + 1_800) / 3_600;
    }

    fn hours(self) -> f64 {
        self.gpu_seconds as f64 / 3_600.0
    }

    fn usd(self) -> f64 {
        self.micro_usd as f64 / 1e6
    }
}

fn pool_of(row: &NodeDay) -> &str {
    row.pool.as_deref().unwrap_or(UNASSIGNED)
}

/// Per pool and model, and per model with its settled tokens.
pub fn costs(
    rows: &[NodeDay],
    tokens: &BTreeMap<String, TokenTotals>,
    prices: &CostSettings,
) -> (Vec<PoolCost>, Vec<ModelCost>) {
    let mut by_pool: BTreeMap<(&str, &str), Spend> = BTreeMap::new();
    let mut by_model: BTreeMap<&str, Spend> = BTreeMap::new();
    for row in rows {
        let price = prices.micro_usd_per_gpu_hour(pool_of(row));
        by_pool
            .entry((pool_of(row), row.model.as_str()))
            .or_default()
            .add(row, price);
        by_model
            .entry(row.model.as_str())
            .or_default()
            .add(row, price);
    }
    for model in tokens.keys() {
        by_model.entry(model.as_str()).or_default();
    }
    let pools = by_pool
        .into_iter()
        .map(|((pool, model), spend)| PoolCost {
            pool: pool.to_owned(),
            model: model.to_owned(),
            gpu_hours: spend.hours(),
            usd_per_gpu_hour: prices.micro_usd_per_gpu_hour(pool) as f64 / 1e6,
            usd: spend.usd(),
        })
        .collect();
    let models = by_model
        .into_iter()
        .map(|(model, spend)| {
            let settled = tokens.get(model).copied().unwrap_or_default();
            let total = settled.prompt_tokens + settled.completion_tokens;
            ModelCost {
                model: model.to_owned(),
                gpu_hours: spend.hours(),
                usd: spend.usd(),
                prompt_tokens: settled.prompt_tokens,
                completion_tokens: settled.completion_tokens,
                tokens: total,
                usd_per_million_tokens: (total > 0).then(|| spend.micro_usd as f64 / total as f64),
            }
        })
        .collect();
    (pools, models)
}

/// The first day of `now`'s month and of the next.
fn month_of(now: DateTime<Utc>) -> (NaiveDate, NaiveDate) {
    let first = now.date_naive().with_day(1).unwrap_or(now.date_naive());
    let next = first
        .checked_add_months(chrono::Months::new(1))
        .unwrap_or(first);
    (first, next)
}

/// The month's spend so far (the rows of its days) and its projection at `now`.
pub fn budget(rows: &[NodeDay], prices: &CostSettings, now: DateTime<Utc>) -> Budget {
    let (first, next) = month_of(now);
    let mut spend = Spend::default();
    for row in rows.iter().filter(|r| r.day >= first && r.day < next) {
        spend.add(row, prices.micro_usd_per_gpu_hour(pool_of(row)));
    }
    let elapsed = (now - day_start(first)).num_seconds().max(1);
    let length = (day_start(next) - day_start(first))
        .num_seconds()
        .max(elapsed);
    let month_to_date = spend.usd();
    let projected = month_to_date * length as f64 / elapsed as f64;
    let monthly = prices.monthly_budget_micro_usd().map(|m| m as f64 / 1e6);
    Budget {
        month: first.format("%Y-%m").to_string(),
        monthly_usd: monthly,
        month_to_date_usd: month_to_date,
        projected_usd: projected,
        over_budget: monthly.is_some_and(|m| projected > m),
    }
}

#[derive(Debug, Serialize)]
struct CostBody {
    object: &'static str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    /// The UTC days whose node hours are counted: every day the range overlaps.
    days: [NaiveDate; 2],
    data: Vec<PoolCost>,
    models: Vec<ModelCost>,
    budget: Budget,
}

/// `GET /admin/reports/cost?from=&to=`, admin only.
#[tracing::instrument(skip_all)]
pub async fn cost(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<ReportQuery>,
) -> Result<Response, ApiError> {
    let (from, to) = range(&q)?;
    let (first, end) = days_overlapping(from, to);
    let now = state.clock.wall();
    let (month, next_month) = month_of(now);
    let store = &state.store;
    let rows = store.node_days(first, end).await.map_err(report_failed)?;
    let month_rows = store
        .node_days(month, next_month)
        .await
        .map_err(report_failed)?;
    let tokens = store
        .settled_by_model(from, to)
        .await
        .map_err(report_failed)?;
    let prices = &state.config.costs;
    let (data, models) = costs(&rows, &tokens, prices);
    Ok(axum::Json(CostBody {
        object: "cost_report",
        from,
        to,
        days: [first, end.pred_opt().unwrap_or(end).max(first)],
        data,
        models,
        budget: budget(&month_rows, prices, now),
    })
    .into_response())
}

/// The body of `PUT /admin/nodes/{id}/pool`; `null` clears the pool.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetPool {
    pool: Option<String>,
}

/// `PUT /admin/nodes/{id}/pool {pool}`, admin only.
pub async fn set_pool(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<String>,
    Json(body): Json<SetPool>,
) -> Result<Response, ApiError> {
    check_node_id(&id, "id")?;
    if body.pool.as_deref().is_some_and(|p| !valid_pool(p)) {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "A pool name is 1 to 63 characters of a-z, 0-9 and -.",
        )
        .with_param("pool"));
    }
    state
        .store
        .set_node_pool(&id, body.pool.as_deref())
        .await
        .map_err(|e| match e {
            StoreError::NotFound => ApiError::new(ErrorCode::NotFound, "Unknown node."),
            StoreError::Invalid(m) => {
                ApiError::new(ErrorCode::InvalidRequest, m).with_param("pool")
            }
            other => report_failed(other),
        })?;
    tracing::info!(node_id = %id, pool = ?body.pool, "node pool set");
    Ok((
        StatusCode::OK,
        axum::Json(json!({ "node_id": id, "pool": body.pool.as_deref().unwrap_or(UNASSIGNED) })),
    )
        .into_response())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn row(pool: Option<&str>, model: &str, day: &str, seconds: u64, gpus: u32) -> NodeDay {
        NodeDay {
            node_id: "n".into(),
            day: NaiveDate::parse_from_str(day, "%Y-%m-%d").unwrap(),
            model: model.into(),
            pool: pool.map(str::to_owned),
            connected_seconds: seconds,
            gpus,
            engine_prompt_tokens: 0,
            engine_generation_tokens: 0,
            engine_counters: false,
        }
    }

    fn prices() -> CostSettings {
        CostSettings {
            monthly_budget_usd: Some(100.0),
            pools: [("gpu-l40s".to_owned(), 2.0), ("unassigned".to_owned(), 1.0)].into(),
        }
    }

    #[test]
    fn gpu_hours_and_money_per_pool_and_model() {
        let rows = [
            row(Some("gpu-l40s"), "m", "2026-03-01", 3_600, 2),
            row(Some("gpu-l40s"), "m", "2026-03-02", 1_800, 2),
            row(None, "m", "2026-03-01", 3_600, 1),
            row(Some("other"), "e", "2026-03-01", 3_600, 8),
        ];
        let tokens = [(
            "m".to_owned(),
            TokenTotals {
                prompt_tokens: 1_000_000,
                completion_tokens: 1_000_000,
            },
        )]
        .into();
        let (pools, models) = costs(&rows, &tokens, &prices());
        let find = |p: &str| pools.iter().find(|c| c.pool == p).unwrap();
        assert_eq!(find("gpu-l40s").gpu_hours, 3.0);
        assert_eq!(find("gpu-l40s").usd, 6.0);
        assert_eq!(find(UNASSIGNED).usd, 1.0);
        assert_eq!((find("other").gpu_hours, find("other").usd), (8.0, 0.0));
        let m = models.iter().find(|c| c.model == "m").unwrap();
        assert_eq!((m.gpu_hours, m.usd, m.tokens), (4.0, 7.0, 2_000_000));
        assert_eq!(m.usd_per_million_tokens, Some(3.5));
        let e = models.iter().find(|c| c.model == "e").unwrap();
        assert_eq!(e.usd_per_million_tokens, None, "no tokens, no ratio");
    }

    #[test]
    fn the_month_is_projected_linearly() {
        // March has 31 days; at noon on the 11th, 10.5 days have passed.
        let now = DateTime::parse_from_rfc3339("2026-03-11T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let rows = [
            row(Some("gpu-l40s"), "m", "2026-03-01", 36_000, 1), // $20
            row(Some("gpu-l40s"), "m", "2026-02-28", 36_000, 1), // last month
        ];
        let b = budget(&rows, &prices(), now);
        assert_eq!(b.month, "2026-03");
        assert_eq!(b.month_to_date_usd, 20.0);
        assert!((b.projected_usd - 20.0 * 31.0 / 10.5).abs() < 1e-9);
        assert!(!b.over_budget);
        let rows = [row(Some("gpu-l40s"), "m", "2026-03-01", 36_000 * 3, 1)]; // $60
        assert!(budget(&rows, &prices(), now).over_budget);
        let none = budget(&rows, &CostSettings::default(), now);
        assert_eq!((none.monthly_usd, none.over_budget), (None, false));
    }
}
