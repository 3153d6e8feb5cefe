//! Messages of the [`super::NodeActor`] and the handle others hold.

use std::sync::Arc;
use std::time::Duration;

use ractor::{ActorRef, RpcReplyPort};

use crate::generation::GenerationMsg;
use crate::protocol::{Api, NodeFrame};

/// A node's load as its last heartbeat reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeLoad {
    /// `vllm:num_requests_waiting`.
    pub queue_depth: u64,
    /// `vllm:num_requests_running`.
    pub running: u64,
    /// `vllm:kv_cache_usage_perc`, 0–1.
    pub kv_cache_usage: f64,
}

/// A frame a node had no right to send (SPEC section 7, trust). Each is refused, counted in
/// `switchyard_node_protocol_violations_total{node,kind}`, logged and never acked; a node
/// that commits too many in a window is disconnected.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Violation {
    /// A frame about an attempt this node was never assigned (another node's request, or an
    /// epoch that was never dispatched).
    ForeignRequest,
    /// A chunk whose `seq` went backwards within its attempt.
    SeqRegression,
    /// A `done` whose counts no ledger can hold (beyond 2^63−1, negative, fractional).
    UsageOutOfRange,
    /// A `done` claiming more completion tokens than the request allowed.
    CompletionOverBound,
    /// A frame that is not JSON of a known type with its required fields.
    MalformedFrame,
}

impl Violation {
    /// The `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ForeignRequest => "foreign_request",
            Self::SeqRegression => "seq_regression",
            Self::UsageOutOfRange => "usage_out_of_range",
            Self::CompletionOverBound => "completion_over_bound",
            Self::MalformedFrame => "malformed_frame",
        }
    }
}

/// What a [`super::NodeActor`] handles.
#[derive(Debug)]
pub enum NodeMsg {
    /// Send this assignment to the node and route its frames to `generation`.
    Assign {
        /// The generation's request id.
        request_id: String,
        /// The attempt epoch; frames of other epochs are fenced by the generation.
        attempt: u64,
        /// What the engine is asked to do.
        work: Work,
        /// The attempt's lease, sent to the node.
        lease_ms: Option<u64>,
        /// Where this assignment's frames go.
        generation: ActorRef<GenerationMsg>,
    },
    /// Tell the node to stop this assignment.
    Cancel {
        /// The generation's request id.
        request_id: String,
        /// The attempt to stop.
        attempt: u64,
    },
    /// The `done` of this attempt is settled: the node may forget it.
    Ack {
        /// The generation's request id.
        request_id: String,
        /// The attempt whose `done` settled.
        attempt: u64,
    },
    /// A frame read from the node's socket.
    Frame(NodeFrame),
    /// A `done` left unacked here, read again as if the node had sent it again (see
    /// `orphan::look_again`).
    DoneAgain(NodeFrame),
    /// Stop giving this node new work (operator drain).
    Drain,
    /// Ask the node to load another model (operator).
    LoadModel(String),
    /// The socket closed, or a frame could not be written: the node is gone.
    ConnectionLost,
    /// Periodic check for a missed heartbeat.
    CheckHeartbeat,
    /// The node sent a frame it had no right to send (found by the actor itself or by the
    /// generation the frame named).
    Violation {
        /// What it did.
        kind: Violation,
        /// The request the frame named, if any (for the log).
        request_id: Option<String>,
    },
    /// The queue of `model` was restarted empty: announce this node to it again with the
    /// load and in-flight count only this actor knows. The reply comes after the announcement
    /// was sent, so the supervisor re-queues waiting generations only once nodes are known.
    Reannounce {
        /// The restarted queue's model.
        model: String,
        /// Sent once the announcement is on its way.
        reply: RpcReplyPort<()>,
    },
    /// Commands from another replica's proxy of this node (on its owner).
    Commands(crate::cluster::ToNode),
    /// The node's frames for this replica's generations, relayed by its owner (on a proxy).
    Relayed(crate::cluster::FromNode),
    /// Nobody listens for this node's frames on `replica` any more (on the owner).
    ReplicaGone(String),
    /// Another replica's news about this node (a newer connection elsewhere ends this one;
    /// a proxy takes its owner's heartbeat).
    News(crate::cluster::Announcement),
    /// Announce the node to the cluster now (a replica said hello).
    Announce,
    /// Test-only fault hook: the actor panics while handling it, as a bug would.
    #[cfg(any(test, feature = "fault-injection"))]
    Crash,
}

