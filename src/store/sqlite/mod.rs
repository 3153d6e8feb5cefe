//! [`SqliteStore`]: the [`Store`] and [`Ledger`] of the embedded mode, on one SQLite file
//! (or an in-memory database for tests). Write transactions start with `BEGIN IMMEDIATE`, so
//! concurrent writers queue on the busy timeout instead of failing on a lock upgrade.
//!
//! Timestamps are stored as INTEGER unix milliseconds (see `migrations/sqlite/0001_init.sql`).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{ConnectOptions, Row, Sqlite, Transaction};
use tokio::sync::{Mutex, OwnedMutexGuard};

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

/// How long a statement waits for another connection's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a caller waits for a pooled connection; past it, the store is unavailable.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections to a file database. Writers serialise on SQLite's lock anyway; the extra
/// connections let WAL readers (auth lookups, reports) run beside a writer.
const FILE_POOL_SIZE: u32 = 8;
/// Starts every write transaction: takes the write lock up front, so a transaction that
/// reads before it writes (the balance check) cannot lose a lock upgrade to another writer.
const BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

/// Columns of `api_keys` read into an [`ApiKeyRecord`] (the hash is left out on purpose).
macro_rules! key_columns {
    () => {
        "id, team_id, prefix, model_allowlist, rpm, tokens_per_day, max_streams, expires_at, \
         revoked_at, message_quota, burst_capacity, burst_refill_seconds, service_tiers, \
         service_tier, created_at"
    };
}

/// Columns of `nodes` read into a [`NodeRecord`].
macro_rules! node_columns {
    () => {
        "id, location, token_hash, gpus, models, last_seen, orchestrator_id, drained_at, \
         pool, created_at"
    };
}

/// Settles row `$1` if it is still reserved, in one statement: bills the claim within the
/// row's bounds, keeps the claim and marks the row for review when clamped (`$5`, a review
/// the caller asks for, wins), and returns what it wrote for the check against the port's
/// rule. SQLite has no exact arithmetic past i64 (an overflow turns into a REAL), so the
/// cost is `$6`, [`cost_of`] of the same bill computed from the row as read under the write
/// lock; the check compares the bill the statement wrote with the one that was priced.
///
/// [`cost_of`]: switchyard_actors::ports::cost_of
const SETTLE: &str = concat!(
    "UPDATE usage_ledger SET status = 'settled', prompt_tokens = MIN($2, ",
    bound_sql!("prompt_token_bound"),
    "), completion_tokens = MIN($3, ",
    bound_sql!("completion_token_bound"),
    "), claimed_prompt_tokens = CASE WHEN ",
    clamped!(),
    " THEN $2 END, claimed_completion_tokens = CASE WHEN ",
    clamped!(),
    " THEN $3 END, review = COALESCE($5, CASE WHEN ",
    clamped!(),
    " THEN 'usage_over_bound' END), cost_microcredits = $6, settled_at = $7, node_id = $8 \
     WHERE request_id = $1 AND status = 'reserved' \
     RETURNING prompt_tokens, completion_tokens, claimed_prompt_tokens, \
     claimed_completion_tokens, review, cost_microcredits"
);

/// The embedded store over SQLite. Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    /// Writers of this process take turns here before SQLite's write lock. SQLite admits one
    /// writer at a time anyway, and its busy handler waits by polling with sleeps of up to
    /// 100 ms; an async queue hands the lock over at once. The busy timeout still covers
    /// other processes on the same file.
    writer: Arc<Mutex<()>>,
    /// Source of every timestamp the store writes itself, so simulations control them.
    clock: Arc<dyn Clock>,
}

