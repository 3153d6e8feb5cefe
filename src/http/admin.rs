//! The admin API (SPEC section 6): teams, keys, credits and node tokens, for operators.
//! Authorised by the bootstrap admin token (compared in constant time) or a JWT with the
//! `admin` role. Every input is checked here, against the limits docs/api.md lists, before
//! any storage call, so both stores see only values they can hold; a store failure is logged
//! with its cause and answered with a fixed message. Secrets are returned exactly once, at
//! creation; only their hashes are stored.

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::extract::{FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::de::{self, Unexpected, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use switchyard_actors::error::ErrorCode;
use switchyard_actors::tier::Tier;

use super::error::{ApiError, Json, Path, Query, printable};
use crate::server::AppState;
use crate::store::{
    API_KEY_PREFIX, KeyRevocation, NODE_LOCATIONS, NODE_TOKEN_PREFIX, NewApiKey, StoreError, Team,
    display_prefix, hash_secret, new_secret,
};

// Input limits (docs/api.md, "Admin API"). Each fits both stores' columns (BIGINT, TEXT
// under a unique index) and the arithmetic downstream (ms as i64, Redis counters as i64).

/// Longest team name, in characters (PostgreSQL's unique index refuses entries over about
/// 2.7 KB; 128 characters of UTF-8 are at most 512 bytes).
const MAX_TEAM_NAME_CHARS: usize = 128;
/// Longest node id, in characters.
const MAX_NODE_ID_CHARS: usize = 128;
/// Requests per minute.
const MAX_RPM: u64 = 1_000_000;
/// Tokens per UTC day.
const MAX_TOKENS_PER_DAY: u64 = 1_000_000_000_000;
/// Concurrent generations.
const MAX_STREAMS: u64 = 100_000;
/// Messages per quota window.
const MAX_MESSAGE_QUOTA: u64 = 1_000_000;
/// Burst bucket capacity.
const MAX_BURST_CAPACITY: u64 = 1_000_000;
/// Seconds per burst token: at most a day.
const MAX_BURST_REFILL_SECONDS: u64 = 86_400;
/// Longest piece of a client's model name echoed in an error.
const ECHO_MODEL_CHARS: usize = 64;
/// Largest credit or correction, in microcredits (a billion credits).
const MAX_CREDIT_MICROCREDITS: i64 = 1_000_000_000_000_000;

/// Proof that the caller presented an admin credential: the bootstrap admin token (compared
/// in constant time) or a JWT with the admin role. Taking it as a handler argument, before
/// any other extractor, is what makes a route admin-only. A credential that is not valid at
/// all (unknown, revoked, expired, a bad JWT) is 401 `unauthorized`, as on the API; a valid
/// one without admin rights (an API key, a JWT without the admin role) is 403 `forbidden`.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

impl FromRequestParts<Arc<AppState>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        // The same parsing as the API's: one header, `Bearer`, one space, visible ASCII.
        let presented = super::lifecycle::bearer(&parts.headers)?;
        let forbidden = || ApiError::new(ErrorCode::Forbidden, "Admin rights are required.");
        let expected = state.config.admin_token.as_deref().unwrap_or_default();
        if !expected.is_empty() && bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
            super::access_log::record_principal("admin");
            return Ok(Admin);
        }
        // A JWT, verified against the JWKS: admin role or not.
        if let Some(verdict) = state.auth.admin_jwt(presented).await {
            let caller = verdict?;
            super::access_log::record_principal(&caller.subject);
            return if caller.admin {
                Ok(Admin)
            } else {
                Err(forbidden())
            };
        }
        // Anything else must be a valid API key to earn a 403 rather than a 401.
        super::lifecycle::authenticate(state, &parts.headers).await?;
        Err(forbidden())
    }
}

/// Answers a store failure the caller did not handle itself. The cause is logged here, once,
/// and never shown: an unreachable store is 503 with a fixed message; a refusal the checks
/// above should have made impossible is a 400 that says nothing of the store.
pub(super) fn store_failed(op: &'static str) -> impl FnOnce(StoreError) -> ApiError {
    move |e| match e {
        StoreError::NotFound => ApiError::new(ErrorCode::NotFound, "Not found."),
        StoreError::Conflict(_) | StoreError::Invalid(_) => {
            tracing::warn!(error = %e, op, "the store refused an admin change that passed validation");
            ApiError::new(
                ErrorCode::InvalidRequest,
                "The change conflicts with what is stored.",
            )
        }
        StoreError::Unavailable(_) => {
            tracing::error!(error = %e, op, "admin store call failed");
            ApiError::new(
                ErrorCode::QuotaServiceUnavailable,
                "The database is unavailable.",
            )
        }
    }
}

