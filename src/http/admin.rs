//! The admin API (SPEC section 6): teams, keys, credits and node tokens, for operators.
//! Authorised by the bootstrap admin token (compared in constant time); JWTs with the
//! `admin` role join later. Secrets are returned exactly once, at creation; only their
//! hashes are stored.

use std::sync::{Arc, PoisonError};

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use switchyard_actors::error::ErrorCode;

use super::error::{ApiError, Json};
use crate::server::AppState;
use crate::store::{
    API_KEY_PREFIX, NODE_TOKEN_PREFIX, NewApiKey, StoreError, Team, display_prefix, hash_secret,
    new_secret,
};

/// Proof that the caller presented the bootstrap admin token (compared in constant time).
/// Taking it as a handler argument is what makes a route admin-only.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<Arc<AppState>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        let presented = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::new(ErrorCode::Unauthorized, "Missing bearer credential."))?;
        let forbidden = || ApiError::new(ErrorCode::Forbidden, "Admin rights are required.");
        // A JWT with the admin role, verified against the JWKS.
        if let Some(verdict) = state.auth.admin_jwt(&parts.headers).await {
            return if verdict? {
                Ok(Admin)
            } else {
                Err(forbidden())
            };
        }
        let expected = state.config.admin_token.as_deref().unwrap_or_default();
        if !expected.is_empty() && bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
            Ok(Admin)
        } else {
            Err(forbidden())
        }
    }
}

fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::NotFound => ApiError::new(ErrorCode::NotFound, "Not found."),
        StoreError::Conflict(m) | StoreError::Invalid(m) => {
            ApiError::new(ErrorCode::InvalidRequest, m)
        }
        StoreError::Unavailable(_) => ApiError::new(
            ErrorCode::QuotaServiceUnavailable,
            "The database is unavailable.",
        ),
    }
}

/// A team named in a body by its id or its unique name.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TeamRef {
    /// By id.
    Id(i64),
    /// By name.
    Name(String),
}

async fn resolve_team(state: &AppState, team: &TeamRef) -> Result<Team, ApiError> {
    let found = match team {
        TeamRef::Id(id) => state.store.team(*id).await,
        TeamRef::Name(name) => state.store.team_by_name(name).await,
    }
    .map_err(store_error)?;
    found.ok_or_else(|| ApiError::new(ErrorCode::NotFound, "Unknown team."))
}

fn ok<T: serde::Serialize>(status: StatusCode, body: T) -> Response {
    (status, axum::Json(body)).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTeam {
    name: String,
}

pub async fn create_team(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<NewTeam>,
) -> Result<Response, ApiError> {
    let team = state
        .store
        .create_team(&body.name)
        .await
        .map_err(store_error)?;
    tracing::info!(team_id = team.id, "team created");
    Ok(ok(StatusCode::CREATED, team))
}

pub async fn list_teams(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
) -> Result<Response, ApiError> {
    let teams = state.store.teams().await.map_err(store_error)?;
    Ok(ok(StatusCode::OK, json!({ "data": teams })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    team: TeamRef,
    #[serde(default)]
    model_allowlist: Option<Vec<String>>,
    #[serde(default)]
    rpm: Option<u32>,
    #[serde(default)]
    tokens_per_day: Option<u64>,
    #[serde(default)]
    max_streams: Option<u32>,
    #[serde(default)]
    expires_at: Option<DateTime<Utc>>,
    #[serde(default)]
    message_quota: Option<u32>,
    #[serde(default)]
    burst_capacity: Option<u32>,
    #[serde(default)]
    burst_refill_seconds: Option<u32>,
}

pub async fn create_key(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<NewKey>,
) -> Result<Response, ApiError> {
    let team = resolve_team(&state, &body.team).await?;
    if let Some(models) = &body.model_allowlist
        && let Some(unknown) = models
            .iter()
            .find(|m| state.config.resolve_model(m).is_none())
    {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("Unknown model `{unknown}` in the allowlist."),
        ));
    }
    let secret = new_secret(API_KEY_PREFIX).map_err(store_error)?;
    let record = state
        .store
        .create_api_key(NewApiKey {
            team_id: team.id,
            hash: hash_secret(&secret),
            prefix: display_prefix(&secret),
            model_allowlist: body.model_allowlist,
            rpm: body.rpm,
            tokens_per_day: body.tokens_per_day,
            max_streams: body.max_streams,
            expires_at: body.expires_at,
            message_quota: body.message_quota,
            burst_capacity: body.burst_capacity,
            burst_refill_seconds: body.burst_refill_seconds,
        })
        .await
        .map_err(store_error)?;
    tracing::info!(team_id = team.id, key_id = record.id, "api key created");
    let mut out = serde_json::to_value(&record).unwrap_or(Value::Null);
    if let Some(obj) = out.as_object_mut() {
        obj.insert("key".into(), Value::String(secret));
    }
    Ok(ok(StatusCode::CREATED, out))
}

#[derive(Debug, Deserialize)]
pub struct KeysQuery {
    team: Option<String>,
}

pub async fn list_keys(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Query(q): Query<KeysQuery>,
) -> Result<Response, ApiError> {
    let team_ref = match q.team {
        Some(t) => t.parse().map(TeamRef::Id).unwrap_or(TeamRef::Name(t)),
        None => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "`team` is required.",
            ));
        }
    };
    let team = resolve_team(&state, &team_ref).await?;
    let keys = state.store.api_keys(team.id).await.map_err(store_error)?;
    Ok(ok(StatusCode::OK, json!({ "data": keys })))
}

