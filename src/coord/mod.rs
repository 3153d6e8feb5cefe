//! Cluster coordination behind the [`Coordinator`] port: expiring hashes, fenced leases,
//! counters and pub/sub. [`MemoryCoordinator`] serves the embedded single-replica mode,
//! [`RedisCoordinator`] the multi-replica production one; both pass the same [`conformance`]
//! suite, and [`connect_coordinator`] picks one from the configuration.
//!
//! Semantics every implementation keeps, because callers rely on them:
//! - one keyspace: hashes, counters and leases share it; [`Coordinator::delete`] and
//!   [`Coordinator::put_hash`] replace whatever a key holds, while reading or counting on a
//!   key of another kind is an error (Redis's WRONGTYPE);
//! - expiry is exact on read: an expired key is absent, whatever its memory footprint;
//! - a lease's fencing token strictly increases with every new holder, also across expiry,
//!   release and deletion; renewal by the holder keeps the token;
//! - `incr` sets the expiry when it creates the counter and never extends it;
//! - pub/sub reaches the subscribers registered before the publish, in publish order.

pub mod conformance;
mod memory;
mod redis;

use std::sync::Arc;

pub use self::redis::{
    DEFAULT_COMMAND_TIMEOUT, DEFAULT_HEALTH_INTERVAL, RedisCoordinator, RedisCoordinatorOptions,
};
pub use memory::MemoryCoordinator;
pub use switchyard_actors::ports::{CoordError, Coordinator};

/// The coordinator for this replica: Redis when `redis_url` is given (every key and channel
/// under `key_prefix`), else the in-process one of the single-replica embedded mode, which
/// has nothing to share and so ignores the prefix. Fails when Redis cannot be reached.
pub async fn connect_coordinator(
    redis_url: Option<&str>,
    key_prefix: &str,
) -> Result<Arc<dyn Coordinator>, CoordError> {
    Ok(match redis_url {
        Some(url) => Arc::new(RedisCoordinator::connect(url, key_prefix).await?),
        None => Arc::new(MemoryCoordinator::new()),
    })
}
