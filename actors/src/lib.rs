//! Switchyard's actors, their messages and their supervision.
//!
//! ```text
//! per replica
//! ├─ GenerationSupervisor ──────────── settles/releases what a crashed child held
//! │   └─ GenerationActor (one per request, spawn_linked)
//! │        admitted → queued → dispatched(attempt n) → streaming → settled
//! ├─ ModelQueueActor (one per model) ─ bounded queue, deadline, node choice
//! └─ NodeActor (one per node socket) ─ relays frames, counts its in-flight work
//! ```
//!
//! A request: the HTTP layer calls [`generation::Generations::start_generation`]; the
//! generation reserves its ledger row and enters its model's queue; the queue dispatches it
//! to a node with room; the node actor relays `assign` and routes `accepted`, `chunk`,
//! `done` and `error` back; the generation streams deltas to the client and settles the row
//! on every exit path (completion, engine error, node loss, client gone, timeout).
//!
//! The crate depends on no HTTP, SQL or Redis crate: it reaches the world only through
//! [`ports`], so its tests run in-process on a paused clock. [`protocol`] holds the node ⇄
//! server frames shared by the server and `switchyard node`.

pub mod attempts;
pub mod error;
pub mod generation;
pub mod lifecycle;
pub mod metric_names;
pub mod model_queue;
pub mod node;
pub mod ports;
pub mod protocol;
pub mod tasks;
