//! What replicas say to each other about nodes, as JSON over the coordinator's pub/sub.

use std::collections::BTreeMap;

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
    /// The same by model, then by the replica whose generation holds each: what every
    /// queue's count of the node is squared with ([`crate::model_queue`]'s `carried`). Empty
    /// from a replica older than the field.
    #[serde(default)]
    pub carried: BTreeMap<String, BTreeMap<String, u32>>,
    /// Sent at once because the socket refused an `assign` for want of room, after it
    /// released what it ended: `carried` is squared both ways (`Word::Exact`), not only
    /// downwards as a heartbeat's is. Absent from a replica older than the field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exact: bool,
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

/// On [`super::QUEUE_OWNERS_CHANNEL`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum QueueNews {
    /// The owner of a model's queue says so when it takes the lease, with every renewal, and
    /// when asked; a replica that sees a new (owner, fence, incarnation) sends the new owner
    /// what it knows (its waiting generations, its running count per node).
    Owner(QueueOwner),
    /// A replica's queue started: the owner of `model`'s queue announces itself now rather
    /// than at its next renewal.
    Hello {
        /// The model.
        model: String,
    },
}

/// Who owns a model's queue (see [`QueueNews::Owner`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueOwner {
    /// The model.
    pub model: String,
    /// The replica holding the lease.
    pub replica: String,
    /// The lease's fencing token.
    pub fence: u64,
    /// Greater after each restart of the owner's queue actor (which forgets what others sent).
    pub incarnation: u64,
}

/// On [`super::to_queue`]: what a replica tells the owner of a model's queue, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToQueue {
    /// The sending replica (where the verdicts and dispatches go).
    pub from: String,
    /// In order.
    pub items: Vec<QueueItem>,
}

/// One message to a queue's owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum QueueItem {
    /// A generation of the sender waits for a node (answered with a verdict).
    Enqueue {
        /// Its request id.
        request_id: String,
        /// A retry goes to the front.
        front: bool,
        /// A retry avoids its failed node.
        avoid: Option<String>,
        /// The engine API it needs.
        api: crate::protocol::Api,
        /// Its prompt, for the owner's node choice (absent from older replicas).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        route: Option<std::sync::Arc<crate::model_queue::RouteKey>>,
        /// Milliseconds it has waited already (sent again to a new owner): the owner places
        /// it among the others by when it arrived, and its deadline runs from then.
        #[serde(default, skip_serializing_if = "is_zero")]
        waited_ms: u64,
        /// Its tier, team and work (absent from older replicas: the default tier, no cost).
        #[serde(default)]
        ticket: crate::model_queue::Ticket,
    },
    /// It left while waiting.
    Withdraw {
        /// Its request id.
        request_id: String,
    },
    /// One of the sender's generations finished on `node_id` (or never started there).
    Released {
        /// The node whose slot is free.
        node_id: String,
    },
    /// `slots` of the sender's grant on `node_id` go back to the owner (asked to, or the
    /// node left its view): the owner may dispatch them again.
    Return {
        /// The node.
        node_id: String,
        /// How many.
        slots: u32,
    },
    /// What the sender's generations run now, for the owner (fence, incarnation) it names.
    Report {
        /// The owner's fence it answers.
        fence: u64,
        /// The owner's incarnation it answers.
        incarnation: u64,
        /// Generations of the sender running on each node, outside its grants.
        running: std::collections::BTreeMap<String, u32>,
        /// The last dispatch or grant heard from this owner (its `epoch` and `n`): later ones
        /// are not in `running` or `held` yet.
        seen: Option<(u64, u64)>,
        /// The slots of this owner's grants the sender holds, by node (used or not): the owner
        /// counts exactly these (plus the grants sent since) as lent.
        #[serde(default)]
        held: std::collections::BTreeMap<String, u32>,
    },
}

/// On [`super::from_queue`]: what a queue's owner tells one replica, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FromQueue {
    /// The owner's lease token: a replica drops what an owner older than the newest it saw
    /// sends (a partitioned owner that lost its lease dispatches nothing).
    pub fence: u64,
    /// In order.
    pub items: Vec<QueueReply>,
}

/// One answer of a queue's owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum QueueReply {
    /// The enqueue of `request_id` was admitted (`refused` is `None`) or refused.
    Verdict {
        /// The generation.
        request_id: String,
        /// Why it was refused.
        refused: Option<crate::error::Failure>,
    },
    /// Run `request_id` on `node_id` (the owner counted it against the node).
    Dispatch {
        /// The generation.
        request_id: String,
        /// The chosen node.
        node_id: String,
        /// Names the owner's record of this replica (a new one after it forgot the replica).
        epoch: u64,
        /// 1, 2, … within `epoch`: a report names the last one it includes.
        n: u64,
    },
    /// `slots` more of `node_id`'s capacity are this replica's to dispatch to itself (the
    /// owner counts them as taken until they come back): its generations start there without
    /// asking the owner.
    Grant {
        /// The node.
        node_id: String,
        /// How many more.
        slots: u32,
        /// As in [`QueueReply::Dispatch`]: grants and dispatches share one numbering, so a
        /// report says which grants its `held` includes.
        epoch: u64,
        /// As in [`QueueReply::Dispatch`].
        n: u64,
    },
    /// Give back the unused slots of the grant on `node_id`, and each used one as it frees:
    /// others wait for it.
    Revoke {
        /// The node.
        node_id: String,
    },
    /// The owner (re)started its record of this replica: send every generation still
    /// waiting again (duplicates are ignored).
    Resync,
    /// Its deadline passed.
    Timeout {
        /// The generation.
        request_id: String,
    },
}

/// Serde's test for a field left out at its default.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde passes a reference
fn is_zero(n: &u64) -> bool {
    *n == 0
}
