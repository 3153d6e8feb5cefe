//! Switchyard's actors, their messages and their supervision.
//!
//! ```text
//! per replica: RootSupervisor ──────── restarts a crashed child supervisor; past its policy
//! │                                      gives up on it (handles refuse typed, down() says so)
//! ├─ GenerationSupervisor ──────────── settles/releases what a crashed child held
//! │   └─ GenerationActor (one per request, spawn_linked, never restarted)
//! │        admitted → queued → dispatched(attempt n) → streaming → settled
//! ├─ NodeSupervisor ─────────────────── a crashed node: NodeDown to its queues, NodeGone to
//! │   │                                  generations, socket closed (never restarted)
//! │   └─ NodeActor (one per node socket) ─ relays frames, counts its in-flight work
//! ├─ QueueSupervisor ────────────────── restarts a crashed queue with backoff and rebuilds it
//! │   │                                  (nodes re-announce, waiters re-queue); escalates
//! │   └─ ModelQueueActor (one per model) ─ bounded queue, deadline, node choice
//! └─ BudgetSupervisor ──────────────── spawns lazily, replaces crashed, retires idle
//!     └─ TeamBudgetActor (one per team, spawn_linked) ─ group-commits its reservations
//! ```
//!
//! A request: the HTTP layer authenticates and validates it and hands its admission job (the
//! [`ports::admission::AdmissionJob`] port, implemented by the server's `src/admission/`:
//! idempotency, limits, message window, pricing) to [`generation::Launcher::launch`]
//! (`generation/launch.rs`), which runs it and starts the generation it admitted; the
//! generation reserves its ledger row through its team's budget actor *while* it enters its
//! model's queue and is dispatched to a node with room (the row's answer arrives as a message;
//! nothing reaches the client before it); the node actor relays `assign` and routes
//! `accepted`, `chunk`, `done` and `error` back; the generation streams deltas to the client
//! and settles the row on every exit path (completion, engine error, node loss, client gone,
//! timeout).
//!
//! Where things happen:
//! - a generation's decisions: the pure `Core::step` in `generation/core/mod.rs` (admission
//!   and dispatch in `core/forward.rs`), carried out by the actor in `generation/actor.rs`;
//! - the row committing beside the dispatch, and the inputs held until it has: `reserved` in
//!   `generation/core/forward.rs`, `Core::held` in `generation/core/mod.rs`; its crash points
//!   tested in `generation/tests/overlap.rs`;
//! - a frame believed only from the node holding its attempt: `Core::vouch` in
//!   `generation/core/mod.rs`; violations counted and a node disconnected: `violation` in
//!   `node/actor.rs`; a `done` outliving its generation checked against [`attempts`]:
//!   `settle_orphan` in `node/actor.rs`;
//! - usage billed within the request's bounds: [`ports::UsageBounds::bill`], applied by
//!   `done` in `generation/core/ending.rs` and by every ledger's settle;
//! - a retry away from the failing node, and a node suspended after refusals:
//!   `dispatch_waiting` in `model_queue/actor.rs`, `refused` in `node/actor.rs`;
//! - a client disconnect becoming an engine cancel: the stream's drop guard in
//!   `generation/supervisor.rs`, then `client_gone` in `generation/core/ending.rs`;
//! - a team's reservations batched into one transaction (group commit): `flush` in
//!   `budget/actor.rs`, deciding each row as a single reserve would: `plan_batch` in the
//!   server's `store/sql.rs`; a crashed team actor's callers told `quota_service_unavailable`:
//!   `reserve` of [`budget::TeamBudgets`] in `budget/supervisor.rs`;
//! - every way a generation can end, checked over random input sequences (one terminal
//!   event, the row final once, the slot and the message released or consumed once):
//!   `generation/tests/properties.rs`;
//! - a resumable generation's events journaled for a reader who comes back (any replica,
//!   through the [`ports::Coordinator`]): `Journal` in `generation/events.rs`; the reader's
//!   return (`ClientBack`) keeping it past its cancel grace: `generation/core/ending.rs`;
//! - who settles a row: every path in `generation/core/ending.rs` (the settle and its retry
//!   timers in `generation/core/settle.rs`), the supervisor for a crashed generation,
//!   `settle_orphan` (in `node/orphan.rs`) for a `done` without a generation; each applied
//!   settle counted once in `switchyard_settled_tokens_total`: `count_settled_tokens` in
//!   `metric_names.rs`, tested in `generation/tests/settled_metric.rs`;
//! - a node drained, by an operator (`NodeMsg::Drain`) or by itself (its `draining` frame, on
//!   SIGTERM): `start_draining` in `node/actor.rs`, told to the other replicas by `announce`
//!   in `node/link.rs`;
//! - a node's slots given back when its own heartbeat no longer lists the work counted on
//!   it: `vanished` in `node/squared.rs`, tested in `generation/tests/squared.rs`;
//! - what each crash costs and who repairs it: [`supervision`] (restart policies in
//!   `supervision/mod.rs`, a queue's rebuild in `supervision/queues.rs`, a node's cleanup in
//!   `supervision/nodes.rs`).
//!
//! The crate depends on no HTTP, SQL or Redis crate: it reaches the world only through
//! [`ports`], so its tests run in-process on a paused clock. [`protocol`] holds the node ⇄
//! server frames shared by the server and `switchyard node`; [`sse`] the Server-Sent Events
//! parser shared by the node agent and the load harness.

pub mod attempts;
pub mod budget;
pub mod cluster;
pub mod error;
pub mod generation;
pub mod lifecycle;
pub mod metric_names;
pub mod model_queue;
pub mod node;
pub mod output;
pub mod ports;
pub mod protocol;
pub mod replica;
pub mod sse;
pub mod supervision;
pub mod tasks;
#[cfg(test)]
mod test_counter;
pub mod tier;
