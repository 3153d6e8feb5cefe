//! The authoritative store: configuration (teams, credits, API keys, nodes), the usage
//! ledger and the generation lifecycle, behind one [`Store`] trait that extends the actors'
//! [`Ledger`] and [`GenerationStore`] ports. [`SqliteStore`] backs the embedded mode and
//! [`PostgresStore`] production; [`connect_store`] picks one by URL. Both behave alike, and
//! both must pass the [`conformance`] and [`generations_conformance`] suites.
//!
//! Secrets never reach the store: callers keep the plaintext from [`new_secret`] and store
//! [`hash_secret`] of it.

pub mod accounting;
pub mod conformance;
mod drift;
pub mod generations_conformance;
mod node_days;
pub mod postgres;
mod sql;
pub mod sqlite;
pub mod usage;

use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDate, Utc};
use rand::TryRngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};
use switchyard_actors::tier::Tier;

pub use drift::{
    DRIFT_REVIEWED_LIMIT, DriftReport, ModelDrift, ReviewCounts, ReviewedRow, TokenCounts,
    TokenTotals,
};
pub use node_days::{
    NodeDay, NodeDayLedger, NodeDayUsage, day_start, days_overlapping, valid_pool,
};
pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
pub use switchyard_actors::lifecycle::GenerationStore;
pub use switchyard_actors::ports::{
    Billed, EntryStatus, Ledger, LedgerEntry, LedgerError, MAX_TOKEN_COUNT, Microcredits,
    Reservation, ReviewReason, SettleOutcome, Settlement, UsageBounds, cost_of,
};

/// Prefix of API keys handed to callers.
pub const API_KEY_PREFIX: &str = "sk-sy-";
/// Prefix of node tokens handed to node agents.
pub const NODE_TOKEN_PREFIX: &str = "nt-";
/// Characters of a secret kept as its display prefix (`sk-sy-` plus six random ones): enough
/// to tell keys apart in a listing, far too few to guess the rest.
pub const DISPLAY_PREFIX_CHARS: usize = 12;
/// Node locations the store accepts.
pub const NODE_LOCATIONS: [&str; 2] = ["onprem", "cloud"];

/// Failures of the store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The team, key or node named does not exist.
    #[error("not found")]
    NotFound,
    /// A unique name, hash or live node token exists already.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The database could not be reached or failed; callers fail closed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The input (or a stored value read back) breaks the schema's rules.
    #[error("invalid: {0}")]
    Invalid(String),
}

/// A team: the unit that pays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Team {
    /// Database id.
    pub id: i64,
    /// Unique name, also accepted wherever the admin API takes a team.
    pub name: String,
    /// Credits minus settled costs; may be negative after a request that cost more than its
    /// estimate.
    pub balance_microcredits: Microcredits,
}

/// What [`Store::create_api_key`] needs. `None` limits mean "configured default or none".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NewApiKey {
    /// The owning team.
    pub team_id: i64,
    /// [`hash_secret`] of the plaintext key.
    pub hash: String,
    /// The key's first characters ([`display_prefix`]), for listings.
    pub prefix: String,
    /// Models the key may use; `None` allows all.
    pub model_allowlist: Option<Vec<String>>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Concurrent generations.
    pub max_streams: Option<u32>,
    /// After this instant the key is refused.
    pub expires_at: Option<DateTime<Utc>>,
    /// Messages per quota window.
    pub message_quota: Option<u32>,
    /// Token-bucket capacity.
    pub burst_capacity: Option<u32>,
    /// Seconds per token refilled into the bucket.
    pub burst_refill_seconds: Option<u32>,
    /// Service tiers it may use; `None`: the configured default.
    pub service_tiers: Option<Vec<Tier>>,
    /// Its tier when a request names none; `None`: the configured default.
    pub service_tier: Option<Tier>,
}

