//! One fresh database per test, on either backend: a SQLite file in its own temp directory,
//! or a PostgreSQL database `sy_test_<random hex>` created through the server's `postgres`
//! database and dropped (best effort) when the test ends, passed or failed.
//!
//! PostgreSQL comes from `SWITCHYARD_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); when it cannot be reached the test fails
//! and says so — the PostgreSQL half of the suite is never skipped.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, SqlitePool};

use switchyard::store::{PostgresStore, SqliteStore, Store, connect_store};
use switchyard_actors::ports::Clock;

/// Where the PostgreSQL half runs unless the environment says otherwise.
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// The environment variable naming the PostgreSQL server (any database on it; tests create
/// their own).
pub const POSTGRES_URL_ENV: &str = "SWITCHYARD_TEST_DATABASE_URL";
/// How long the harness waits for PostgreSQL before failing the test.
const REACH_TIMEOUT: Duration = Duration::from_secs(5);

/// Which backend a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A concrete store, for what the trait does not offer (closing, a clock).
#[derive(Debug, Clone)]
pub enum Concrete {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

impl Concrete {
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        match self {
            Concrete::Sqlite(s) => Concrete::Sqlite(s.with_clock(clock)),
            Concrete::Postgres(s) => Concrete::Postgres(s.with_clock(clock)),
        }
    }

    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Concrete::Sqlite(s) => Arc::new(s.clone()),
            Concrete::Postgres(s) => Arc::new(s.clone()),
        }
    }

    pub async fn close(&self) {
        match self {
            Concrete::Sqlite(s) => s.close().await,
            Concrete::Postgres(s) => s.close().await,
        }
    }
}

/// A fresh, migrated database and a store on it.
#[derive(Debug)]
pub struct Db {
    pub backend: Backend,
    url: String,
    store: Arc<dyn Store>,
    /// Removes the database when the test ends; declared last so the store goes first.
    _cleanup: Cleanup,
}

impl Db {
    /// Creates the database for test `name`, connects through `connect_store` and migrates
    /// through the trait.
    pub async fn new(backend: Backend, name: &str) -> Self {
        let db = Self::unmigrated(backend, name).await;
        db.store.migrate().await.unwrap();
        db
    }

    /// A database with only the migrations up to `version` applied, as an older release left
    /// it; `store().migrate()` upgrades it.
    pub async fn at_version(backend: Backend, name: &str, version: i64) -> Self {
        let db = Self::unmigrated(backend, name).await;
        let mut migrator = match backend {
            Backend::Sqlite => sqlx::migrate!("./migrations/sqlite"),
            Backend::Postgres => sqlx::migrate!("./migrations/postgres"),
        };
        migrator.migrations = migrator
            .migrations
            .iter()
            .filter(|m| m.version <= version)
            .cloned()
            .collect::<Vec<_>>()
            .into();
        match db.raw().await {
            Raw::Sqlite(pool) => migrator.run(&pool).await.unwrap(),
            Raw::Postgres(pool) => migrator.run(&pool).await.unwrap(),
        }
        db
    }

    async fn unmigrated(backend: Backend, name: &str) -> Self {
        let (url, cleanup) = match backend {
            Backend::Sqlite => {
                static SEQ: AtomicU32 = AtomicU32::new(0);
                let dir = std::env::temp_dir().join(format!(
                    "switchyard-store-{}-{}-{name}",
                    std::process::id(),
                    SEQ.fetch_add(1, Ordering::Relaxed)
                ));
                let _ = std::fs::remove_dir_all(&dir);
                // The directory does not exist yet: `connect` creates it.
                let url = format!(
                    "sqlite://{}?mode=rwc",
                    dir.join("nested/switchyard.db").display()
                );
                (url, Cleanup::Dir(dir))
            }
            Backend::Postgres => {
                let server = postgres_server_url();
                let database = format!("sy_test_{:016x}", rand::random::<u64>());
                let mut admin = reach_postgres(&server).await;
                sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
                    .execute(&mut admin)
                    .await
                    .unwrap_or_else(|e| panic!("creating test database {database}: {e}"));
                let _ = admin.close().await;
                let url = with_database(&server, &database);
                (url, Cleanup::Postgres { server, database })
            }
        };
        let store = connect_store(&url)
            .await
            .unwrap_or_else(|e| panic!("connecting to the fresh {backend:?} database: {e}"));
        Self {
            backend,
            url,
            store,
            _cleanup: cleanup,
        }
    }

