//! What replicas say to each other about nodes, as JSON over the coordinator's pub/sub.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::node::Violation;
use crate::protocol::ServerFrame;

/// On [`super::NODES_CHANNEL`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum NodeNews {
    /// A node's owner announces it: when it connects, with each heartbeat, and when a new
    /// replica says hello.
    Node(Announcement),
    /// The connection holding `fence` ended: the node leaves routing everywhere at once.
    Down {
        /// The node.
        node_id: String,
        /// The connection's fencing token.
        fence: u64,
    },
    /// A replica started: owners announce their nodes now rather than at their next
    /// heartbeat.
    Hello {
        /// The new replica.
        replica: String,
    },
}

/// A node as its owner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Announcement {
    /// The node.
    pub node_id: String,
    /// The replica holding its socket.
    pub owner: String,
    /// The connection's fencing token (greater for every new connection).
    pub fence: u64,
    /// Models it serves that the cluster knows.
    pub models: Vec<String>,
    /// The protocol version its agent speaks.
    pub protocol: u32,
    /// An operator drained it.
    pub draining: bool,
    /// `vllm:num_requests_waiting` at its last heartbeat.
    pub queue_depth: u64,
    /// `vllm:num_requests_running` at its last heartbeat.
    pub running: u64,
    /// `vllm:kv_cache_usage_perc` at its last heartbeat, 0–1.
    pub kv_cache_usage: f64,
    /// Assignments it carries, from every replica.
    pub in_flight: u64,
}

/// On [`super::to_node`]: commands from one replica's proxy of the node, numbered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToNode {
    /// The sending replica (where the node's frames for these requests go).
    pub from: String,
    /// The connection the sender means; another connection of the node ignores them.
    pub fence: u64,
    /// Names the sender's stream of batches (a restarted proxy starts a new one).
    pub stream: u64,
    /// 1, 2, … within the stream.
    pub seq: u64,
    /// In order.
    pub commands: Vec<Command>,
}

/// One command for a node's owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// A frame for the node's socket (`assign`, `cancel`, `ack`, `drain`, `load_model`).
    Frame(ServerFrame),
    /// A generation elsewhere refused one of the node's frames: the owner counts it.
    Violation {
        /// What the node did.
        kind: Violation,
        /// The request the frame named.
        request_id: Option<String>,
    },
}

/// On [`super::to_replica`]: a node's frames for one replica's generations, numbered.
#[derive(Debug, Serialize, Deserialize)]
pub struct FromNode {
    /// The node.
    pub node_id: String,
    /// The connection they came on.
    pub fence: u64,
    /// Names the relay (one per connection and receiving replica; a new one after the old
    /// gave up).
    pub stream: u64,
    /// 1, 2, … within the stream: a repeat is dropped, a jump is a gap.
    pub seq: u64,
    /// The node's frames as it sent them, in order (read with
    /// [`crate::protocol::decode_node_frame`]).
    pub frames: Vec<Box<RawValue>>,
}
