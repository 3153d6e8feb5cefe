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
//! A generation whose node is local never touches pub/sub.

mod outbox;
pub mod wire;

pub use outbox::Outbox;
pub use wire::{Announcement, Command, FromNode, NodeNews, ToNode};

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