impl SqliteStore {
    /// Opens the database at `url` (`sqlite://path/to.db?mode=rwc`, `sqlite::memory:`) with
    /// WAL journaling, foreign keys, full fsync on commit and a 5 s busy timeout; creates the
    /// file's directory when `mode=rwc` asks for the file to be created. Does not migrate:
    /// call [`SqliteStore::migrate`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        // Without this check a `postgres://` URL would be taken for a file name.
        if !url.starts_with("sqlite:") {
            return Err(StoreError::Invalid(
                "database url must start with sqlite:".to_owned(),
            ));
        }
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::Invalid(format!("database url: {e}")))?
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        // The parser marks in-memory databases internally but offers no getter.
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");

        let pool = if in_memory {
            // One connection, kept forever: an in-memory database lives exactly as long as
            // its last connection, and a single connection sees one consistent database.
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_with(options)
                .await
                .map_err(unavailable)?
        } else {
            if url.contains("mode=rwc")
                && let Some(dir) = options.get_filename().parent()
                && !dir.as_os_str().is_empty()
            {
                tokio::fs::create_dir_all(dir).await.map_err(|e| {
                    StoreError::Unavailable(format!("creating {}: {e}", dir.display()))
                })?;
            }
            // Switching a database to WAL needs an exclusive lock that the busy timeout does
            // not wait for; doing it once on a lone connection keeps the pool's connections
            // from racing for it.
            let first = options.connect().await.map_err(unavailable)?;
            drop(first);
            SqlitePoolOptions::new()
                .max_connections(FILE_POOL_SIZE)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_with(options)
                .await
                .map_err(unavailable)?
        };
        Ok(Self {
            pool,
            writer: Arc::new(Mutex::new(())),
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

    /// Applies the migrations in `migrations/sqlite` (embedded at compile time); applied ones
    /// are skipped, so calling it at every start is fine.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::migrate!("./migrations/sqlite")
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migration: {e}")))
    }

    /// Closes the pool, waiting for connections in use (a clean shutdown checkpoints WAL).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Begins a write transaction once this store's previous writer is done.
    async fn begin_write(&self) -> Result<WriteTx, sqlx::Error> {
        let turn = Arc::clone(&self.writer).lock_owned().await;
        let tx = self.pool.begin_with(BEGIN_WRITE).await?;
        Ok(WriteTx { tx, _turn: turn })
    }

    fn now_millis(&self) -> i64 {
        self.clock.wall().timestamp_millis()
    }

    /// Moves a `reserved` row to `settled` (with a settlement) or to `cancelled` (without),
    /// in one transaction; a settlement bills the claim within the row's bounds, prices the
    /// bill with the row's own prices and debits the team.
    async fn finish(
        &self,
        request_id: &str,
        settlement: Option<&Settlement>,
    ) -> Result<SettleOutcome, LedgerError> {
        let now = self.now_millis();
        // The write lock is held from the first statement, so the row read here cannot
        // change before the update: of any number of concurrent or retried settles, exactly
        // one sees it `reserved`. Returning early drops `w`, which rolls back and releases
        // the lock.
        let mut w = self.begin_write().await.map_err(ledger_unavailable)?;
        let row = sqlx::query(
            "SELECT team_id, status, price_input_per_mtok, price_output_per_mtok, \
             prompt_token_bound, completion_token_bound \
             FROM usage_ledger WHERE request_id = ?",
        )
        .bind(request_id)
        .fetch_optional(&mut *w.tx)
        .await
        .map_err(ledger_unavailable)?;
        let Some(row) = row else {
            return Ok(SettleOutcome::Unknown);
        };
        let status: String = row.try_get("status").map_err(ledger_unavailable)?;
        if status != LedgerStatus::Reserved.as_str() {
            return Ok(SettleOutcome::AlreadyFinal);
        }
        let team_id: i64 = row.try_get("team_id").map_err(ledger_unavailable)?;

        let Some(s) = settlement else {
            let changed = sqlx::query(
                "UPDATE usage_ledger SET status = 'cancelled', settled_at = ? \
                 WHERE request_id = ? AND status = 'reserved'",
            )
            .bind(now)
            .bind(request_id)
            .execute(&mut *w.tx)
            .await
            .map_err(ledger_unavailable)?
            .rows_affected();
            if changed != 1 {
                return Ok(SettleOutcome::AlreadyFinal);
            }
            w.tx.commit().await.map_err(ledger_unavailable)?;
            return Ok(SettleOutcome::Applied);
        };

        let get = |name: &str| row.try_get::<i64, _>(name).map_err(ledger_unavailable);
        let get_opt = |name: &str| {
            row.try_get::<Option<i64>, _>(name)
                .map_err(ledger_unavailable)
        };
        let expected = Settled::expected(
            s,
            stored_bounds(
                get_opt("prompt_token_bound")?,
                get_opt("completion_token_bound")?,
            ),
            get("price_input_per_mtok")?,
            get("price_output_per_mtok")?,
        );
        // Any claim settles: a count beyond i64 is bound saturated, which bills the same (no
        // bound exceeds i64::MAX), and `$4` keeps it counted as over the bound.
        let beyond = s.prompt_tokens > MAX_TOKEN_COUNT || s.completion_tokens > MAX_TOKEN_COUNT;
        // `status = 'reserved'` again: redundant under the write lock, kept so the statement
        // is exactly-once on its own.
        let Some(written) = sqlx::query(SETTLE)
            .bind(request_id)
            .bind(saturated(s.prompt_tokens))
            .bind(saturated(s.completion_tokens))
            .bind(beyond)
            .bind(s.review.map(|r| r.as_str()))
            .bind(expected.cost)
            .bind(now)
            .bind(s.node_id.as_deref())
            .fetch_optional(&mut *w.tx)
            .await
            .map_err(ledger_unavailable)?
        else {
            return Ok(SettleOutcome::AlreadyFinal);
        };
        let get = |name: &str| written.try_get::<i64, _>(name).map_err(ledger_unavailable);
        let get_opt = |name: &str| {
            written
                .try_get::<Option<i64>, _>(name)
                .map_err(ledger_unavailable)
        };
        let claimed = match (
            get_opt("claimed_prompt_tokens")?,
            get_opt("claimed_completion_tokens")?,
        ) {
            (Some(p), Some(c)) => Some((p, c)),
            _ => None,
        };
        let cost = Settled {
            prompt_tokens: get("prompt_tokens")?,
            completion_tokens: get("completion_tokens")?,
            claimed,
            review: written.try_get("review").map_err(ledger_unavailable)?,
            cost: get("cost_microcredits")?,
        }
        .check(&expected, request_id)?
        .cost;
        // An overflow would become REAL in SQLite; the STRICT table refuses it and the whole
        // settlement rolls back.
        sqlx::query(
            "UPDATE teams SET balance_microcredits = balance_microcredits - ? WHERE id = ?",
        )
        .bind(cost)
        .bind(team_id)
        .execute(&mut *w.tx)
        .await
        .map_err(ledger_unavailable)?;
        w.tx.commit().await.map_err(ledger_unavailable)?;
        Ok(SettleOutcome::Applied)
    }
}