pub async fn revoke_key(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    let revoked = state.store.revoke_api_key(id).await.map_err(store_error)?;
    tracing::info!(key_id = id, revoked, "api key revoked");
    // `revoked: false` means there was no live key with this id (unknown or revoked before).
    Ok(ok(StatusCode::OK, json!({ "id": id, "revoked": revoked })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credits {
    team: TeamRef,
    amount: i64,
}

pub async fn add_credits(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<Credits>,
) -> Result<Response, ApiError> {
    let team = resolve_team(&state, &body.team).await?;
    let balance = state
        .store
        .add_credits(team.id, body.amount, "admin credit")
        .await
        .map_err(store_error)?;
    tracing::info!(team_id = team.id, amount = body.amount, "credits added");
    Ok(ok(
        StatusCode::OK,
        json!({ "id": team.id, "name": team.name, "balance_microcredits": balance }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewNode {
    node_id: String,
    #[serde(default = "default_location")]
    location: String,
}

fn default_location() -> String {
    "onprem".into()
}

pub async fn create_node(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<NewNode>,
) -> Result<Response, ApiError> {
    let valid_id = !body.node_id.is_empty()
        && body.node_id.len() <= 128
        && body
            .node_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !valid_id {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "node_id: 1-128 of [A-Za-z0-9._-].",
        ));
    }
    let token = new_secret(NODE_TOKEN_PREFIX).map_err(store_error)?;
    state
        .store
        .create_node(&body.node_id, &body.location, &hash_secret(&token))
        .await
        .map_err(store_error)?;
    tracing::info!(node_id = %body.node_id, "node credential issued");
    Ok(ok(
        StatusCode::CREATED,
        json!({ "node_id": body.node_id, "token": token }),
    ))
}

pub async fn revoke_node_token(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let revoked = state
        .store
        .revoke_node_token(&id)
        .await
        .map_err(store_error)?;
    // The live socket goes too: a revoked node must not keep serving.
    let live = state
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&id);
    if let Some(node) = live {
        node.stop();
    }
    tracing::info!(node_id = %id, revoked, "node credential revoked");
    Ok(ok(
        StatusCode::OK,
        json!({ "node_id": id, "revoked": revoked }),
    ))
}

pub async fn list_nodes(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
) -> Result<Response, ApiError> {
    let records = state.store.nodes().await.map_err(store_error)?;
    let mut data = Vec::new();
    for node in records {
        let heartbeat = state
            .coordinator
            .get_hash(&format!("node:{}", node.id))
            .await
            .ok()
            .flatten();
        let connected = state
            .nodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&node.id);
        let hb = |k: &str| heartbeat.as_ref().and_then(|h| h.get(k)).cloned();
        let health = match (connected, node.drained_at.is_some()) {
            (true, true) => "draining",
            (true, false) => "ready",
            // A drained agent finishes its work, then disconnects and exits.
            (false, true) => "drained",
            (false, false) => "offline",
        };
        data.push(json!({
            "node_id": node.id,
            "location": node.location,
            "models": node.models,
            "gpus": node.gpus,
            "health": health,
            "queue_depth": hb("queue_depth").and_then(|v| v.parse::<u64>().ok()),
            "running": hb("running").and_then(|v| v.parse::<u64>().ok()),
            "kv_cache_usage": hb("kv_cache_usage").and_then(|v| v.parse::<f64>().ok()),
            "owner_replica": hb("owner").or(node.orchestrator_id.clone()),
            "last_heartbeat": hb("last_heartbeat"),
            "last_registration": node.last_seen,
            "token_revoked": node.token_hash.is_none(),
        }));
    }
    Ok(ok(StatusCode::OK, json!({ "data": data })))
}

pub async fn drain_node(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    state
        .store
        .mark_node_drained(&id, state.clock.wall())
        .await
        .map_err(store_error)?;
    let live = state
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&id)
        .cloned();
    if let Some(node) = &live {
        node.drain();
    }
    tracing::info!(node_id = %id, connected = live.is_some(), "node drain requested");
    Ok(ok(
        StatusCode::ACCEPTED,
        json!({ "node_id": id, "status": "draining" }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadModel {
    name: String,
}

pub async fn load_model(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<String>,
    Json(body): Json<LoadModel>,
) -> Result<Response, ApiError> {
    if state.config.resolve_model(&body.name).is_none() {
        return Err(ApiError::new(
            ErrorCode::ModelNotFound,
            format!("Unknown model `{}`.", body.name),
        ));
    }
    let live = state
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&id)
        .cloned();
    let node = live.ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            "The node is not connected to this replica.",
        )
    })?;
    node.load_model(&body.name);
    tracing::info!(node_id = %id, model = %body.name, "load_model sent");
    Ok(ok(
        StatusCode::ACCEPTED,
        json!({ "node_id": id, "model": body.name, "status": "requested" }),
    ))
}
