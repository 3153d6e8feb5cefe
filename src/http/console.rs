//! The operator's console: a small web page embedded in the binary (`src/console/`: the page,
//! its ES modules and its style), served at `/console` under a strict Content-Security-Policy,
//! that talks only to the admin API; and the admin API's reads it needs beyond the records — usage per day, team and model
//! (`GET /admin/usage`, JSON or CSV), a team's credit history (`GET /admin/credits`) and the
//! last hour of every model's queue (`GET /admin/queues`).

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Days, Utc};
use serde::Deserialize;
use serde_json::json;

use super::admin::{Admin, TeamRef, invalid, resolve_team, store_failed};
use super::error::{ApiError, Path, Query};
use crate::recent::{Recent, WINDOW_MINUTES};
use crate::server::AppState;
use crate::store::usage::CREDIT_HISTORY_LIMIT;
use switchyard_actors::error::ErrorCode;

const PAGE: &str = include_str!("../console/index.html");

const JS: &str = "text/javascript; charset=utf-8";

/// The page's files under `/console/`: the entry module, the modules it imports, the style.
const ASSETS: [(&str, &str, &str); 9] = [
    ("app.js", JS, include_str!("../console/app.js")),
    ("ui.js", JS, include_str!("../console/ui.js")),
    ("charts.js", JS, include_str!("../console/charts.js")),
    ("teams.js", JS, include_str!("../console/teams.js")),
    ("keys.js", JS, include_str!("../console/keys.js")),
    ("usage.js", JS, include_str!("../console/usage.js")),
    ("live.js", JS, include_str!("../console/live.js")),
    ("reports.js", JS, include_str!("../console/reports.js")),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("../console/app.css"),
    ),
];

/// Everything the page loads comes from this origin; nothing runs inline; no framing.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Longest usage range, days.
const MAX_USAGE_DAYS: u64 = 400;
/// Default usage range, days (ending with today).
const DEFAULT_USAGE_DAYS: u64 = 7;

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
            (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        ],
        body,
    )
        .into_response()
}

/// `GET /console`: the page (public: it holds no data; every call it makes is authorised).
pub async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

/// `GET /console/{file}`: one of [`ASSETS`]; anything else is 404.
pub async fn file(Path(name): Path<String>) -> Result<Response, ApiError> {
    ASSETS
        .iter()
        .find(|(file, _, _)| *file == name)
        .map(|(_, content_type, body)| asset(content_type, body))
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "No such file.").with_param("file"))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    from: Option<String>,
    to: Option<String>,
    team: Option<String>,
    format: Option<String>,
}

/// `GET /admin/usage?from=&to=&team=&format=`: settled usage of the requests admitted in
/// `[from, to)` (default: the last 7 UTC days, today included), per UTC day, team and
/// model; `format=csv` answers the same rows as CSV.
pub async fn usage(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<UsageQuery>,
) -> Result<Response, ApiError> {
    let csv = match q.format.as_deref() {
        None | Some("json") => false,
        Some("csv") => true,
        Some(_) => return Err(invalid("format", "`format` is `json` or `csv`.")),
    };
    let today = state.clock.wall().date_naive();
    let tomorrow = today.checked_add_days(Days::new(1)).unwrap_or(today);
    let to = super::usage::bound(q.to.as_deref(), "to")?
        .unwrap_or_else(|| crate::store::day_start(tomorrow));
    let from = match super::usage::bound(q.from.as_deref(), "from")? {
        Some(from) => from,
        None => to
            .checked_sub_days(Days::new(DEFAULT_USAGE_DAYS))
            .unwrap_or(to),
    };
    if from >= to {
        return Err(invalid("to", "`from` must be before `to`."));
    }
    if to.signed_duration_since(from).num_days() > MAX_USAGE_DAYS as i64 {
        return Err(invalid(
            "from",
            format!("The range is at most {MAX_USAGE_DAYS} days."),
        ));
    }
    let team = match q.team.filter(|t| !t.is_empty()) {
        Some(t) => Some(resolve_team(&state, &TeamRef::from_query(t), "team").await?),
        None => None,
    };
    let rows = state
        .store
        .usage_by_day(from, to, team.as_ref().map(|t| t.id))
        .await
        .map_err(store_failed("usage"))?;
    let names: std::collections::BTreeMap<i64, String> = match &team {
        Some(t) => [(t.id, t.name.clone())].into(),
        None => state
            .store
            .teams()
            .await
            .map_err(store_failed("list teams"))?
            .into_iter()
            .map(|t| (t.id, t.name))
            .collect(),
    };
    let name = |id: i64| names.get(&id).cloned().unwrap_or_default();
    if csv {
        return Ok(usage_csv(&rows, &name, from, to));
    }
    let data: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "day": r.day,
                "team_id": r.team_id,
                "team": name(r.team_id),
                "model": r.model,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cost_microcredits": r.cost_microcredits,
            })
        })
        .collect();
    Ok(
        axum::Json(json!({ "object": "usage_report", "from": from, "to": to, "data": data }))
            .into_response(),
    )
}