/// A write transaction holding this store's writer turn. Field order matters: the
/// transaction (rolled back if not committed) drops before the turn passes on.
struct WriteTx {
    tx: Transaction<'static, Sqlite>,
    _turn: OwnedMutexGuard<()>,
}

#[async_trait]
impl Store for SqliteStore {
    async fn migrate(&self) -> Result<(), StoreError> {
        SqliteStore::migrate(self).await
    }

    async fn create_team(&self, name: &str) -> Result<Team, StoreError> {
        if name.trim().is_empty() {
            return Err(StoreError::Invalid("team name is empty".to_owned()));
        }
        let _turn = self.writer.lock().await;
        let row = sqlx::query(
            "INSERT INTO teams (name, balance_microcredits, created_at) VALUES (?, 0, ?) \
             RETURNING id, name, balance_microcredits",
        )
        .bind(name)
        .bind(self.now_millis())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| conflict_or(e, || format!("a team named {name:?} exists")))?;
        team_from_row(&row)
    }

    async fn team(&self, id: i64) -> Result<Option<Team>, StoreError> {
        sqlx::query("SELECT id, name, balance_microcredits FROM teams WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(unavailable)?
            .as_ref()
            .map(team_from_row)
            .transpose()
    }

    async fn team_by_name(&self, name: &str) -> Result<Option<Team>, StoreError> {
        sqlx::query("SELECT id, name, balance_microcredits FROM teams WHERE name = ?")
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
        let now = self.now_millis();
        let mut w = self.begin_write().await.map_err(unavailable)?;
        let balance: i64 =
            sqlx::query_scalar("SELECT balance_microcredits FROM teams WHERE id = ?")
                .bind(team_id)
                .fetch_optional(&mut *w.tx)
                .await
                .map_err(unavailable)?
                .ok_or(StoreError::NotFound)?;
        let new_balance = balance.checked_add(amount).ok_or_else(|| {
            StoreError::Invalid(format!("balance {balance} + {amount} overflows"))
        })?;
        sqlx::query(
            "INSERT INTO credit_entries (team_id, amount_microcredits, note, created_at) \
             VALUES (?, ?, ?, ?)",
        )
        .bind(team_id)
        .bind(amount)
        .bind(note)
        .bind(now)
        .execute(&mut *w.tx)
        .await
        .map_err(unavailable)?;
        sqlx::query("UPDATE teams SET balance_microcredits = ? WHERE id = ?")
            .bind(new_balance)
            .bind(team_id)
            .execute(&mut *w.tx)
            .await
            .map_err(unavailable)?;
        w.tx.commit().await.map_err(unavailable)?;
        Ok(new_balance)
    }

    async fn create_api_key(&self, key: NewApiKey) -> Result<ApiKeyRecord, StoreError> {
        if key.hash.is_empty() {
            return Err(StoreError::Invalid("key hash is empty".to_owned()));
        }
        let allowlist = key
            .model_allowlist
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| StoreError::Invalid(format!("model allowlist: {e}")))?;
        let tokens_per_day = key
            .tokens_per_day
            .map(|t| {
                i64::try_from(t)
                    .map_err(|_| StoreError::Invalid(format!("tokens_per_day {t} too large")))
            })
            .transpose()?;
        let _turn = self.writer.lock().await;
        let row = sqlx::query(concat!(
            "INSERT INTO api_keys (team_id, hash, prefix, model_allowlist, rpm, tokens_per_day, \
             max_streams, expires_at, message_quota, burst_capacity, burst_refill_seconds, \
             service_tiers, service_tier, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING ",
            key_columns!()
        ))
        .bind(key.team_id)
        .bind(&key.hash)
        .bind(&key.prefix)
        .bind(allowlist)
        .bind(key.rpm.map(i64::from))
        .bind(tokens_per_day)
        .bind(key.max_streams.map(i64::from))
        .bind(key.expires_at.map(|t| t.timestamp_millis()))
        .bind(key.message_quota.map(i64::from))
        .bind(key.burst_capacity.map(i64::from))
        .bind(key.burst_refill_seconds.map(i64::from))
        .bind(key.service_tiers.as_deref().map(tiers_text))
        .bind(key.service_tier.map(Tier::as_str))
        .bind(self.now_millis())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_foreign_key_violation() => StoreError::NotFound,
            _ => conflict_or(e, || "a key with this hash exists".to_owned()),
        })?;
        key_from_row(&row)
    }

    async fn api_key_by_hash(&self, hash: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
        sqlx::query(concat!(
            "SELECT ",
            key_columns!(),
            " FROM api_keys WHERE hash = ?"
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
            " FROM api_keys WHERE team_id = ? ORDER BY id"
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
        let _turn = self.writer.lock().await;
        let done =
            sqlx::query("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL")
                .bind(self.now_millis())
                .bind(id)
                .execute(&self.pool)
                .await
                .map_err(unavailable)?;
        if done.rows_affected() == 1 {
            return Ok(KeyRevocation::Revoked);
        }
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = ?)")
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
        let _turn = self.writer.lock().await;
        let row = sqlx::query(concat!(
            "INSERT INTO nodes (id, location, token_hash, created_at) VALUES (?, ?, ?, ?) \
             ON CONFLICT (id) DO UPDATE SET token_hash = excluded.token_hash, \
             location = excluded.location WHERE nodes.token_hash IS NULL RETURNING ",
            node_columns!()
        ))
        .bind(id)
        .bind(location)
        .bind(token_hash)
        .bind(self.now_millis())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| conflict_or(e, || "another node has this token hash".to_owned()))?
        .ok_or_else(|| StoreError::Conflict(format!("node {id:?} has a live token")))?;
        node_from_row(&row)
    }

    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        sqlx::query(concat!(
            "SELECT ",
            node_columns!(),
            " FROM nodes WHERE id = ?"
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
        let _turn = self.writer.lock().await;
        let done = sqlx::query(
            "UPDATE nodes SET token_hash = NULL WHERE id = ? AND token_hash IS NOT NULL",
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
        let models = serde_json::to_string(models)
            .map_err(|e| StoreError::Invalid(format!("models: {e}")))?;
        let _turn = self.writer.lock().await;
        let done = sqlx::query(
            "UPDATE nodes SET gpus = ?, models = ?, orchestrator_id = ?, last_seen = ? \
             WHERE id = ?",
        )
        .bind(gpus.to_string())
        .bind(models)
        .bind(orchestrator_id)
        .bind(at.timestamp_millis())
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(unavailable)?;
        found(done.rows_affected())
    }

    async fn mark_node_drained(&self, id: &str, at: DateTime<Utc>) -> Result<(), StoreError> {
        let _turn = self.writer.lock().await;
        let done = sqlx::query("UPDATE nodes SET drained_at = ? WHERE id = ?")
            .bind(at.timestamp_millis())
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        found(done.rows_affected())
    }

    async fn ledger_row(&self, request_id: &str) -> Result<Option<LedgerRow>, StoreError> {
        sqlx::query(concat!(
            "SELECT ",
            ledger_columns!(),
            " FROM usage_ledger WHERE request_id = ?"
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
            " FROM usage_ledger WHERE ?1 IS NULL OR team_id = ?1 ORDER BY id"
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
            "SELECT request_id FROM usage_ledger WHERE status = 'reserved' AND created_at < ? \
             ORDER BY created_at LIMIT ?",
        )
        .bind(before.timestamp_millis())
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
        let (start, end) = (from.timestamp_millis(), to.timestamp_millis());
        // A read transaction: in WAL mode both queries read one snapshot, so the totals and
        // the list agree, and no writer waits on them.
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
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
            .map(reviewed_from_sqlite_row)
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
