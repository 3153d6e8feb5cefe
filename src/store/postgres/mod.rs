//! [`PostgresStore`]: the production [`Store`] and [`Ledger`], on a PostgreSQL pool shared by
//! every replica. Its behaviour is [`super::SqliteStore`]'s, statement for statement; where
//! SQLite serialises writers with one lock, PostgreSQL relies on row locks: a reservation
//! locks its team's row before the balance check, a settle locks the ledger row it updates.
//!
//! Ledger transactions run at READ COMMITTED on purpose: each statement takes a fresh
//! snapshot, so a statement issued after a lock wait sees what the previous holder committed.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Timelike, Utc};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, Row, Transaction};

use switchyard_actors::ports::{
    Clock, Ledger, LedgerError, MAX_TOKEN_COUNT, Reservation, SettleOutcome, Settlement,
    SystemClock,
};

use super::drift::{
    DRIFT_REVIEWED, DRIFT_TOTALS, assemble, check_range, model_drift_from_row, reviewed_fetch_limit,
};
use super::sql::{Settled, bound_sql, clamped, ledger_columns, saturated, stored_bounds};
use super::{
    ApiKeyRecord, DriftReport, KeyRevocation, LedgerRow, LedgerStatus, NODE_LOCATIONS, NewApiKey,
    NodeRecord, Store, StoreError, Team, covers, stored_tiers, tiers_text,
};
use switchyard_actors::tier::Tier;

mod generations;
mod ledger;
mod node_days;
mod rows;
mod usage;
#[allow(unused_imports)]
use rows::*;

/// Connections per replica. Ledger transactions are a few short statements, so a small pool
/// serves hundreds of requests per second, and a fleet of replicas stays far below
/// PostgreSQL's default `max_connections` of 100.
const POOL_SIZE: u32 = 10;
/// How long a caller waits for a pooled connection (or a new one); past it, the store is
/// unavailable and admission fails closed.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Session settings of every connection. A lock wait is bounded, so a stuck holder of a
/// team's row turns admissions into `Unavailable` instead of piling them up; a session
/// that idles inside a transaction (a hung client) is ended, releasing its locks.
const SESSION_SETTINGS: [(&str, &str); 2] = [
    ("lock_timeout", "5s"),
    ("idle_in_transaction_session_timeout", "60s"),
];
/// Starts every ledger transaction; see the module documentation for why the level matters.
const BEGIN_LEDGER: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Columns of `api_keys` read into an [`ApiKeyRecord`] (the hash is left out on purpose).
macro_rules! key_columns {
    () => {
        "id, team_id, prefix, model_allowlist, rpm, tokens_per_day, max_streams, expires_at, \
         revoked_at, message_quota, burst_capacity, burst_refill_seconds, service_tiers, \
         service_tier, created_at"
    };
}

/// Columns of `nodes` read into a [`NodeRecord`]; the GPU document comes back as the text
/// the agent sent.
macro_rules! node_columns {
    () => {
        "id, location, token_hash, gpus::text AS gpus, models, last_seen, orchestrator_id, \
         drained_at, pool, created_at"
    };
}

/// The prompt tokens a settle bills: the claim within the row's bound.
macro_rules! billed_prompt {
    () => {
        concat!("LEAST($2, ", bound_sql!("prompt_token_bound"), ")")
    };
}

/// The completion tokens a settle bills: the claim within the row's bound.
macro_rules! billed_completion {
    () => {
        concat!("LEAST($3, ", bound_sql!("completion_token_bound"), ")")
    };
}