/// A stored API key. The hash stays in the database: nothing downstream of the lookup needs
/// it, and what is not carried cannot leak into a log or a response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiKeyRecord {
    /// Database id (the key id of ledger rows and rate-limit keys).
    pub id: i64,
    /// The owning team.
    pub team_id: i64,
    /// Display prefix.
    pub prefix: String,
    /// Models the key may use; `None` allows all.
    pub model_allowlist: Option<Vec<String>>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Concurrent generations.
    pub max_streams: Option<u32>,
    /// After this instant the key is refused.
    pub expires_at: Option<DateTime<Utc>>,
    /// Set once revoked; a revoked key is refused.
    pub revoked_at: Option<DateTime<Utc>>,
    /// Messages per quota window.
    pub message_quota: Option<u32>,
    /// Token-bucket capacity.
    pub burst_capacity: Option<u32>,
    /// Seconds per token refilled into the bucket.
    pub burst_refill_seconds: Option<u32>,
    /// Service tiers it may use; `None`: the configured default.
    pub service_tiers: Option<Vec<Tier>>,
    /// Its tier when a request names none; `None`: the configured default.
    pub service_tier: Option<Tier>,
    /// When the key was created.
    pub created_at: DateTime<Utc>,
}

impl ApiKeyRecord {
    /// Whether the key may authenticate at `now`: neither revoked nor expired.
    pub fn is_usable(&self, now: DateTime<Utc>) -> bool {
        self.revoked_at.is_none() && self.expires_at.is_none_or(|at| now < at)
    }

    /// Whether the allowlist admits `model` (a resolved model name or an alias, as the
    /// caller decides to check).
    pub fn allows_model(&self, model: &str) -> bool {
        self.model_allowlist
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|m| m == model))
    }
}

/// A registered GPU node, as the database knows it: registration, drain and revocation.
/// Liveness (heartbeats) lives in the coordinator, not here.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeRecord {
    /// Node id chosen by the admin.
    pub id: String,
    /// `onprem` or `cloud`.
    pub location: String,
    /// [`hash_secret`] of the node token; `None` once revoked.
    pub token_hash: Option<String>,
    /// GPUs as last registered (a JSON array).
    pub gpus: serde_json::Value,
    /// Models as last registered.
    pub models: Vec<String>,
    /// Time of the last registration.
    pub last_seen: Option<DateTime<Utc>>,
    /// Replica that accepted the last registration.
    pub orchestrator_id: Option<String>,
    /// Set when an admin drained the node.
    pub drained_at: Option<DateTime<Utc>>,
    /// The pool its GPU hours are priced in (`PUT /admin/nodes/{id}/pool`); `None`: unassigned.
    pub pool: Option<String>,
    /// When the node was first created.
    pub created_at: DateTime<Utc>,
}

/// Where a ledger row stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LedgerStatus {
    /// Admitted; its estimate holds against the balance.
    Reserved,
    /// Final, with exact usage; its cost was debited.
    Settled,
    /// Final without GPU work; nothing was debited.
    Cancelled,
}

impl LedgerStatus {
    /// The value stored in `usage_ledger.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            LedgerStatus::Reserved => "reserved",
            LedgerStatus::Settled => "settled",
            LedgerStatus::Cancelled => "cancelled",
        }
    }
}

impl std::str::FromStr for LedgerStatus {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reserved" => Ok(LedgerStatus::Reserved),
            "settled" => Ok(LedgerStatus::Settled),
            "cancelled" => Ok(LedgerStatus::Cancelled),
            other => Err(StoreError::Invalid(format!("ledger status {other:?}"))),
        }
    }
}

impl LedgerRow {
    /// The row as the actors see it.
    pub fn entry(&self) -> LedgerEntry {
        let count = |v: i64| u64::try_from(v).unwrap_or(0);
        LedgerEntry {
            model: self.model.clone(),
            bounds: self.usage_bounds(),
            status: match self.status {
                LedgerStatus::Reserved => EntryStatus::Reserved,
                LedgerStatus::Settled => EntryStatus::Settled {
                    prompt_tokens: count(self.prompt_tokens),
                    completion_tokens: count(self.completion_tokens),
                },
                LedgerStatus::Cancelled => EntryStatus::Cancelled,
            },
        }
    }

