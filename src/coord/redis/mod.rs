//! [`RedisCoordinator`]: the production [`Coordinator`], shared by every replica through one
//! Redis. Multi-command operations are Lua scripts, so each is as atomic as the in-process
//! [`MemoryCoordinator`](super::MemoryCoordinator) it must behave like; every call is bounded
//! by a timeout and every failure is [`CoordError::Unavailable`], so callers fail closed.
//!
//! Key layout under the deployment's prefix (callers' names are otherwise kept as given):
//! - `{prefix}k:{key}` hashes, counters and leases: the one keyspace of the port;
//! - `{prefix}f:{lease}` the lease's fencing counter, never expiring, outside the port's
//!   keyspace so that no `delete` or `put_hash` can reset it;
//! - `{prefix}c:{channel}` pub/sub channels (Redis channels ignore the database number, so
//!   the prefix is what keeps deployments apart);
//! - `{prefix}x:{instance}:{n}` the private control channel of one pub/sub connection;
//! - a journal is a Redis stream at `{prefix}k:{key}` whose ids are `0-<number + 1>`, so
//!   XRANGE reads "after n" without an index; its appends publish on
//!   `{prefix}c:journal:{key}` to wake readers waiting for the next event. Reads never use
//!   XREAD BLOCK: it would stall the shared command connection for every other caller.
//!
//! A lease is a string `lease:<token>:<owner>`: a hash read or a counter increment on it
//! fails as on any other kind mismatch, and the scripts refuse strings not in that shape.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisError, RedisResult, TlsCertificates};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tokio_util::sync::CancellationToken;

use switchyard_actors::ports::{CoordError, Coordinator, LimitVerdict};

mod journal;
mod pubsub;
mod scripts;
use pubsub::PubSubConn;
use scripts::{
    ACQUIRE_LEASE, ACQUIRE_SLOT, CLAIM_HASH, DELETE_FENCED, INCR, PUT_HASH, PUT_HASH_FENCED,
    RELEASE_LEASE, WINDOW_ADMIT,
};

/// How long one call may wait for Redis before it fails with `Unavailable`.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the pub/sub connection is pinged; an unanswered ping ends its subscriptions.
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(5);

/// Longest TTL handed to Redis, in milliseconds: far beyond any real TTL, and small enough
/// that Redis never rejects `now + ttl` as an overflow.
const MAX_TTL_MS: u64 = 1 << 60;

/// Tunables of [`RedisCoordinator::connect_with`].
#[derive(Debug, Clone, Copy)]
pub struct RedisCoordinatorOptions {
    /// Bound on every call (and on connecting): a partitioned Redis answers `Unavailable`
    /// after this long instead of hanging the request.
    pub command_timeout: Duration,
    /// Period of the pub/sub connection's ping; a missed answer closes its subscriptions.
    pub health_interval: Duration,
}

impl Default for RedisCoordinatorOptions {
    fn default() -> Self {
        Self {
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            health_interval: DEFAULT_HEALTH_INTERVAL,
        }
    }
}

/// The [`Coordinator`] of a multi-replica deployment, over Redis.
///
/// Commands go through a [`ConnectionManager`] (which reconnects after a dropped connection;
/// after a timeout the whole connection is replaced, as a half-open socket would otherwise
/// keep timing out). Subscriptions share one dedicated pub/sub connection. If that
/// connection is lost, every receiver it feeds is closed — messages may have been missed,
/// and a closed receiver says so — and the next `subscribe` opens a new one.
pub struct RedisCoordinator {
    client: Client,
    /// Prepended to every key and channel.
    prefix: String,
    /// Random per instance: names the control channels of its pub/sub connections.
    instance: u64,
    options: RedisCoordinatorOptions,
    manager_config: ConnectionManagerConfig,
    /// The command connection and its generation, bumped whenever a timeout replaces it.
    commands: Mutex<(u64, ConnectionManager)>,
    /// The live pub/sub connection, opened at connect and again after a loss.
    pubsub: tokio::sync::Mutex<Option<Arc<PubSubConn>>>,
    /// Generations of pub/sub connections, for their control channel names.
    pubsub_generation: AtomicU64,
    /// Cancelled on drop: stops the background tasks of every pub/sub connection.
    shutdown: CancellationToken,
}