/// Settles row `$1` if it is still reserved, in one statement: bills the claim within the
/// row's bounds, keeps the claim and marks the row for review when clamped (`$5`, a
/// review the caller asks for, wins), prices the bill with the row's prices in exact NUMERIC
/// ([`cost_of`]: rounded up, saturated at i64::MAX), and returns what it wrote for the check
/// against the port's rule. In SET, column names read the row as it was before the update.
const SETTLE: &str = concat!(
    "UPDATE usage_ledger SET status = 'settled', prompt_tokens = ",
    billed_prompt!(),
    ", completion_tokens = ",
    billed_completion!(),
    ", claimed_prompt_tokens = CASE WHEN ",
    clamped!(),
    " THEN $2 END, claimed_completion_tokens = CASE WHEN ",
    clamped!(),
    " THEN $3 END, review = COALESCE($5, CASE WHEN ",
    clamped!(),
    " THEN 'usage_over_bound' END), cost_microcredits = LEAST(div(",
    billed_prompt!(),
    "::NUMERIC * price_input_per_mtok + ",
    billed_completion!(),
    "::NUMERIC * price_output_per_mtok + 999999, 1000000), 9223372036854775807)::BIGINT, \
     settled_at = $6, node_id = $7 WHERE request_id = $1 AND status = 'reserved' \
     RETURNING team_id, prompt_tokens, completion_tokens, claimed_prompt_tokens, \
     claimed_completion_tokens, review, cost_microcredits, price_input_per_mtok, \
     price_output_per_mtok, prompt_token_bound, completion_token_bound"
);

/// Starts the drift report's reads: one snapshot for both of its queries, so its totals and
/// its list of rows agree.
const BEGIN_REPORT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