    /// The bounds the row was reserved with; a row admitted before bounds existed is
    /// unbounded.
    pub fn usage_bounds(&self) -> UsageBounds {
        let bound = |b: Option<i64>| {
            b.and_then(|v| u64::try_from(v).ok())
                .unwrap_or(MAX_TOKEN_COUNT)
        };
        UsageBounds {
            prompt_tokens: bound(self.prompt_token_bound),
            completion_tokens: bound(self.completion_token_bound),
        }
    }
}

/// What revoking a key did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyRevocation {
    /// It was live and is revoked now.
    Revoked,
    /// It was revoked before.
    AlreadyRevoked,
    /// No key has this id.
    Unknown,
}

/// One request's row in the usage ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerRow {
    /// Database id.
    pub id: i64,
    /// The request (unique).
    pub request_id: String,
    /// The paying team.
    pub team_id: i64,
    /// The API key used, if any.
    pub key_id: Option<i64>,
    /// The resolved model version.
    pub model: String,
    /// Exact prompt tokens; 0 until settled.
    pub prompt_tokens: i64,
    /// Exact completion tokens; 0 until settled.
    pub completion_tokens: i64,
    /// Exact cost at the row's prices ([`cost_of`]); 0 until settled, and stays 0 when
    /// cancelled.
    pub cost_microcredits: Microcredits,
    /// The estimate reserved at admission.
    pub estimated_cost_microcredits: Microcredits,
    /// Input price at admission, microcredits per million tokens.
    pub price_input_per_mtok: Microcredits,
    /// Output price at admission, microcredits per million tokens.
    pub price_output_per_mtok: Microcredits,
    /// Where the row stands.
    pub status: LedgerStatus,
    /// When the reservation was made.
    pub created_at: DateTime<Utc>,
    /// When the row became final (settled or cancelled).
    pub settled_at: Option<DateTime<Utc>>,
    /// The most the row may bill in prompt tokens; `None` for rows admitted before bounds
    /// existed (unbounded).
    pub prompt_token_bound: Option<i64>,
    /// The most the row may bill in completion tokens; `None` as for the prompt bound.
    pub completion_token_bound: Option<i64>,
    /// The node's prompt-token report when it exceeded a bound and was clamped (a report
    /// beyond `i64::MAX` is kept as `i64::MAX`); `None` otherwise.
    pub claimed_prompt_tokens: Option<i64>,
    /// The node's completion-token report when clamped, as for the prompt claim.
    pub claimed_completion_tokens: Option<i64>,
    /// Why an operator should look at the row (the drift report lists such rows).
    pub review: Option<ReviewReason>,
}

/// Configuration, ledger and generation storage. The [`Ledger`] supertrait carries the
/// request path's reserve/settle/cancel, the [`GenerationStore`] supertrait the Generations
/// API's records, quota windows and burst buckets; everything else serves the admin API,
/// authentication and the node control plane. An `Arc<dyn Store>` coerces to
/// `Arc<dyn Ledger>` and `Arc<dyn GenerationStore>` (trait upcasting).
#[async_trait]
pub trait Store: Ledger + GenerationStore {
    /// Applies the backend's pending migrations (embedded at compile time); applied ones are
    /// skipped, so calling it at every start is fine.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Creates a team with a zero balance; `Conflict` if the name is taken.
    async fn create_team(&self, name: &str) -> Result<Team, StoreError>;
    /// The team with this id.
    async fn team(&self, id: i64) -> Result<Option<Team>, StoreError>;
    /// The team with this name.
    async fn team_by_name(&self, name: &str) -> Result<Option<Team>, StoreError>;
    /// All teams, by id.
    async fn teams(&self) -> Result<Vec<Team>, StoreError>;
    /// Appends a credit entry (negative for a correction) and adds it to the balance, in one
    /// transaction; returns the new balance. `NotFound` for an unknown team, `Invalid` for a
    /// zero amount or an overflowing balance.
    async fn add_credits(&self, team_id: i64, amount: i64, note: &str) -> Result<i64, StoreError>;