impl fmt::Debug for RedisCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The client's connection info may carry a password: leave it out.
        f.debug_struct("RedisCoordinator")
            .field("prefix", &self.prefix)
            .field("instance", &self.instance)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Drop for RedisCoordinator {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The redis client for `url`; TLS (`rediss://`) uses the process's rustls provider.
fn client(url: &str, ca_file: Option<&Path>) -> Result<Client, CoordError> {
    // The redis crate asks rustls for the process default provider.
    crate::tls::install_provider();
    let invalid = |e: RedisError| CoordError::Unavailable(format!("invalid redis url: {e}"));
    let Some(path) = ca_file else {
        return Client::open(url).map_err(invalid);
    };
    if !url.starts_with("rediss://") {
        return Err(CoordError::Unavailable(
            "a Redis CA file needs a rediss:// url".to_owned(),
        ));
    }
    let root_cert = std::fs::read(path).map_err(|e| {
        CoordError::Unavailable(format!("reading redis CA file {}: {e}", path.display()))
    })?;
    let certificates = TlsCertificates {
        client_tls: None,
        root_cert: Some(root_cert),
    };
    Client::build_with_tls(url, certificates).map_err(invalid)
}

fn unavailable(what: &str, err: &RedisError) -> CoordError {
    CoordError::Unavailable(format!("redis {what}: {err}"))
}

fn limit_verdict((admitted, count, wait): (i64, i64, i64)) -> LimitVerdict {
    LimitVerdict {
        admitted: admitted == 1,
        count: u32::try_from(count).unwrap_or(u32::MAX),
        wait_ms: u64::try_from(wait).unwrap_or(0),
    }
}

fn timed_out(what: &str, after: Duration) -> CoordError {
    CoordError::Unavailable(format!("redis {what}: no answer within {after:?}"))
}

/// A TTL in whole milliseconds, rounded up (a sub-millisecond TTL still expires) and kept
/// in the range Redis accepts.
fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000))
        .unwrap_or(MAX_TTL_MS)
        .clamp(1, MAX_TTL_MS)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held, so a poisoned one still guards sound data.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RedisCoordinator {
    /// Connects with the default options (2 s timeouts). Fails with `Unavailable` if Redis
    /// cannot be reached now: a replica should not start without its coordination.
    pub async fn connect(url: &str, key_prefix: &str) -> Result<Self, CoordError> {
        Self::connect_with(url, key_prefix, RedisCoordinatorOptions::default()).await
    }

    /// Connects the command and pub/sub connections, each within `command_timeout`. A
    /// `rediss://` URL is verified against the web PKI roots.
    pub async fn connect_with(
        url: &str,
        key_prefix: &str,
        options: RedisCoordinatorOptions,
    ) -> Result<Self, CoordError> {
        Self::connect_tls(url, key_prefix, options, None).await
    }

    /// [`Self::connect_with`], with a `rediss://` server verified against the CAs of the PEM
    /// file `ca_file` instead of the web PKI roots (a private Redis with its own CA).
    pub async fn connect_tls(
        url: &str,
        key_prefix: &str,
        options: RedisCoordinatorOptions,
        ca_file: Option<&Path>,
    ) -> Result<Self, CoordError> {
        let client = client(url, ca_file)?;
        let timeout = options.command_timeout;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            // Few, quick reconnection attempts: calls are bounded by `command_timeout`
            // anyway, and the next call starts a fresh attempt.
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_secs(1));
        let manager = tokio::time::timeout(
            timeout,
            ConnectionManager::new_with_config(client.clone(), manager_config.clone()),
        )
        .await
        .map_err(|_| timed_out("connect", timeout))?
        .map_err(|e| unavailable("connect", &e))?;

        let coordinator = Self {
            client,
            prefix: key_prefix.to_owned(),
            instance: rand::random(),
            options,
            manager_config,
            commands: Mutex::new((0, manager)),
            pubsub: tokio::sync::Mutex::new(None),
            pubsub_generation: AtomicU64::new(0),
            shutdown: CancellationToken::new(),
        };
        coordinator.pubsub_conn().await?;
        Ok(coordinator)
    }

    /// The prefix every key and channel of this coordinator starts with.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn key(&self, key: &str) -> String {
        format!("{}k:{key}", self.prefix)
    }

    fn fence_key(&self, lease: &str) -> String {
        format!("{}f:{lease}", self.prefix)
    }

    fn channel(&self, channel: &str) -> String {
        format!("{}c:{channel}", self.prefix)
    }

    fn commands(&self) -> (u64, ConnectionManager) {
        let guard = lock(&self.commands);
        (guard.0, guard.1.clone())
    }

    /// Runs one call on the command connection within the timeout. A timeout replaces the
    /// connection (once per generation): the socket may be half-open, and nothing else would
    /// ever notice — it reports no error, every call on it just times out.
    async fn bounded<T, F>(&self, what: &str, generation: u64, call: F) -> Result<T, CoordError>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let timeout = self.options.command_timeout;
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            // The connection's own response timeout (the same length) may fire first.
            Ok(Err(e)) if e.is_timeout() => {
                self.replace_commands(generation);
                Err(unavailable(what, &e))
            }
            Ok(Err(e)) => Err(unavailable(what, &e)),
            Err(_) => {
                self.replace_commands(generation);
                Err(timed_out(what, timeout))
            }
        }
    }

    fn replace_commands(&self, generation: u64) {
        let mut guard = lock(&self.commands);
        if guard.0 != generation {
            return; // another caller replaced it already
        }
        match ConnectionManager::new_lazy_with_config(
            self.client.clone(),
            self.manager_config.clone(),
        ) {
            Ok(fresh) => {
                *guard = (generation + 1, fresh);
                tracing::warn!("redis command connection timed out; replaced it");
            }
            Err(e) => tracing::warn!(error = %e, "redis command connection not replaced"),
        }
    }

    /// The live pub/sub connection, opening a new one if there is none or it was lost.
    async fn pubsub_conn(&self) -> Result<Arc<PubSubConn>, CoordError> {
        let mut slot = self.pubsub.lock().await;
        if let Some(conn) = slot.as_ref()
            && !conn.closed.is_cancelled()
        {
            return Ok(Arc::clone(conn));
        }
        let generation = self.pubsub_generation.fetch_add(1, Ordering::Relaxed);
        let control = format!("{}x:{:016x}:{generation}", self.prefix, self.instance);
        let conn = PubSubConn::open(
            &self.client,
            control,
            self.options,
            self.shutdown.child_token(),
        )
        .await?;
        *slot = Some(Arc::clone(&conn));
        Ok(conn)
    }
}

