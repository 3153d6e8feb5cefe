//! The server's own outbound edges over TLS, against real servers started here: Redis with
//! only a TLS port, and a PostgreSQL cluster with `ssl=on`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use switchyard::coord::{CoordError, Coordinator, RedisCoordinator, RedisCoordinatorOptions};
use switchyard::store::{PostgresStore, Store};

use crate::common::wait_for;
use crate::{Pki, TempDir};

const FAST: RedisCoordinatorOptions = RedisCoordinatorOptions {
    command_timeout: Duration::from_secs(2),
    health_interval: Duration::from_millis(500),
};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn port_open(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_verifies_the_server_with_the_redis_ca_file() {
    switchyard::tls::install_provider();
    let pki = Pki::new("redis", &["127.0.0.1"]);
    let stranger = Pki::new("redis-stranger", &["127.0.0.1"]);
    let port = free_port();
    // No plain port at all: whatever answers below answered over TLS.
    let _redis = tokio::process::Command::new("redis-server")
        .args(["--port", "0", "--tls-port", &port.to_string()])
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--tls-cert-file")
        .arg(&pki.cert)
        .arg("--tls-key-file")
        .arg(&pki.key)
        .arg("--tls-ca-cert-file")
        .arg(&pki.ca)
        .args(["--tls-auth-clients", "no"])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server with TLS support");
    wait_for(Duration::from_secs(10), "redis-server to listen", || {
        port_open(port)
    })
    .await;
    let url = format!("rediss://127.0.0.1:{port}");
    let prefix = format!("tls-test:{:08x}:", rand::random::<u32>());

    let redis = RedisCoordinator::connect_tls(&url, &prefix, FAST, Some(&pki.ca))
        .await
        .unwrap();
    assert_eq!(
        redis.incr("n", 2, Duration::from_secs(60)).await.unwrap(),
        2
    );
    assert_eq!(
        redis.incr("n", 3, Duration::from_secs(60)).await.unwrap(),
        5
    );
    assert_eq!(
        redis
            .acquire_lease("queue", "me", Duration::from_secs(60))
            .await
            .unwrap()
            .map(|fence| fence > 0),
        Some(true),
        "a script runs over TLS too"
    );

    // Another CA, or the web PKI roots alone: the server is refused at connect.
    let wrong = RedisCoordinator::connect_tls(&url, &prefix, FAST, Some(&stranger.ca)).await;
    assert!(
        matches!(wrong, Err(CoordError::Unavailable(_))),
        "{wrong:?}"
    );
    let web_roots = RedisCoordinator::connect_with(&url, &prefix, FAST).await;
    assert!(
        matches!(web_roots, Err(CoordError::Unavailable(_))),
        "{web_roots:?}"
    );
    // A CA file is for TLS only.
    let plain =
        RedisCoordinator::connect_tls("redis://127.0.0.1:1", &prefix, FAST, Some(&pki.ca)).await;
    assert!(plain.is_err());
}

/// A throwaway PostgreSQL cluster (owned by the `postgres` user, as `initdb` requires),
/// stopped on drop, also when the test fails.
struct PgCluster {
    dir: TempDir,
    bin: PathBuf,
    port: u16,
}

fn as_postgres(bin: &Path, tool: &str) -> Command {
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", "postgres", "--"]).arg(bin.join(tool));
    cmd.stdout(Stdio::null());
    cmd
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl PgCluster {
    /// `initdb`, the server certificate and key in the data directory, `ssl=on`.
    fn start(cert: &Path, key: &Path) -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .max()
            .expect("PostgreSQL server binaries under /usr/lib/postgresql");
        let dir = TempDir::new("pg");
        run(Command::new("chown")
            .arg("postgres:postgres")
            .arg(dir.path()));
        let data = dir.path().join("data");
        run(as_postgres(&bin, "initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
        ]));
        for (from, to) in [(cert, "server.crt"), (key, "server.key")] {
            let to = data.join(to);
            std::fs::copy(from, &to).unwrap();
            run(Command::new("chown").arg("postgres:postgres").arg(&to));
        }
        run(Command::new("chmod")
            .arg("600")
            .arg(data.join("server.key")));
        let port = free_port();
        let cluster = Self { dir, bin, port };
        run(as_postgres(&cluster.bin, "pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(cluster.dir.path().join("log"))
            .arg("-o")
            .arg(format!(
                "-p {port} -k {} -c listen_addresses=127.0.0.1 -c ssl=on -c fsync=off",
                cluster.dir.path().display()
            ))
            .args(["-w", "start"]));
        cluster
    }

    fn url(&self, query: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?{query}",
            self.port
        )
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether the session behind `url` is encrypted, as the server sees it.
async fn session_is_tls(url: &str) -> bool {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    ssl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_sslmode_verify_full_and_require() {
    let pki = Pki::new("pg", &["127.0.0.1", "localhost"]);
    let stranger = Pki::new("pg-stranger", &["127.0.0.1"]);
    let (cert, key) = (pki.cert.clone(), pki.key.clone());
    let cluster = tokio::task::spawn_blocking(move || PgCluster::start(&cert, &key))
        .await
        .unwrap();

    let verified = cluster.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        pki.ca.display()
    ));
    let store = PostgresStore::connect(&verified).await.unwrap();
    store.migrate().await.unwrap();
    let team = store.create_team("over-tls").await.unwrap();
    assert_eq!(
        store.team_by_name("over-tls").await.unwrap().map(|t| t.id),
        Some(team.id)
    );
    store.close().await;
    assert!(session_is_tls(&verified).await);

    let required = cluster.url("sslmode=require");
    let store = PostgresStore::connect(&required).await.unwrap();
    assert!(store.team_by_name("over-tls").await.unwrap().is_some());
    store.close().await;
    assert!(session_is_tls(&required).await);

    let wrong_ca = cluster.url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        stranger.ca.display()
    ));
    let refused = PostgresStore::connect(&wrong_ca).await;
    assert!(refused.is_err(), "a server signed by another CA is refused");
    drop(cluster);
}