pub(super) fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, message).with_param(param)
}

// ---------------------------------------------------------------------------------------
// Checks on admin input. Each names its field and says what is allowed.

/// A team name: non-blank, at most [`MAX_TEAM_NAME_CHARS`] characters, no control
/// characters (NUL included: PostgreSQL cannot store it and SQLite would), no whitespace at
/// either end, and not an integer (an integer names a team by id, in bodies, `?team=` and
/// JWT claims alike, so such a name could never be used).
fn check_team_name(name: &str, param: &str) -> Result<(), ApiError> {
    let why = if name.trim().is_empty() {
        "cannot be empty or blank".to_owned()
    } else if name.chars().count() > MAX_TEAM_NAME_CHARS {
        format!("has at most {MAX_TEAM_NAME_CHARS} characters")
    } else if name.chars().any(char::is_control) {
        "cannot contain control characters (NUL, tabs, line breaks)".to_owned()
    } else if name.trim() != name {
        "cannot start or end with whitespace".to_owned()
    } else if name.parse::<i64>().is_ok() {
        "cannot be an integer (integers name teams by id)".to_owned()
    } else {
        return Ok(());
    };
    Err(invalid(param, format!("`{param}`: a team name {why}.")))
}

/// A node id: 1 to [`MAX_NODE_ID_CHARS`] characters of `A-Z a-z 0-9 . _ -`, so it is safe in
/// a URL path, a metric label, a Redis key and a log line.
pub(super) fn check_node_id(id: &str, param: &str) -> Result<(), ApiError> {
    let valid = !id.is_empty()
        && id.len() <= MAX_NODE_ID_CHARS
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if valid {
        Ok(())
    } else {
        Err(invalid(
            param,
            format!(
                "`{param}`: a node id is 1 to {MAX_NODE_ID_CHARS} characters of A-Z a-z 0-9 . _ -"
            ),
        ))
    }
}

/// A JSON integer that is at least 0; its field's range is checked by [`ranged`].
#[derive(Debug, Clone, Copy)]
struct Count(u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CountVisitor;
        impl Visitor<'_> for CountVisitor {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                Ok(Count(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u64::try_from(v)
                    .map(Count)
                    .map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
            }
        }
        deserializer.deserialize_u64(CountVisitor)
    }
}

/// `value` within `min..=max`, as `T`; `None` stays `None` (the field's default).
fn ranged<T: TryFrom<u64>>(
    value: Option<Count>,
    param: &str,
    min: u64,
    max: u64,
) -> Result<Option<T>, ApiError> {
    let Some(Count(v)) = value else {
        return Ok(None);
    };
    let out_of_range = || {
        invalid(
            param,
            format!("`{param}` must be an integer from {min} to {max}, or null."),
        )
    };
    if !(min..=max).contains(&v) {
        return Err(out_of_range());
    }
    T::try_from(v).map(Some).map_err(|_| out_of_range())
}

/// A JSON integer that fits an i64.
#[derive(Debug, Clone, Copy)]
struct Amount(i64);

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct AmountVisitor;
        impl Visitor<'_> for AmountVisitor {
            type Value = Amount;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer number of microcredits")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Amount, E> {
                Ok(Amount(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Amount, E> {
                i64::try_from(v)
                    .map(Amount)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
        }
        deserializer.deserialize_i64(AmountVisitor)
    }
}

/// A team named in a body by its id or its unique name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeamRef {
    /// By id.
    Id(i64),
    /// By name.
    Name(String),
}

