//! Integration tests of a request's whole path: an HTTP client, the server's actors, a node
//! agent dialing in over WebSocket, a simulated engine, and the ledger.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "server/admin.rs"]
mod admin;
#[path = "server/agent.rs"]
mod agent;
#[path = "server/console.rs"]
mod console;
#[path = "server/embeddings.rs"]
mod embeddings;
#[path = "server/failures.rs"]
mod failures;
#[path = "server/fuzz.rs"]
mod fuzz;
#[path = "server/invariants.rs"]
mod invariants;
#[path = "server/jwt_callers.rs"]
mod jwt_callers;
#[path = "server/k6.rs"]
mod k6;
#[path = "server/leaks.rs"]
mod leaks;
#[path = "server/limits.rs"]
mod limits;
#[path = "server/listener.rs"]
mod listener;
#[path = "server/logs.rs"]
mod logs;
#[path = "server/ops.rs"]
mod ops;
#[path = "server/path.rs"]
mod path;
#[path = "server/production.rs"]
mod production;
#[path = "server/refusals.rs"]
mod refusals;
#[path = "server/reports.rs"]
mod reports;
#[path = "server/routing.rs"]
mod routing;
#[path = "server/sdk.rs"]
mod sdk;
#[path = "server/tiers.rs"]
mod tiers;
#[path = "server/trust.rs"]
mod trust;
#[path = "server/upgrade.rs"]
mod upgrade;
#[path = "server/usage.rs"]
mod usage;