/// The production store over PostgreSQL. Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    /// Source of every timestamp the store writes itself, so simulations control them.
    clock: Arc<dyn Clock>,
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:5432/db`, `postgresql://…`) with a pool of
    /// [`POOL_SIZE`] connections and a 5 s acquire timeout, and opens one connection to
    /// prove the database answers. Does not migrate: call [`PostgresStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_pool(url, POOL_SIZE).await
    }

    /// [`PostgresStore::connect`] with a pool of `connections` (at least one): for tests
    /// and benchmarks of behaviour under a scarce pool.
    pub async fn connect_with_pool(url: &str, connections: u32) -> Result<Self, StoreError> {
        // Without this check a `sqlite:` URL would fail later with a less helpful parse error.
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(StoreError::Invalid(
                "database url must start with postgres:// or postgresql://".to_owned(),
            ));
        }
        let mut options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Invalid(format!("database url: {e}")))?
            .options(SESSION_SETTINGS);
        if options.get_application_name().is_none() {
            options = options.application_name("switchyard");
        }
        let pool = PgPoolOptions::new()
            .max_connections(connections.max(1))
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(unavailable)?;
        Ok(Self {
            pool,
            clock: Arc::new(SystemClock),
        })
    }

    /// Uses `clock` for the timestamps the store writes itself (creation, revocation,
    /// settlement); the default is the system clock.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Applies the migrations in `migrations/postgres` (embedded at compile time); applied
    /// ones are skipped, and replicas starting together take turns on sqlx's advisory lock,
    /// so calling it at every start is fine.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::migrate!("./migrations/postgres")
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migration: {e}")))
    }

    /// Closes the pool, waiting for connections in use.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// The clock's wall time at the millisecond, the resolution SQLite keeps, so both
    /// backends hand back the same instants.
    fn now(&self) -> DateTime<Utc> {
        millis(self.clock.wall())
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.pool.begin_with(BEGIN_LEDGER).await
    }

    /// What a settle or cancel that changed nothing reports: `Unknown` when no row existed
    /// as its statement ran, `AlreadyFinal` when the row was final. A row that reads as
    /// `reserved` now was inserted after that statement's snapshot: it was unknown then.
    async fn unchanged<'e, E>(request_id: &str, db: E) -> Result<SettleOutcome, LedgerError>
    where
        E: sqlx::PgExecutor<'e>,
    {
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM usage_ledger WHERE request_id = $1")
                .bind(request_id)
                .fetch_optional(db)
                .await
                .map_err(ledger_unavailable)?;
        Ok(match status.as_deref() {
            None | Some("reserved") => SettleOutcome::Unknown,
            Some(_) => SettleOutcome::AlreadyFinal,
        })
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        PostgresStore::migrate(self).await
    }

    async fn create_team(&self, name: &str) -> Result<Team, StoreError> {
        if name.trim().is_empty() {
            return Err(StoreError::Invalid("team name is empty".to_owned()));
        }
        let row = sqlx::query(
            "INSERT INTO teams (name, balance_microcredits, created_at) VALUES ($1, 0, $2) \
             RETURNING id, name, balance_microcredits",
        )
        .bind(name)
        .bind(self.now())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| conflict_or(e, || format!("a team named {name:?} exists")))?;
        team_from_row(&row)
    }

    async fn team(&self, id: i64) -> Result<Option<Team>, StoreError> {
        sqlx::query("SELECT id, name, balance_microcredits FROM teams WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(team_from_row)
            .transpose()
    }

    async fn team_by_name(&self, name: &str) -> Result<Option<Team>, StoreError> {
        if !storable(name) {
            return Ok(None);
        }
        sqlx::query("SELECT id, name, balance_microcredits FROM teams WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(team_from_row)
            .transpose()
    }

    async fn teams(&self) -> Result<Vec<Team>, StoreError> {
        sqlx::query("SELECT id, name, balance_microcredits FROM teams ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?
            .iter()
            .map(team_from_row)
            .collect()
    }

    async fn add_credits(&self, team_id: i64, amount: i64, note: &str) -> Result<i64, StoreError> {
        if amount == 0 {
            return Err(StoreError::Invalid("credit amount is zero".to_owned()));
        }
        let now = self.now();
        let mut tx = self.begin().await.map_err(unavailable)?;
        let balance: i64 =
            sqlx::query_scalar("SELECT balance_microcredits FROM teams WHERE id = $1 FOR UPDATE")
                .bind(team_id)
                .fetch_optional(&mut *tx)
                .await
                .map_err(unavailable)?
                .ok_or(StoreError::NotFound)?;
        let new_balance = balance.checked_add(amount).ok_or_else(|| {
            StoreError::Invalid(format!("balance {balance} + {amount} overflows"))
        })?;
        sqlx::query(
            "INSERT INTO credit_entries (team_id, amount_microcredits, note, created_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(team_id)
        .bind(amount)
        .bind(note)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(|e| conflict_or(e, || "credit entry".to_owned()))?;
        sqlx::query("UPDATE teams SET balance_microcredits = $1 WHERE id = $2")
            .bind(new_balance)
            .bind(team_id)
            .execute(&mut *tx)
            .await
            .map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(new_balance)
    }

    async fn create_api_key(&self, key: NewApiKey) -> Result<ApiKeyRecord, StoreError> {
        if key.hash.is_empty() {
            return Err(StoreError::Invalid("key hash is empty".to_owned()));
        }
        let tokens_per_day = key
            .tokens_per_day
            .map(|t| {
                i64::try_from(t)
                    .map_err(|_| StoreError::Invalid(format!("tokens_per_day {t} too large")))
            })
            .transpose()?;
        let row = sqlx::query(concat!(
            "INSERT INTO api_keys (team_id, hash, prefix, model_allowlist, rpm, tokens_per_day, \
             max_streams, expires_at, message_quota, burst_capacity, burst_refill_seconds, \
             service_tiers, service_tier, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) RETURNING ",
            key_columns!()
        ))
        .bind(key.team_id)
        .bind(&key.hash)
        .bind(&key.prefix)
        .bind(&key.model_allowlist)
        .bind(key.rpm.map(i64::from))
        .bind(tokens_per_day)
        .bind(key.max_streams.map(i64::from))
        .bind(key.expires_at.map(millis))
        .bind(key.message_quota.map(i64::from))
        .bind(key.burst_capacity.map(i64::from))
        .bind(key.burst_refill_seconds.map(i64::from))
        .bind(key.service_tiers.as_deref().map(tiers_text))
        .bind(key.service_tier.map(Tier::as_str))
        .bind(self.now())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_foreign_key_violation() => StoreError::NotFound,
            _ => conflict_or(e, || "a key with this hash exists".to_owned()),
        })?;
        key_from_row(&row)
    }

    async fn api_key_by_hash(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
        if !storable(hash) {
            return Ok(None);
        }
        sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE hash = $1"
        ))
        .bind(hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?
        .as_ref()
        .map(key_from_row)
        .transpose()
    }

    async fn api_keys(&self, team_id: i64) -> Result<Vec<ApiKeyRecord>, StoreError> {
        sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE team_id = $1 ORDER BY id"
        ))
        .bind(team_id)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?
        .iter()
        .map(key_from_row)
        .collect()
    }

    async fn revoke_api_key(&self, id: i64) -> Result<KeyRevocation, StoreError> {
        let done =
            sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
                .bind(self.now())
                .bind(id)
                .execute(&self.pool)
                .await
                .map_err(unavailable)?;
        if done.rows_affected() == 1 {
            return Ok(KeyRevocation::Revoked);
        }
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = $1)")
                .bind(id)
                .fetch_one(&self.pool)
                .await
                .map_err(unavailable)?;
        Ok(if exists {
            KeyRevocation::AlreadyRevoked
        } else {
            KeyRevocation::Unknown
        })
    }

    async fn create_node(
        &self,
        id: &str,
        location: &str,
        token_hash: &str,
    ) -> Result<NodeRecord, StoreError> {
        if id.trim().is_empty() {
            return Err(StoreError::Invalid("node id is empty".to_owned()));
        }
        if !NODE_LOCATIONS.contains(&location) {
            return Err(StoreError::Invalid(format!(
                "node location {location:?} is not one of {NODE_LOCATIONS:?}"
            )));
        }
        if token_hash.is_empty() {
            return Err(StoreError::Invalid("token hash is empty".to_owned()));
        }
        // One statement decides atomically: a new node is inserted, a revoked one gets the
        // new token, and a node with a live token matches neither and returns no row.
        let row = sqlx::query(concat!(
            "INSERT INTO nodes (id, location, token_hash, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (id) DO UPDATE SET token_hash = EXCLUDED.token_hash, \
             location = EXCLUDED.location WHERE nodes.token_hash IS NULL RETURNING ",
            node_columns!()
        ))
        .bind(id)
        .bind(location)
        .bind(token_hash)
        .bind(self.now())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| conflict_or(e, || "another node has this token hash".to_owned()))?
        .ok_or_else(|| StoreError::Conflict(format!("node {id:?} has a live token")))?;
        node_from_row(&row)
    }

    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        if !storable(id) {
            return Ok(None);
        }
        sqlx::query(concat!(
            "SELECT ",
            node_columns!(),
            " FROM nodes WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?
        .as_ref()
        .map(node_from_row)
        .transpose()
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        // `nodes.id` is `COLLATE "C"`: byte order, as SQLite sorts.
        sqlx::query(concat!(
            "SELECT ",
            node_columns!(),
            " FROM nodes ORDER BY id"
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?
        .iter()
        .map(node_from_row)
        .collect()
    }

    async fn revoke_node_token(&self, id: &str) -> Result<bool, StoreError> {
        if !storable(id) {
            return Ok(false);
        }
        let done = sqlx::query(
            "UPDATE nodes SET token_hash = NULL WHERE id = $1 AND token_hash IS NOT NULL",
        )
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    async fn record_node_registration(
        &self,
        id: &str,
        gpus: serde_json::Value,
        models: &[String],
        orchestrator_id: &str,
        at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        if !storable(id) {
            return Err(StoreError::NotFound);
        }
        let done = sqlx::query(
            "UPDATE nodes SET gpus = $1::json, models = $2, orchestrator_id = $3, \
             last_seen = $4 WHERE id = $5",
        )
        .bind(gpus.to_string())
        .bind(models)
        .bind(orchestrator_id)
        .bind(millis(at))
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(|e| conflict_or(e, String::new))?;
        found(done.rows_affected())
    }

    async fn mark_node_drained(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        if !storable(id) {
            return Err(StoreError::NotFound);
        }
        let done = sqlx::query("UPDATE nodes SET drained_at = $1 WHERE id = $2")
            .bind(millis(at))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(|e| conflict_or(e, String::new))?;
        found(done.rows_affected())
    }

    async fn ledger_row(&self, request_id: &str) -> Result<Option<LedgerRow>, StoreError> {
        if !storable(request_id) {
            return Ok(None);
        }
        sqlx::query(concat!(
            "SELECT ",
            ledger_columns!(),
            " FROM usage_ledger WHERE request_id = $1"
        ))
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(unavailable)?
        .as_ref()
        .map(ledger_from_row)
        .transpose()
    }

    async fn ledger_rows(&self, team_id: Option<i64>) -> Result<Vec<LedgerRow>, StoreError> {
        sqlx::query(concat!(
            "SELECT ",
            ledger_columns!(),
            " FROM usage_ledger WHERE $1::BIGINT IS NULL OR team_id = $1 ORDER BY id"
        ))
        .bind(team_id)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)?
        .iter()
        .map(ledger_from_row)
        .collect()
    }

    async fn open_reservations(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar("SELECT COUNT(*) FROM usage_ledger WHERE status = 'reserved'")
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)
    }

    async fn stale_reservations(
        &self,
        before: DateTime<Utc>,
        limit: i64,
    ) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar(
            "SELECT request_id FROM usage_ledger WHERE status = 'reserved' AND created_at < $1 \
             ORDER BY created_at LIMIT $2",
        )
        .bind(before)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(unavailable)
    }

    async fn drift_report(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<DriftReport, StoreError> {
        check_range(from, to)?;
        // Compared at the millisecond, as stored and as SQLite compares.
        let (start, end) = (millis(from), millis(to));
        let mut tx = self
            .pool
            .begin_with(BEGIN_REPORT)
            .await
            .map_err(unavailable)?;
        let models = sqlx::query(DRIFT_TOTALS)
            .bind(start)
            .bind(end)
            .fetch_all(&mut *tx)
            .await
            .map_err(unavailable)?
            .iter()
            .map(model_drift_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let reviewed = sqlx::query(DRIFT_REVIEWED)
            .bind(start)
            .bind(end)
            .bind(reviewed_fetch_limit())
            .fetch_all(&mut *tx)
            .await
            .map_err(unavailable)?
            .iter()
            .map(reviewed_from_pg_row)
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await.map_err(unavailable)?;
        Ok(assemble(from, to, models, reviewed))
    }

    async fn settled_by_model(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<std::collections::BTreeMap<String, super::TokenTotals>, StoreError> {
        self.settled_by_model_impl(from, to).await
    }

    async fn add_node_day(&self, usage: &super::NodeDayUsage) -> Result<(), StoreError> {
        self.add_node_day_impl(usage).await
    }

    async fn node_days(
        &self,
        from: chrono::NaiveDate,
        to: chrono::NaiveDate,
    ) -> Result<Vec<super::NodeDay>, StoreError> {
        self.node_days_impl(from, to).await
    }

    async fn node_day_ledger(
        &self,
        from: chrono::NaiveDate,
        to: chrono::NaiveDate,
    ) -> Result<Vec<super::NodeDayLedger>, StoreError> {
        self.node_day_ledger_impl(from, to).await
    }

    async fn set_node_pool(&self, id: &str, pool: Option<&str>) -> Result<(), StoreError> {
        self.set_node_pool_impl(id, pool).await
    }

    async fn usage_by_day(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        team_id: Option<i64>,
    ) -> Result<Vec<super::usage::UsageDay>, StoreError> {
        super::drift::check_range(from, to)?;
        self.usage_by_day_impl(from, to, team_id).await
    }

    async fn credit_entries(
        &self,
        team_id: i64,
        limit: i64,
    ) -> Result<Vec<super::usage::CreditEntry>, StoreError> {
        self.credit_entries_impl(team_id, limit).await
    }

    async fn keys_last_used(
        &self,
        team_id: i64,
    ) -> Result<std::collections::BTreeMap<i64, DateTime<Utc>>, StoreError> {
        self.keys_last_used_impl(team_id).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(unavailable)
    }
}