    /// Stores a key; `NotFound` for an unknown team, `Conflict` for a hash already stored.
    async fn create_api_key(&self, key: NewApiKey) -> Result<ApiKeyRecord, StoreError>;
    /// The key with this hash, revoked and expired ones included: the caller decides with
    /// [`ApiKeyRecord::is_usable`].
    async fn api_key_by_hash(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StoreError>;
    /// A team's keys, by id, revoked ones included.
    async fn api_keys(&self, team_id: i64) -> Result<Vec<ApiKeyRecord>, StoreError>;
    /// Revokes a key.
    async fn revoke_api_key(&self, id: i64) -> Result<KeyRevocation, StoreError>;

    /// Creates node `id` with a token hash, or issues a new token to a node whose token was
    /// revoked (its location is updated, the rest kept). `Conflict` if the node exists with
    /// a live token; `Invalid` for a location outside [`NODE_LOCATIONS`].
    async fn create_node(
        &self,
        id: &str,
        location: &str,
        token_hash: &str,
    ) -> Result<NodeRecord, StoreError>;
    /// The node with this id.
    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError>;
    /// All nodes, by id.
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
    /// Clears the node's token hash; `true` if it had a live token.
    async fn revoke_node_token(&self, id: &str) -> Result<bool, StoreError>;
    /// Records a successful registration: GPUs, models, accepting replica and time. A drain
    /// stays in force. `NotFound` for an unknown node.
    async fn record_node_registration(
        &self,
        id: &str,
        gpus: serde_json::Value,
        models: &[String],
        orchestrator_id: &str,
        at: DateTime<Utc>,
    ) -> Result<(), StoreError>;
    /// Records that an admin drained the node. `NotFound` for an unknown node.
    async fn mark_node_drained(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError>;

    /// The ledger row of a request.
    async fn ledger_row(&self, request_id: &str) -> Result<Option<LedgerRow>, StoreError>;
    /// Ledger rows by id, of one team or of all.
    async fn ledger_rows(&self, team_id: Option<i64>) -> Result<Vec<LedgerRow>, StoreError>;
    /// Rows still `reserved` (the `switchyard_ledger_open_reservations` gauge).
    async fn open_reservations(&self) -> Result<i64, StoreError>;
    /// Request ids of rows still `reserved` that were created before `before`, oldest
    /// first, at most `limit` (the sweeper's work list).
    async fn stale_reservations(
        &self,
        before: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError>;
    /// The drift report over settlements in `[from, to)` (`GET /admin/reports/drift`):
    /// per model, the settled requests and tokens, the rows under review by reason and what
    /// their nodes claimed against what was billed; and the reviewed rows themselves, newest
    /// first, at most [`DRIFT_REVIEWED_LIMIT`]. Read in one snapshot, so the totals and the
    /// list agree. `Invalid` unless `from < to`.
    async fn drift_report(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<DriftReport, StoreError>;
    /// Settled tokens per model over settlements in `[from, to)` (the drift report's
    /// totals without its list). `Invalid` unless `from < to`.
    async fn settled_by_model(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<std::collections::BTreeMap<String, TokenTotals>, StoreError>;

    /// Adds one heartbeat interval to its node's row of the day, creating the row at zero:
    /// seconds and counter growth are added (saturating), the GPU count replaced, and the
    /// row marked as having counters once any interval had them.
    async fn add_node_day(&self, usage: &NodeDayUsage) -> Result<(), StoreError>;
    /// The `node_days` rows of days in `[from, to)` with their nodes' pools, by node, day
    /// and model.
    async fn node_days(&self, from: NaiveDate, to: NaiveDate) -> Result<Vec<NodeDay>, StoreError>;
    /// What the ledger billed per node, day and model for settlements in the days
    /// `[from, to)` (rows that name their node), by node, day and model.
    async fn node_day_ledger(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> Result<Vec<NodeDayLedger>, StoreError>;
    /// Sets (or with `None` clears) the pool a node's GPU hours are priced in. `NotFound`
    /// for an unknown node, `Invalid` for a name [`valid_pool`] refuses.
    async fn set_node_pool(&self, id: &str, pool: Option<&str>) -> Result<(), StoreError>;

    /// Settled usage per UTC day, team and model of the requests admitted in `[from, to)`, of
    /// one team or of all, by day, team and model (the console's usage page). `Invalid`
    /// unless `from < to`.
    async fn usage_by_day(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        team_id: Option<i64>,
    ) -> Result<Vec<usage::UsageDay>, StoreError>;
    /// A team's credit entries, newest first, at most `limit`.
    async fn credit_entries(
        &self,
        team_id: i64,
        limit: i64,
    ) -> Result<Vec<usage::CreditEntry>, StoreError>;
    /// When each of a team's keys last admitted a request (its newest ledger row); keys
    /// never used are absent.
    async fn keys_last_used(
        &self,
        team_id: i64,
    ) -> Result<std::collections::BTreeMap<i64, DateTime<Utc>>, StoreError>;

    /// Succeeds when the database answers (`/readyz`).
    async fn ping(&self) -> Result<(), StoreError>;
}

/// Connects to the store at `url`: [`SqliteStore`] for `sqlite:` URLs, [`PostgresStore`] for
/// `postgres://` and `postgresql://` ones; `Invalid` for anything else. Does not migrate: call
/// [`Store::migrate`].
pub async fn connect_store(url: &str) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url).await?))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(PostgresStore::connect(url).await?))
    } else {
        Err(StoreError::Invalid(
            "database url must start with sqlite:, postgres:// or postgresql://".to_owned(),
        ))
    }
}