#[async_trait]
impl Coordinator for RedisCoordinator {
    fn is_shared(&self) -> bool {
        true
    }

    async fn put_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        let mut invocation = PUT_HASH.prepare_invoke();
        invocation.key(self.key(key)).arg(ttl_millis(ttl));
        for (field, value) in fields {
            invocation.arg(field).arg(value);
        }
        let (generation, mut conn) = self.commands();
        self.bounded(
            "put_hash",
            generation,
            invocation.invoke_async::<redis::Value>(&mut conn),
        )
        .await?;
        Ok(())
    }

    async fn get_hash(&self, key: &str) -> Result<Option<BTreeMap<String, String>>, CoordError> {
        let (generation, mut conn) = self.commands();
        let fields: BTreeMap<String, String> = self
            .bounded(
                "get_hash",
                generation,
                redis::cmd("HGETALL")
                    .arg(self.key(key))
                    .query_async(&mut conn),
            )
            .await?;
        // Redis has no empty hashes: no fields means no key.
        Ok((!fields.is_empty()).then_some(fields))
    }

    async fn delete(&self, key: &str) -> Result<(), CoordError> {
        let (generation, mut conn) = self.commands();
        self.bounded(
            "delete",
            generation,
            redis::cmd("DEL")
                .arg(self.key(key))
                .query_async::<redis::Value>(&mut conn),
        )
        .await?;
        Ok(())
    }

    async fn claim_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<u64, CoordError> {
        let mut invocation = CLAIM_HASH.prepare_invoke();
        invocation
            .key(self.key(key))
            .key(self.fence_key(key))
            .arg(ttl_millis(ttl));
        for (field, value) in fields.iter().filter(|(f, _)| *f != "fence") {
            invocation.arg(field).arg(value);
        }
        let (generation, mut conn) = self.commands();
        self.bounded(
            "claim_hash",
            generation,
            invocation.invoke_async::<u64>(&mut conn),
        )
        .await
    }

    async fn put_hash_fenced(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, CoordError> {
        let mut invocation = PUT_HASH_FENCED.prepare_invoke();
        invocation
            .key(self.key(key))
            .key(self.fence_key(key))
            .arg(ttl_millis(ttl))
            .arg(fence.to_string());
        for (field, value) in fields.iter().filter(|(f, _)| *f != "fence") {
            invocation.arg(field).arg(value);
        }
        let (generation, mut conn) = self.commands();
        let written: i64 = self
            .bounded(
                "put_hash_fenced",
                generation,
                invocation.invoke_async(&mut conn),
            )
            .await?;
        Ok(written == 1)
    }

    async fn delete_fenced(&self, key: &str, fence: u64) -> Result<bool, CoordError> {
        let mut invocation = DELETE_FENCED.prepare_invoke();
        invocation
            .key(self.key(key))
            .key(self.fence_key(key))
            .arg(fence.to_string());
        let (generation, mut conn) = self.commands();
        let deleted: i64 = self
            .bounded(
                "delete_fenced",
                generation,
                invocation.invoke_async(&mut conn),
            )
            .await?;
        Ok(deleted == 1)
    }

    async fn acquire_lease(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, CoordError> {
        let mut invocation = ACQUIRE_LEASE.prepare_invoke();
        invocation
            .key(self.key(name))
            .key(self.fence_key(name))
            .arg(owner)
            .arg(ttl_millis(ttl));
        let (generation, mut conn) = self.commands();
        self.bounded(
            "acquire_lease",
            generation,
            invocation.invoke_async::<Option<u64>>(&mut conn),
        )
        .await
    }

    async fn release_lease(&self, name: &str, owner: &str) -> Result<(), CoordError> {
        let mut invocation = RELEASE_LEASE.prepare_invoke();
        invocation.key(self.key(name)).arg(owner);
        let (generation, mut conn) = self.commands();
        self.bounded(
            "release_lease",
            generation,
            invocation.invoke_async::<redis::Value>(&mut conn),
        )
        .await?;
        Ok(())
    }

    async fn lease_holder(&self, name: &str) -> Result<Option<String>, CoordError> {
        let (generation, mut conn) = self.commands();
        let held: Option<String> = self
            .bounded(
                "lease_holder",
                generation,
                redis::cmd("GET")
                    .arg(self.key(name))
                    .query_async::<Option<String>>(&mut conn),
            )
            .await?;
        let Some(held) = held else {
            return Ok(None);
        };
        // `lease:{token}:{owner}`, as ACQUIRE_LEASE writes it.
        let owner = held
            .strip_prefix("lease:")
            .and_then(|rest| rest.split_once(':'))
            .filter(|(token, _)| token.parse::<u64>().is_ok())
            .map(|(_, owner)| owner.to_owned());
        match owner {
            Some(owner) => Ok(Some(owner)),
            None => Err(CoordError::Unavailable(format!(
                "WRONGTYPE key {name:?} holds something other than a lease"
            ))),
        }
    }

    async fn incr(&self, key: &str, by: i64, ttl: Duration) -> Result<i64, CoordError> {
        let mut invocation = INCR.prepare_invoke();
        invocation.key(self.key(key)).arg(by).arg(ttl_millis(ttl));
        let (generation, mut conn) = self.commands();
        self.bounded(
            "incr",
            generation,
            invocation.invoke_async::<i64>(&mut conn),
        )
        .await
    }

    async fn acquire_slot(
        &self,
        key: &str,
        member: &str,
        limit: u32,
        now_ms: i64,
        ttl: Duration,
    ) -> Result<LimitVerdict, CoordError> {
        let mut invocation = ACQUIRE_SLOT.prepare_invoke();
        invocation
            .key(self.key(key))
            .arg(now_ms)
            .arg(member)
            .arg(limit)
            .arg(ttl_millis(ttl));
        let (generation, mut conn) = self.commands();
        let reply = self
            .bounded(
                "acquire_slot",
                generation,
                invocation.invoke_async::<(i64, i64, i64)>(&mut conn),
            )
            .await?;
        Ok(limit_verdict(reply))
    }

    async fn release_slot(&self, key: &str, member: &str) -> Result<(), CoordError> {
        let (generation, mut conn) = self.commands();
        self.bounded(
            "release_slot",
            generation,
            redis::cmd("ZREM")
                .arg(self.key(key))
                .arg(member)
                .query_async::<redis::Value>(&mut conn),
        )
        .await?;
        Ok(())
    }

    async fn window_admit(
        &self,
        key: &str,
        member: &str,
        now_ms: i64,
        window: Duration,
        limit: u32,
    ) -> Result<LimitVerdict, CoordError> {
        let mut invocation = WINDOW_ADMIT.prepare_invoke();
        invocation
            .key(self.key(key))
            .arg(now_ms)
            .arg(member)
            .arg(ttl_millis(window))
            .arg(limit);
        let (generation, mut conn) = self.commands();
        let reply = self
            .bounded(
                "window_admit",
                generation,
                invocation.invoke_async::<(i64, i64, i64)>(&mut conn),
            )
            .await?;
        Ok(limit_verdict(reply))
    }

    async fn publish(&self, channel: &str, payload: Vec<u8>) -> Result<usize, CoordError> {
        let (generation, mut conn) = self.commands();
        self.bounded(
            "publish",
            generation,
            redis::cmd("PUBLISH")
                .arg(self.channel(channel))
                .arg(payload)
                .query_async::<usize>(&mut conn),
        )
        .await
    }

    async fn subscribe(&self, channel: &str) -> Result<UnboundedReceiver<Vec<u8>>, CoordError> {
        let channel = self.channel(channel);
        let conn = self.pubsub_conn().await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let id = conn.add_route(&channel, tx)?;

        let timeout = self.options.command_timeout;
        {
            // Serialised with every other SUBSCRIBE and UNSUBSCRIBE of this connection, so
            // that a concurrent last-unsubscribe cannot undo this subscription.
            let mut sink = conn.sink.lock().await;
            if !conn.is_subscribed(&channel) {
                // Marked first: if this call is cancelled mid-SUBSCRIBE, the route's watcher
                // still finds the channel subscribed and unsubscribes it.
                conn.mark_subscribed(&channel);
                match tokio::time::timeout(timeout, sink.subscribe(&channel)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        conn.close();
                        return Err(unavailable("subscribe", &e));
                    }
                    Err(_) => {
                        conn.close();
                        return Err(timed_out("subscribe", timeout));
                    }
                }
            }
        }

        // The route stays inactive until this marker comes back through the pub/sub stream.
        // Redis delivers in execution order, so no message published before this call began
        // reaches the new subscriber (even on a channel the connection already listened to,
        // with older messages still in flight), and every one published after it returns
        // does.
        let (generation, mut commands) = self.commands();
        self.bounded(
            "subscribe",
            generation,
            redis::cmd("PUBLISH")
                .arg(&conn.control)
                .arg(id)
                .query_async::<redis::Value>(&mut commands),
        )
        .await?;
        // On any early return above, dropping `rx` lets the route's watcher remove it.
        Ok(rx)
    }

    async fn append_events(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        self.journal_append(key, first_seq, events, ttl).await
    }

    async fn read_events(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        self.journal_read(key, after, max, block).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_a_millisecond_and_stay_in_range() {
        assert_eq!(ttl_millis(Duration::ZERO), 1);
        assert_eq!(ttl_millis(Duration::from_micros(1)), 1);
        assert_eq!(ttl_millis(Duration::from_micros(1_500)), 2);
        assert_eq!(ttl_millis(Duration::from_secs(15)), 15_000);
        assert_eq!(ttl_millis(Duration::MAX), MAX_TTL_MS);
    }
}
