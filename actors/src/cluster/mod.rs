//! The cluster: node ownership and the relay between replicas (SPEC sections 2, 7 and 9).
//!
//! A node's socket lives on one replica, its *owner*, which claims `node:{id}` in the
//! coordinator with a fencing token (every new connection takes a greater one) and refreshes
//! it with each heartbeat; a refresh the token no longer allows means another replica took
//! the node, and the stale connection ends. Every other replica reaches the node through a
//! *proxy*: a node actor whose link is the coordinator's pub/sub instead of a socket, so a
//! generation and a queue see one kind of node wherever its socket is.
//!
//! Channels (under the coordinator's prefix):
//! - [`NODES_CHANNEL`]: every owner announces its nodes ([`NodeNews`]) when they connect,
//!   with each heartbeat and when they leave; every replica keeps its proxies from it.
//! - [`to_node`]`(id)`: commands for a node ([`ToNode`]: the server frames an assignment
//!   needs, and violations found elsewhere), heard by the connection holding the token.
//! - [`to_replica`]`(id)`: a node's frames for the generations of one replica
//!   ([`FromNode`]), numbered per (node connection, replica) so duplicates are dropped and
//!   a gap is seen.
//!
//! - [`QUEUE_OWNERS_CHANNEL`]: the owner of each model's queue (a lease with a fencing
//!   token) says so ([`QueueOwner`]).
//! - [`to_queue`]`(model)`: other replicas' enqueues, withdrawals, releases and reports for
//!   the owner of a model's queue ([`ToQueue`]).
//! - [`from_queue`]`(model, replica)`: the owner's verdicts, dispatches and timeouts for one
//!   replica's generations ([`FromQueue`]), with the owner's fence.
//!
//! - [`to_budget`]`(replica)`: reservations for the teams whose budget lease `replica`
//!   holds, and its answers to the reservations it asked others to decide.
//!
//! A generation whose node is local never touches pub/sub for its frames; one admitted on
//! the replica owning its model's queue never touches it for its dispatch.

mod epoch;
mod listen;
mod outbox;
mod view;
pub mod wire;

pub use epoch::{CHECK_EVERY, Epoch, spawn_epoch_watch};
pub use listen::listen;
pub use outbox::{OnFailure, Outbox};
pub use view::{NodeShared, NodeView, Proxies, spawn_view};
pub use wire::{
    Announcement, Command, FromNode, FromQueue, NodeNews, QueueItem, QueueNews, QueueOwner,
    QueueReply, ToNode, ToQueue,
};

/// The channel every replica hears node announcements on.
pub const NODES_CHANNEL: &str = "nodes";

/// The coordinator key of a node's ownership and load (`node:{id}`, TTL 15 s).
pub fn node_key(node_id: &str) -> String {
    format!("node:{node_id}")
}

/// The channel the owner of `node_id` hears commands for it on.
pub fn to_node(node_id: &str) -> String {
    format!("to_node:{node_id}")
}

/// The channel replica `replica_id` hears its generations' frames on.
pub fn to_replica(replica_id: &str) -> String {
    format!("to_replica:{replica_id}")
}

/// The channel queue owners announce themselves on.
pub const QUEUE_OWNERS_CHANNEL: &str = "queue_owners";

/// The lease (and fencing token) of a model's queue.
pub fn queue_lease(model: &str) -> String {
    format!("queue:{model}")
}

/// The channel the owner of `model`'s queue hears other replicas on.
pub fn to_queue(model: &str) -> String {
    format!("to_queue:{model}")
}

/// The channel replica `replica_id` hears the owner of `model`'s queue on.
pub fn from_queue(model: &str, replica_id: &str) -> String {
    format!("from_queue:{model}:{replica_id}")
}

/// The lease of a team's budget.
pub fn budget_lease(team_id: i64) -> String {
    format!("budget:{team_id}")
}

/// The channel replica `replica_id` hears budget asks and answers on.
pub fn to_budget(replica_id: &str) -> String {
    format!("to_budget:{replica_id}")
}