impl<'de> Deserialize<'de> for TeamRef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TeamRefVisitor;
        impl Visitor<'_> for TeamRefVisitor {
            type Value = TeamRef;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a team id (an integer) or a team name (a string)")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TeamRef, E> {
                Ok(TeamRef::Id(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TeamRef, E> {
                i64::try_from(v)
                    .map(TeamRef::Id)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TeamRef, E> {
                Ok(TeamRef::Name(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<TeamRef, E> {
                Ok(TeamRef::Name(v))
            }
        }
        deserializer.deserialize_any(TeamRefVisitor)
    }
}

impl TeamRef {
    /// `?team=`: an integer is always an id (team names cannot be integers).
    pub(super) fn from_query(t: String) -> Self {
        t.parse().map(TeamRef::Id).unwrap_or(TeamRef::Name(t))
    }
}

/// The team `team` names; a name that breaks the naming rules is refused before the store
/// is asked, since no team can have it.
pub(super) async fn resolve_team(
    state: &AppState,
    team: &TeamRef,
    param: &str,
) -> Result<Team, ApiError> {
    let found = match team {
        TeamRef::Id(id) => state.store.team(*id).await,
        TeamRef::Name(name) => {
            check_team_name(name, param)?;
            state.store.team_by_name(name).await
        }
    }
    .map_err(store_failed("team lookup"))?;
    found.ok_or_else(|| ApiError::new(ErrorCode::NotFound, "Unknown team.").with_param(param))
}

fn ok<T: serde::Serialize>(status: StatusCode, body: T) -> Response {
    (status, axum::Json(body)).into_response()
}

// ---------------------------------------------------------------------------------------
// Teams

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
    check_team_name(&body.name, "name")?;
    let team = state
        .store
        .create_team(&body.name)
        .await
        .map_err(|e| match e {
            StoreError::Conflict(_) => invalid("name", "`name`: a team with this name exists."),
            other => store_failed("create team")(other),
        })?;
    tracing::info!(team_id = team.id, "team created");
    Ok(ok(StatusCode::CREATED, team))
}

pub async fn list_teams(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
) -> Result<Response, ApiError> {
    let teams = state
        .store
        .teams()
        .await
        .map_err(store_failed("list teams"))?;
    Ok(ok(StatusCode::OK, json!({ "data": teams })))
}

// ---------------------------------------------------------------------------------------
// Keys

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    team: TeamRef,
    #[serde(default)]
    model_allowlist: Option<Vec<String>>,
    #[serde(default)]
    rpm: Option<Count>,
    #[serde(default)]
    tokens_per_day: Option<Count>,
    #[serde(default)]
    max_streams: Option<Count>,
    #[serde(default)]
    expires_at: Option<String>,
    #[serde(default)]
    message_quota: Option<Count>,
    #[serde(default)]
    burst_capacity: Option<Count>,
    #[serde(default)]
    burst_refill_seconds: Option<Count>,
    #[serde(default)]
    service_tiers: Option<Vec<String>>,
    #[serde(default)]
    service_tier: Option<String>,
}

/// The limits of a new key, each within its documented range.
#[derive(Debug)]
struct KeyLimits {
    model_allowlist: Option<Vec<String>>,
    rpm: Option<u32>,
    tokens_per_day: Option<u64>,
    max_streams: Option<u32>,
    expires_at: Option<DateTime<Utc>>,
    message_quota: Option<u32>,
    burst_capacity: Option<u32>,
    burst_refill_seconds: Option<u32>,
    service_tiers: Option<Vec<Tier>>,
    service_tier: Option<Tier>,
}

/// The tier a key's `service_tier` (or `service_tiers[i]`) names: `auto` is no tier.
fn key_tier(name: &str, param: &str) -> Result<Tier, ApiError> {
    match Tier::parse(name) {
        Ok(Some(t)) => Ok(t),
        _ => Err(invalid(
            param,
            format!("`{param}` must name a tier: priority, default or flex."),
        )),
    }
}

/// A key's tiers: at least one, each named once, its own tier among them.
fn key_tiers(
    tiers: Option<&[String]>,
    default: Option<&str>,
) -> Result<(Option<Vec<Tier>>, Option<Tier>), ApiError> {
    let default = default.map(|d| key_tier(d, "service_tier")).transpose()?;
    let Some(names) = tiers else {
        return Ok((None, default));
    };
    if names.is_empty() {
        return Err(invalid(
            "service_tiers",
            "`service_tiers` must name at least one tier (or be left out for the configured default).",
        ));
    }
    let mut tiers = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let t = key_tier(name, &format!("service_tiers[{i}]"))?;
        if tiers.contains(&t) {
            return Err(invalid(
                "service_tiers",
                format!("`service_tiers[{i}]` repeats an earlier entry."),
            ));
        }
        tiers.push(t);
    }
    if default.is_some_and(|d| !tiers.contains(&d)) {
        return Err(invalid(
            "service_tier",
            "`service_tier` must be one of `service_tiers`.",
        ));
    }
    Ok((Some(tiers), default))
}