/// One CSV field: quoted when it holds a comma, quote or line break (RFC 4180), and
/// prefixed with `'` when it starts with `=`, `+`, `-`, `@`, a tab or a CR, which a
/// spreadsheet would read as a formula (OWASP's CSV injection advice): a team's name is
/// whatever an admin typed, and the file is opened by someone else.
fn csv_field(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        format!("'{s}")
    } else {
        s.to_owned()
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

/// The usage rows as CSV (text fields through [`csv_field`]).
fn usage_csv(
    rows: &[crate::store::usage::UsageDay],
    name: &dyn Fn(i64) -> String,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Response {
    let mut out = String::from(
        "day,team_id,team,model,requests,prompt_tokens,completion_tokens,cost_microcredits\r\n",
    );
    for r in rows {
        let _ = write!(
            out,
            "{},{},{},{},{},{},{},{}\r\n",
            r.day,
            r.team_id,
            csv_field(&name(r.team_id)),
            csv_field(&r.model),
            r.requests,
            r.prompt_tokens,
            r.completion_tokens,
            r.cost_microcredits
        );
    }
    let disposition = format!(
        "attachment; filename=\"usage-{}-{}.csv\"",
        from.format("%Y%m%d"),
        to.format("%Y%m%d")
    );
    let mut response = (StatusCode::OK, out).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/csv; charset=utf-8"),
    );
    if let Ok(v) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    response
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreditsQuery {
    team: Option<String>,
}

/// `GET /admin/credits?team=`: the team's credits and corrections, newest first (at most
/// [`CREDIT_HISTORY_LIMIT`]).
pub async fn credits(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<CreditsQuery>,
) -> Result<Response, ApiError> {
    let Some(team) = q.team.map(TeamRef::from_query) else {
        return Err(invalid("team", "`team` is required."));
    };
    let team = resolve_team(&state, &team, "team").await?;
    let data = state
        .store
        .credit_entries(team.id, CREDIT_HISTORY_LIMIT)
        .await
        .map_err(store_failed("credit history"))?;
    Ok(axum::Json(json!({ "team_id": team.id, "data": data })).into_response())
}

/// `GET /admin/queues`: every configured model's queue now (depth, nodes) and its last hour
/// as this replica saw it, minute by minute; `""` holds the requests refused before a model
/// was known (authentication, limits, malformed requests).
pub async fn queues(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
) -> Result<Response, ApiError> {
    let mut history = Recent::global().snapshot();
    let mut data = Vec::new();
    for (model, queue) in &state.queues {
        let stats = queue.stats().await;
        data.push(json!({
            "model": model,
            "depth": stats.as_ref().map(|s| s.waiting),
            // Of them, by service tier: the owner's line holds every replica's.
            "waiting_by_tier": stats.as_ref().map(|s| {
                let [priority, default, flex] = s.waiting_by_tier;
                json!({"priority": priority, "default": default, "flex": flex})
            }),
            "nodes": stats.as_ref().map(|s| s.nodes.len()),
            "owner": stats.as_ref().and_then(|s| s.owner.clone()),
            "minutes": history.remove(model).unwrap_or_default(),
        }));
    }
    let before_model = history.remove("").unwrap_or_default();
    Ok(axum::Json(json!({
        "window_seconds": WINDOW_MINUTES * 60,
        "replica_id": state.replica_id,
        "data": data,
        "before_model": before_model,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn csv_cells_that_a_spreadsheet_would_run_are_quoted_out() {
        for (name, cell) in [
            (
                "=HYPERLINK(\"http://x\")",
                "\"'=HYPERLINK(\"\"http://x\"\")\"",
            ),
            ("+1+1", "'+1+1"),
            ("-2+3", "'-2+3"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\t=1", "'\t=1"),
            ("\r=1", "\"'\r=1\""),
            ("=1,2", "\"'=1,2\""),
            ("demo", "demo"),
            ("a=b", "a=b"),
            ("", ""),
        ] {
            assert_eq!(csv_field(name), cell, "{name:?}");
        }
    }

    #[tokio::test]
    async fn the_usage_export_writes_a_formula_team_name_as_text() {
        let day = chrono::NaiveDate::from_ymd_opt(2026, 11, 6).unwrap();
        let rows = [crate::store::usage::UsageDay {
            day,
            team_id: 7,
            model: "m".into(),
            requests: 1,
            prompt_tokens: 2,
            completion_tokens: 3,
            cost_microcredits: 4,
        }];
        let name = |_: i64| "=cmd|' /C calc'!A0".to_owned();
        let response = usage_csv(&rows, &name, Utc::now(), Utc::now());
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert_eq!(
            text.lines().nth(1),
            Some("2026-11-06,7,'=cmd|' /C calc'!A0,m,1,2,3,4")
        );
    }
}