/// The admission rule both backends apply inside the reserving transaction: the balance,
/// less the estimates its open reservations hold, must cover the new `estimate`. Summed in
/// i128, so no total overflows.
fn covers(balance: Microcredits, held: Microcredits, estimate: Microcredits) -> bool {
    i128::from(held) + i128::from(estimate) <= i128::from(balance)
}

/// Hex SHA-256 of a secret: what the store keeps instead of an API key or node token. The
/// secrets are 256-bit random, so an unsalted fast hash is enough (no dictionary to try).
/// A key's tiers as stored: their names, comma-separated.
pub(crate) fn tiers_text(tiers: &[Tier]) -> String {
    tiers
        .iter()
        .map(|t| t.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// One stored tier name.
fn tier_from_text(text: &str) -> Result<Tier, StoreError> {
    Tier::parse(text)
        .ok()
        .flatten()
        .ok_or_else(|| StoreError::Invalid(format!("service tier {text:?}")))
}

/// Stored tier names ([`tiers_text`]).
fn tiers_from_text(text: &str) -> Result<Vec<Tier>, StoreError> {
    text.split(',').map(tier_from_text).collect()
}

/// A key's tiers and its own, as its `service_tiers` and `service_tier` columns hold them.
pub(crate) fn stored_tiers(
    tiers: Option<String>,
    default: Option<String>,
) -> Result<(Option<Vec<Tier>>, Option<Tier>), StoreError> {
    let tiers = tiers.map(|t| tiers_from_text(&t)).transpose()?;
    let default = default.map(|t| tier_from_text(&t)).transpose()?;
    Ok((tiers, default))
}

pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// A new secret: `prefix` followed by 32 bytes from the operating system's RNG in unpadded
/// URL-safe base64 (43 characters), e.g. `sk-sy-…` for an API key ([`API_KEY_PREFIX`]) or
/// `nt-…` for a node token ([`NODE_TOKEN_PREFIX`]). `Unavailable` if the OS RNG fails, so a
/// key is never minted from weaker randomness.
pub fn new_secret(prefix: &str) -> Result<String, StoreError> {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut bytes)
        .map_err(|e| StoreError::Unavailable(format!("operating system RNG: {e}")))?;
    let mut out = String::with_capacity(prefix.len() + 43);
    out.push_str(prefix);
    base64url(&bytes, &mut out);
    Ok(out)
}

/// The first [`DISPLAY_PREFIX_CHARS`] characters of a secret, kept to recognise it.
pub fn display_prefix(secret: &str) -> String {
    secret.chars().take(DISPLAY_PREFIX_CHARS).collect()
}

/// Unpadded URL-safe base64 (RFC 4648 §5), so secrets survive headers, URLs and shells
/// without quoting.
fn base64url(bytes: &[u8], out: &mut String) {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(bytes, out);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn b64(bytes: &[u8]) -> String {
        let mut s = String::new();
        base64url(bytes, &mut s);
        s
    }

    #[test]
    fn base64url_matches_rfc4648_vectors() {
        // RFC 4648 §10, without padding.
        assert_eq!(b64(b""), "");
        assert_eq!(b64(b"f"), "Zg");
        assert_eq!(b64(b"fo"), "Zm8");
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"foob"), "Zm9vYg");
        assert_eq!(b64(b"fooba"), "Zm9vYmE");
        assert_eq!(b64(b"foobar"), "Zm9vYmFy");
        // The URL-safe alphabet's two differing characters.
        assert_eq!(b64(&[0xfb, 0xff]), "-_8");
    }

    #[test]
    fn secrets_are_prefixed_long_and_distinct() {
        let a = new_secret(API_KEY_PREFIX).unwrap();
        let b = new_secret(API_KEY_PREFIX).unwrap();
        assert!(a.starts_with("sk-sy-"));
        assert_eq!(a.len(), 6 + 43);
        assert_ne!(a, b);
        assert!(
            a[6..]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
        let t = new_secret(NODE_TOKEN_PREFIX).unwrap();
        assert!(t.starts_with("nt-") && t.len() == 3 + 43);
        assert_eq!(display_prefix(&a), a[..12]);
    }

    #[test]
    fn hash_is_hex_sha256() {
        assert_eq!(
            hash_secret("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn key_usability_and_allowlist() {
        let now = Utc::now();
        let mut key = ApiKeyRecord {
            id: 1,
            team_id: 1,
            prefix: "sk-sy-abcdef".to_owned(),
            model_allowlist: None,
            rpm: None,
            tokens_per_day: None,
            max_streams: None,
            expires_at: None,
            revoked_at: None,
            message_quota: None,
            burst_capacity: None,
            burst_refill_seconds: None,
            service_tiers: None,
            service_tier: None,
            created_at: now,
        };
        assert!(key.is_usable(now) && key.allows_model("anything"));
        key.expires_at = Some(now);
        assert!(!key.is_usable(now));
        key.expires_at = None;
        key.revoked_at = Some(now);
        assert!(!key.is_usable(now));
        key.model_allowlist = Some(vec!["small".to_owned()]);
        assert!(key.allows_model("small") && !key.allows_model("large"));
        key.model_allowlist = Some(vec![]);
        assert!(!key.allows_model("small"));
    }

    #[test]
    fn admission_covers_exactly_the_balance() {
        assert!(covers(10, 0, 10));
        assert!(covers(10, 9, 1));
        assert!(!covers(10, 9, 2));
        assert!(covers(0, 0, 0), "a free request needs no balance");
        assert!(!covers(-1, 0, 0), "a team in debt admits nothing");
        assert!(!covers(i64::MAX, i64::MAX, i64::MAX), "no overflow");
    }

    #[tokio::test]
    async fn connect_store_refuses_unknown_schemes() {
        assert!(matches!(
            connect_store("mysql://localhost/db").await,
            Err(StoreError::Invalid(_))
        ));
    }

    #[test]
    fn ledger_status_round_trips() {
        for s in [
            LedgerStatus::Reserved,
            LedgerStatus::Settled,
            LedgerStatus::Cancelled,
        ] {
            assert_eq!(s.as_str().parse::<LedgerStatus>().unwrap(), s);
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert!("open".parse::<LedgerStatus>().is_err());
    }
}