impl NewKey {
    /// Checks every field but `team` (resolved against the store afterwards).
    fn limits(self, state: &AppState) -> Result<KeyLimits, ApiError> {
        if let Some(models) = &self.model_allowlist {
            let mut seen = BTreeSet::new();
            for (i, name) in models.iter().enumerate() {
                if state.config.resolve_model(name).is_none() {
                    return Err(invalid(
                        "model_allowlist",
                        format!("`model_allowlist[{i}]` is not a configured model or alias."),
                    ));
                }
                if !seen.insert(name.as_str()) {
                    return Err(invalid(
                        "model_allowlist",
                        format!("`model_allowlist[{i}]` repeats an earlier entry."),
                    ));
                }
            }
        }
        let expires_at = match &self.expires_at {
            None => None,
            Some(text) => {
                let at = DateTime::parse_from_rfc3339(text)
                    .map_err(|_| {
                        invalid(
                            "expires_at",
                            "`expires_at` must be an RFC 3339 time with an offset, such as \
                             2027-01-01T00:00:00Z.",
                        )
                    })?
                    .with_timezone(&Utc);
                if at <= state.clock.wall() {
                    return Err(invalid("expires_at", "`expires_at` is in the past."));
                }
                Some(at)
            }
        };
        let (service_tiers, service_tier) =
            key_tiers(self.service_tiers.as_deref(), self.service_tier.as_deref())?;
        Ok(KeyLimits {
            service_tiers,
            service_tier,
            rpm: ranged(self.rpm, "rpm", 0, MAX_RPM)?,
            tokens_per_day: ranged(self.tokens_per_day, "tokens_per_day", 0, MAX_TOKENS_PER_DAY)?,
            max_streams: ranged(self.max_streams, "max_streams", 0, MAX_STREAMS)?,
            message_quota: ranged(self.message_quota, "message_quota", 0, MAX_MESSAGE_QUOTA)?,
            // An empty bucket never refills past zero: a capacity of 0 would refuse every
            // request with a retryable 429 forever. `null` is the way to have no bucket.
            burst_capacity: ranged(self.burst_capacity, "burst_capacity", 1, MAX_BURST_CAPACITY)?,
            // 0 would refill instantly, so the bucket would never limit (the configuration's
            // `generations.burst_refill_secs` refuses 0 for the same reason).
            burst_refill_seconds: ranged(
                self.burst_refill_seconds,
                "burst_refill_seconds",
                1,
                MAX_BURST_REFILL_SECONDS,
            )?,
            model_allowlist: self.model_allowlist,
            expires_at,
        })
    }
}

pub async fn create_key(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<NewKey>,
) -> Result<Response, ApiError> {
    let team_ref = body.team.clone();
    let limits = body.limits(&state)?;
    let team = resolve_team(&state, &team_ref, "team").await?;
    let secret = new_secret(API_KEY_PREFIX).map_err(store_failed("key secret"))?;
    let record = state
        .store
        .create_api_key(NewApiKey {
            team_id: team.id,
            hash: hash_secret(&secret),
            prefix: display_prefix(&secret),
            model_allowlist: limits.model_allowlist,
            rpm: limits.rpm,
            tokens_per_day: limits.tokens_per_day,
            max_streams: limits.max_streams,
            expires_at: limits.expires_at,
            message_quota: limits.message_quota,
            burst_capacity: limits.burst_capacity,
            burst_refill_seconds: limits.burst_refill_seconds,
            service_tiers: limits.service_tiers,
            service_tier: limits.service_tier,
        })
        .await
        .map_err(|e| match e {
            StoreError::NotFound => {
                ApiError::new(ErrorCode::NotFound, "Unknown team.").with_param("team")
            }
            other => store_failed("create key")(other),
        })?;
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
    let Some(team_ref) = q.team.map(TeamRef::from_query) else {
        return Err(invalid("team", "`team` is required."));
    };
    let team = resolve_team(&state, &team_ref, "team").await?;
    let keys = state
        .store
        .api_keys(team.id)
        .await
        .map_err(store_failed("list keys"))?;
    let last_used = state
        .store
        .keys_last_used(team.id)
        .await
        .map_err(store_failed("keys last used"))?;
    let data: Vec<Value> = keys
        .into_iter()
        .map(|k| {
            let at = last_used.get(&k.id).copied();
            let mut v = json!(k);
            if let Some(o) = v.as_object_mut() {
                o.insert("last_used_at".to_owned(), json!(at));
            }
            v
        })
        .collect();
    Ok(ok(StatusCode::OK, json!({ "data": data })))
}