/// Cloneable access to a connected node. Every frame the node relays carries a clone (the
/// generation checks who sent it), so a clone allocates nothing.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    pub(crate) node_id: Arc<str>,
    pub(crate) actor: ActorRef<NodeMsg>,
    /// The protocol version spoken on this connection.
    pub(crate) protocol: u32,
}

/// What an assignment asks the node's engine to do.
#[derive(Debug, Clone)]
pub struct Work {
    /// Engine model name.
    pub model: String,
    /// The OpenAI body to forward.
    pub body: serde_json::Value,
    /// Which engine API.
    pub api: Api,
    /// The client's request id, for the engine's logs.
    pub x_request_id: Option<String>,
    /// The W3C trace context to continue.
    pub traceparent: Option<String>,
    /// Its service tier (the engine's priority, where the agent passes it on).
    pub tier: crate::tier::Tier,
}

impl NodeHandle {
    /// The node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// The protocol version spoken on this connection.
    pub fn protocol(&self) -> u32 {
        self.protocol
    }

    /// Whether this connection can run `api` (an older agent runs chat only).
    pub fn speaks(&self, api: Api) -> bool {
        self.protocol >= api.min_protocol()
    }

    /// Whether the actor still runs.
    pub fn is_alive(&self) -> bool {
        matches!(
            self.actor.get_status(),
            ractor::ActorStatus::Starting
                | ractor::ActorStatus::Running
                | ractor::ActorStatus::Upgrading
        )
    }

    /// Sends the actor a message (cluster news, relayed frames); dropped if it is gone.
    pub fn send(&self, msg: NodeMsg) {
        let _ = self.actor.cast(msg);
    }

    /// Sends a frame read from the node's socket to the actor; false if the actor is gone.
    pub fn deliver(&self, frame: NodeFrame) -> bool {
        self.actor.cast(NodeMsg::Frame(frame)).is_ok()
    }

    /// Reports that the socket closed.
    pub fn connection_lost(&self) {
        let _ = self.actor.cast(NodeMsg::ConnectionLost);
    }

    /// Whether both handles point at the same connection.
    pub fn same_actor(&self, other: &NodeHandle) -> bool {
        self.actor.get_id() == other.actor.get_id()
    }

    /// Asks the node to drain.
    pub fn drain(&self) {
        let _ = self.actor.cast(NodeMsg::Drain);
    }

    /// Asks the node to load a model.
    pub fn load_model(&self, name: &str) {
        let _ = self.actor.cast(NodeMsg::LoadModel(name.to_owned()));
    }

    pub(crate) fn assign(
        &self,
        request_id: &str,
        attempt: u64,
        work: Work,
        lease_ms: Option<u64>,
        generation: ActorRef<GenerationMsg>,
    ) -> bool {
        self.actor
            .cast(NodeMsg::Assign {
                request_id: request_id.to_owned(),
                attempt,
                work,
                lease_ms,
                generation,
            })
            .is_ok()
    }

    pub(crate) fn cancel(&self, request_id: &str, attempt: u64) {
        let _ = self.actor.cast(NodeMsg::Cancel {
            request_id: request_id.to_owned(),
            attempt,
        });
    }

    pub(crate) fn ack(&self, request_id: &str, attempt: u64) {
        let _ = self.actor.cast(NodeMsg::Ack {
            request_id: request_id.to_owned(),
            attempt,
        });
    }

    /// Reports a frame the node had no right to send.
    pub fn violation(&self, kind: Violation, request_id: Option<&str>) {
        let _ = self.actor.cast(NodeMsg::Violation {
            kind,
            request_id: request_id.map(str::to_owned),
        });
    }

    /// Stops the actor (the socket's writer ends with it).
    pub fn stop(&self) {
        self.actor.stop(None);
    }

    /// Asks the node to announce itself to the restarted queue of `model`; false if it did
    /// not answer within `within` (it is gone, or its own crash is being handled).
    pub(crate) async fn reannounce(&self, model: &str, within: Duration) -> bool {
        let asked = self
            .actor
            .call(
                |reply| NodeMsg::Reannounce {
                    model: model.to_owned(),
                    reply,
                },
                Some(within),
            )
            .await;
        matches!(asked, Ok(ractor::rpc::CallResult::Success(())))
    }

    /// Test-only fault hook: makes the node's actor panic.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn crash(&self) {
        let _ = self.actor.cast(NodeMsg::Crash);
    }
}
