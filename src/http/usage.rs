//! `GET /v1/usage?from=&to=`: tokens and cost per model for the caller's team only. The team
//! comes from the verified credential, never from the request.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;
use switchyard_actors::error::ErrorCode;

use super::error::{ApiError, Query};
use crate::server::AppState;
use crate::store::LedgerStatus;

#[derive(Debug, Deserialize)]
pub struct UsageQuery {
    from: Option<String>,
    to: Option<String>,
}

/// An optional RFC 3339 bound named `name`; a malformed one is 400 naming it.
pub(super) fn bound(v: Option<&str>, name: &str) -> Result<Option<DateTime<Utc>>, ApiError> {
    v.map(|s| {
        DateTime::parse_from_rfc3339(s)
            .map(|d| d.with_timezone(&Utc))
            .map_err(|_| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("`{name}` must be an RFC 3339 time."),
                )
                .with_param(name)
            })
    })
    .transpose()
}

#[derive(Debug, Default)]
struct ModelUsage {
    requests: u64,
    prompt_tokens: i64,
    completion_tokens: i64,
    cost_microcredits: i64,
}

/// The query is taken as a `Result` so the credential is checked first: a caller without
/// one learns nothing about the parameters.
pub async fn usage(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<Query<UsageQuery>, ApiError>,
) -> Response {
    match run(&state, &headers, query).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    state: &AppState,
    headers: &HeaderMap,
    query: Result<Query<UsageQuery>, ApiError>,
) -> Result<Response, ApiError> {
    let principal = super::lifecycle::authenticate(state, headers).await?;
    let Query(q) = query?;
    let from = bound(q.from.as_deref(), "from")?;
    let to = bound(q.to.as_deref(), "to")?;
    let rows = state
        .store
        .ledger_rows(Some(principal.team_id))
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "usage read failed");
            ApiError::new(
                ErrorCode::QuotaServiceUnavailable,
                "Usage cannot be read right now.",
            )
        })?;
    let mut per_model: BTreeMap<String, ModelUsage> = BTreeMap::new();
    for row in rows {
        let in_window =
            from.is_none_or(|f| row.created_at >= f) && to.is_none_or(|t| row.created_at < t);
        if row.team_id != principal.team_id || row.status != LedgerStatus::Settled || !in_window {
            continue;
        }
        let u = per_model.entry(row.model).or_default();
        u.requests += 1;
        u.prompt_tokens += row.prompt_tokens;
        u.completion_tokens += row.completion_tokens;
        u.cost_microcredits += row.cost_microcredits;
    }
    let data: Vec<_> = per_model
        .into_iter()
        .map(|(model, u)| {
            json!({
                "model": model,
                "requests": u.requests,
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cost_microcredits": u.cost_microcredits,
            })
        })
        .collect();
    Ok(axum::Json(json!({
        "object": "usage",
        "team_id": principal.team_id,
        "from": from,
        "to": to,
        "data": data,
    }))
    .into_response())
}