/// Revokes a key: 200 `revoked: true` once the key is revoked, whether by this call or an
/// earlier one (a retried DELETE gets the same answer); 404 for an id no key ever had.
pub async fn revoke_key(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<i64>,
) -> Result<Response, ApiError> {
    let revocation = state
        .store
        .revoke_api_key(id)
        .await
        .map_err(store_failed("revoke key"))?;
    if revocation == KeyRevocation::Unknown {
        return Err(ApiError::new(ErrorCode::NotFound, "Unknown key.").with_param("id"));
    }
    let newly = revocation == KeyRevocation::Revoked;
    tracing::info!(key_id = id, newly, "api key revoked");
    Ok(ok(StatusCode::OK, json!({ "id": id, "revoked": true })))
}

// ---------------------------------------------------------------------------------------
// Credits

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credits {
    team: TeamRef,
    amount: Amount,
}

pub async fn add_credits(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Json(body): Json<Credits>,
) -> Result<Response, ApiError> {
    let Amount(amount) = body.amount;
    if amount == 0 || amount.unsigned_abs() > MAX_CREDIT_MICROCREDITS.unsigned_abs() {
        return Err(invalid(
            "amount",
            format!(
                "`amount` must be a non-zero integer from -{MAX_CREDIT_MICROCREDITS} to \
                 {MAX_CREDIT_MICROCREDITS} microcredits."
            ),
        ));
    }
    let team = resolve_team(&state, &body.team, "team").await?;
    let balance = state
        .store
        .add_credits(team.id, amount, "admin credit")
        .await
        .map_err(|e| match e {
            StoreError::NotFound => {
                ApiError::new(ErrorCode::NotFound, "Unknown team.").with_param("team")
            }
            // The amount was checked above: what is left is a balance out of i64's range.
            StoreError::Invalid(_) => invalid(
                "amount",
                "`amount`: the credit would take the team's balance out of range.",
            ),
            other => store_failed("add credits")(other),
        })?;
    tracing::info!(team_id = team.id, amount, "credits added");
    Ok(ok(
        StatusCode::OK,
        json!({ "id": team.id, "name": team.name, "balance_microcredits": balance }),
    ))
}

// ---------------------------------------------------------------------------------------
// Nodes

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
    check_node_id(&body.node_id, "node_id")?;
    if !NODE_LOCATIONS.contains(&body.location.as_str()) {
        return Err(invalid(
            "location",
            "`location` must be \"onprem\" or \"cloud\".",
        ));
    }
    let token = new_secret(NODE_TOKEN_PREFIX).map_err(store_failed("node secret"))?;
    state
        .store
        .create_node(&body.node_id, &body.location, &hash_secret(&token))
        .await
        .map_err(|e| match e {
            // The id passed `check_node_id`, so it is safe to echo.
            StoreError::Conflict(_) => invalid(
                "node_id",
                format!(
                    "`node_id`: node `{}` has a live token; revoke it first.",
                    body.node_id
                ),
            ),
            other => store_failed("create node")(other),
        })?;
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
    check_node_id(&id, "id")?;
    let revoked = state
        .store
        .revoke_node_token(&id)
        .await
        .map_err(store_failed("revoke node token"))?;
    // The live socket goes too: a revoked node must not keep serving.
    let live = state.view.remove_local(&id);
    if let Some(node) = live {
        node.stop();
    }
    tracing::info!(node_id = %id, revoked, "node credential revoked");
    Ok(ok(
        StatusCode::OK,
        json!({ "node_id": id, "revoked": revoked }),
    ))
}

