//! The Generations API and the lifecycle shared with `/v1/chat/completions` (SPEC section 5),
//! end to end on PostgreSQL and Redis: idempotency, cancellation with confirmation, attempt
//! fencing, message quotas, named SSE events, the slow-reader bound, and what a node may
//! claim.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "generations/bounds.rs"]
mod bounds;
#[path = "generations/cancel.rs"]
mod cancel;
#[path = "generations/fencing.rs"]
mod fencing;
#[path = "generations/harness.rs"]
mod harness;
#[path = "generations/idempotency.rs"]
mod idempotency;
#[path = "generations/nodes_lost.rs"]
mod nodes_lost;
#[path = "generations/output.rs"]
mod output;
#[path = "generations/quota.rs"]
mod quota;
#[path = "generations/streams.rs"]
mod streams;
#[path = "generations/trust.rs"]
mod trust;
