//! Cluster coordination behind the [`Coordinator`] port: expiring hashes, fenced leases,
//! counters and pub/sub. [`MemoryCoordinator`] serves the embedded single-replica mode; the
//! Redis implementation joins it, and both must pass the same [`conformance`] suite.
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

pub use memory::MemoryCoordinator;
pub use switchyard_actors::ports::{CoordError, Coordinator};