/// Node lookups `GET /admin/nodes` keeps in flight.
const NODE_LOOKUPS: usize = 32;

pub async fn list_nodes(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
) -> Result<Response, ApiError> {
    let records = state
        .store
        .nodes()
        .await
        .map_err(store_failed("list nodes"))?;
    // Each node's heartbeat record and violation count, a few nodes at a time: a fleet of
    // hundreds is listed in round trips to Redis, not hundreds of them in a row.
    let state = &state;
    let data: Vec<Value> = futures::stream::iter(records)
        .map(|node| async move {
            let heartbeat = state
                .coordinator
                .get_hash(&format!("node:{}", node.id))
                .await
                .ok()
                .flatten();
            // Ready when this replica routes to it: its socket here, or a live proxy of its
            // owner's connection. Not `node:{id}` alone: a replica killed with its nodes leaves
            // their records behind until the TTL runs out, and they are not routable.
            let connected = state.view.reach(&node.id).is_some();
            let hb = |k: &str| heartbeat.as_ref().and_then(|h| h.get(k)).cloned();
            // Adding 0 reads the counter without moving its window (it expires 24 h after the
            // first violation it counted; a node without any gets a 0 that expires the same way).
            let violations = state
                .coordinator
                .incr(
                    &switchyard_actors::node::violations_key(&node.id),
                    0,
                    switchyard_actors::node::VIOLATIONS_KEPT,
                )
                .await
                .ok();
            // Drained by an operator (recorded), or draining itself (a SIGTERM; its owner's
            // heartbeat record says so).
            let draining = node.drained_at.is_some() || hb("draining").is_some_and(|d| d == "true");
            let health = match (connected, draining) {
                (true, true) => "draining",
                (true, false) => "ready",
                // A drained agent finishes its work, then disconnects and exits.
                (false, true) => "drained",
                (false, false) => "offline",
            };
            json!({
                "node_id": node.id,
                "location": node.location,
                "models": node.models,
                "gpus": node.gpus,
                "pool": node.pool.as_deref().unwrap_or(super::costs::UNASSIGNED),
                "health": health,
                "queue_depth": hb("queue_depth").and_then(|v| v.parse::<u64>().ok()),
                "running": hb("running").and_then(|v| v.parse::<u64>().ok()),
                "kv_cache_usage": hb("kv_cache_usage").and_then(|v| v.parse::<f64>().ok()),
                "owner_replica": hb("owner").or(node.orchestrator_id.clone()),
                "in_flight": hb("in_flight").and_then(|v| v.parse::<u64>().ok()),
                "last_heartbeat": hb("last_heartbeat"),
                "last_registration": node.last_seen,
                "token_revoked": node.token_hash.is_none(),
                "protocol_violations": violations,
            })
        })
        .buffered(NODE_LOOKUPS)
        .collect()
        .await;
    Ok(ok(StatusCode::OK, json!({ "data": data })))
}

pub async fn drain_node(
    State(state): State<Arc<AppState>>,
    _admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_node_id(&id, "id")?;
    state
        .store
        .mark_node_drained(&id, state.clock.wall())
        .await
        .map_err(|e| match e {
            StoreError::NotFound => ApiError::new(ErrorCode::NotFound, "Unknown node."),
            other => store_failed("drain node")(other),
        })?;
    // Through the node's socket here, or its proxy to the replica holding the socket.
    let live = state.view.reach(&id);
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
    check_node_id(&id, "id")?;
    if state.config.resolve_model(&body.name).is_none() {
        return Err(ApiError::new(
            ErrorCode::ModelNotFound,
            format!(
                "Unknown model `{}`.",
                printable(&body.name, ECHO_MODEL_CHARS)
            ),
        )
        .with_param("name"));
    }
    let node = state
        .view
        .reach(&id)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "The node is not connected."))?;
    node.load_model(&body.name);
    tracing::info!(node_id = %id, model = %body.name, "load_model sent");
    Ok(ok(
        StatusCode::ACCEPTED,
        json!({ "node_id": id, "model": body.name, "status": "requested" }),
    ))
}