    /// The store every test body gets.
    pub fn store(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    /// The database's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A second store on the same database, as another process or a restart would open it.
    pub async fn reopen(&self) -> Arc<dyn Store> {
        let store = connect_store(&self.url).await.unwrap();
        store.migrate().await.unwrap();
        store
    }

    /// A second store on the same database, as its concrete type.
    pub async fn concrete(&self) -> Concrete {
        match self.backend {
            Backend::Sqlite => Concrete::Sqlite(SqliteStore::connect(&self.url).await.unwrap()),
            Backend::Postgres => {
                Concrete::Postgres(PostgresStore::connect(&self.url).await.unwrap())
            }
        }
    }

    /// A plain pool on the database, to check the tables with SQL the store does not offer.
    pub async fn raw(&self) -> Raw {
        match self.backend {
            Backend::Sqlite => Raw::Sqlite(SqlitePool::connect(&self.url).await.unwrap()),
            Backend::Postgres => Raw::Postgres(PgPool::connect(&self.url).await.unwrap()),
        }
    }
}

/// Plain SQL on a test database, in each backend's dialect.
#[derive(Debug)]
pub enum Raw {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

impl Raw {
    /// A team's credit entries in order: (amount, note).
    pub async fn credit_entries(&self, team_id: i64) -> Vec<(i64, String)> {
        const SQL: &str = "SELECT amount_microcredits, note FROM credit_entries \
                           WHERE team_id = $1 ORDER BY id";
        match self {
            Raw::Sqlite(pool) => sqlx::query_as(SQL).bind(team_id).fetch_all(pool).await,
            Raw::Postgres(pool) => sqlx::query_as(SQL).bind(team_id).fetch_all(pool).await,
        }
        .unwrap()
    }

    /// sum(credits) - sum(settled cost) of a team, from the tables.
    pub async fn credits_minus_settled(&self, team_id: i64) -> i64 {
        const SQL: &str = "SELECT CAST((SELECT COALESCE(SUM(amount_microcredits), 0) \
                           FROM credit_entries WHERE team_id = $1) \
                           - (SELECT COALESCE(SUM(cost_microcredits), 0) FROM usage_ledger \
                           WHERE team_id = $1 AND status = 'settled') AS BIGINT)";
        match self {
            Raw::Sqlite(pool) => sqlx::query_scalar(SQL).bind(team_id).fetch_one(pool).await,
            Raw::Postgres(pool) => sqlx::query_scalar(SQL).bind(team_id).fetch_one(pool).await,
        }
        .unwrap()
    }

    pub fn postgres(&self) -> &PgPool {
        match self {
            Raw::Postgres(pool) => pool,
            Raw::Sqlite(_) => panic!("not a PostgreSQL database"),
        }
    }

    pub fn sqlite(&self) -> &SqlitePool {
        match self {
            Raw::Sqlite(pool) => pool,
            Raw::Postgres(_) => panic!("not a SQLite database"),
        }
    }
}

/// What to remove when a [`Db`] drops.
#[derive(Debug)]
enum Cleanup {
    Dir(PathBuf),
    Postgres { server: String, database: String },
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        match self {
            Cleanup::Dir(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Cleanup::Postgres { server, database } => {
                // Drop runs outside any async context we could await in (and also while a
                // failed test unwinds), so a short-lived thread with its own runtime does it.
                // `WITH (FORCE)` ends the test's pooled connections that are still open.
                let (server, name) = (server.clone(), database.clone());
                let done = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .ok()?;
                    runtime.block_on(async {
                        let mut admin = PgConnection::connect(&server).await.ok()?;
                        let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                        let dropped = sqlx::query(AssertSqlSafe(sql)).execute(&mut admin).await;
                        let _ = admin.close().await;
                        dropped.ok()
                    })
                })
                .join();
                if !matches!(done, Ok(Some(_))) {
                    eprintln!("could not drop test database {database}; drop it by hand");
                }
            }
        }
    }
}

/// The PostgreSQL server the tests use.
pub fn postgres_server_url() -> String {
    std::env::var(POSTGRES_URL_ENV).unwrap_or_else(|_| DEFAULT_POSTGRES_URL.to_owned())
}

/// A connection to the server's maintenance database, or a failed test that says what to do.
async fn reach_postgres(server: &str) -> PgConnection {
    let shown = redact(server);
    match tokio::time::timeout(REACH_TIMEOUT, PgConnection::connect(server)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => panic!(
            "PostgreSQL is unreachable at {shown}: {e}. The store tests run every behaviour on \
             PostgreSQL too and never skip it: start PostgreSQL there, or set \
             {POSTGRES_URL_ENV} to a server where this user may CREATE DATABASE."
        ),
        Err(_) => panic!(
            "PostgreSQL at {shown} did not answer within {REACH_TIMEOUT:?}. The store tests \
             need it (set {POSTGRES_URL_ENV} to another server)."
        ),
    }
}

/// `url` with its database (path) replaced by `database`, query string kept.
pub fn with_database(url: &str, database: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let authority = head.find("://").map_or(0, |i| i + 3);
    let root = match head[authority..].find('/') {
        Some(slash) => &head[..authority + slash],
        None => head,
    };
    match query {
        Some(query) => format!("{root}/{database}?{query}"),
        None => format!("{root}/{database}"),
    }
}

/// `url` without its password, for messages.
fn redact(url: &str) -> String {
    let Some(at) = url.find('@') else {
        return url.to_owned();
    };
    let authority = url.find("://").map_or(0, |i| i + 3);
    match url[authority..at].find(':') {
        Some(colon) => format!("{}:***{}", &url[..authority + colon], &url[at..]),
        None => url.to_owned(),
    }
}

#[test]
fn urls_are_rewritten_and_redacted() {
    assert_eq!(
        with_database("postgres://u@h:5432/postgres", "x"),
        "postgres://u@h:5432/x"
    );
    assert_eq!(
        with_database("postgresql://u:p@h/db?sslmode=disable", "x"),
        "postgresql://u:p@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
    assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
}
