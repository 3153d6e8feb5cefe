//! Messages of the [`super::ModelQueueActor`] and the handle others hold.

use ractor::{ActorRef, RpcReplyPort};

use crate::error::Failure;
use crate::generation::GenerationMsg;
use crate::node::{NodeHandle, NodeLoad};
use crate::protocol::Api;

/// A snapshot for operators and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStats {
    /// Generations waiting for a node.
    pub waiting: usize,
    /// (node id, in flight, draining) of every node serving the model.
    pub nodes: Vec<(String, u32, bool)>,
    /// Nodes out of routing because their engine kept refusing work.
    pub suspended: Vec<String>,
    /// Dispatches per second over the measuring window.
    pub drain_rate: f64,
}

/// What a [`super::ModelQueueActor`] handles.
#[derive(Debug)]
pub enum QueueMsg {
    /// Admit a generation to the queue, or refuse it (`queue_full`, `no_healthy_node`).
    Enqueue {
        /// The generation's request id.
        request_id: String,
        /// The generation to dispatch.
        generation: ActorRef<GenerationMsg>,
        /// A retry of a generation whose node was lost goes to the front.
        front: bool,
        /// A retry avoids the node that failed it, unless no other node serves the model.
        avoid: Option<String>,
        /// The engine API it needs: only nodes whose agent speaks it are chosen.
        api: Api,
        /// Admitted or refused.
        reply: RpcReplyPort<Result<(), Failure>>,
    },
    /// A generation left while waiting (client gone).
    Withdraw {
        /// Its request id.
        request_id: String,
    },
    /// A node serving this model connected.
    NodeUp(NodeHandle, NodeLoad),
    /// A node's connection ended.
    NodeDown(String),
    /// A node's heartbeat.
    NodeLoad(String, NodeLoad),
    /// A node finished an assignment of this model.
    Released(String),
    /// A node takes no new work.
    NodeDraining(String),
    /// A node's engine refused work twice in a row (true) or reported healthy again (false):
    /// a suspended node gets no new work but stays connected.
    NodeSuspended(String, bool),
    /// Periodic: expire deadlines, publish the depth gauge.
    Tick,
    /// Current statistics.
    Stats(RpcReplyPort<QueueStats>),
}

/// Cloneable access to a model's queue.
#[derive(Debug, Clone)]
pub struct ModelQueueHandle {
    pub(crate) model: String,
    pub(crate) actor: ActorRef<QueueMsg>,
}

impl ModelQueueHandle {
    /// The model this queue serves.
    pub fn model(&self) -> &str {
        &self.model
    }

    pub(crate) async fn enqueue(
        &self,
        request_id: &str,
        generation: ActorRef<GenerationMsg>,
        front: bool,
        avoid: Option<String>,
        api: Api,
    ) -> Result<(), Failure> {
        let result = self
            .actor
            .call(
                |reply| QueueMsg::Enqueue {
                    request_id: request_id.to_owned(),
                    generation,
                    front,
                    avoid,
                    api,
                    reply,
                },
                Some(std::time::Duration::from_secs(5)),
            )
            .await;
        match result {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => Err(Failure::new(
                crate::error::ErrorCode::NoHealthyNode,
                format!("the queue of {} is not available", self.model),
            )
            .retry_after(1)),
        }
    }

    pub(crate) fn withdraw(&self, request_id: &str) {
        let _ = self.actor.cast(QueueMsg::Withdraw {
            request_id: request_id.to_owned(),
        });
    }

    pub(crate) fn node_up(&self, node: NodeHandle, load: NodeLoad) {
        let _ = self.actor.cast(QueueMsg::NodeUp(node, load));
    }

    pub(crate) fn node_down(&self, node_id: &str) {
        let _ = self.actor.cast(QueueMsg::NodeDown(node_id.to_owned()));
    }

    pub(crate) fn node_load(&self, node_id: &str, load: NodeLoad) {
        let _ = self
            .actor
            .cast(QueueMsg::NodeLoad(node_id.to_owned(), load));
    }

    pub(crate) fn released(&self, node_id: &str) {
        let _ = self.actor.cast(QueueMsg::Released(node_id.to_owned()));
    }

    pub(crate) fn node_draining(&self, node_id: &str) {
        let _ = self.actor.cast(QueueMsg::NodeDraining(node_id.to_owned()));
    }

    pub(crate) fn node_suspended(&self, node_id: &str, suspended: bool) {
        let _ = self
            .actor
            .cast(QueueMsg::NodeSuspended(node_id.to_owned(), suspended));
    }

    /// Current statistics, or `None` if the queue does not answer.
    pub async fn stats(&self) -> Option<QueueStats> {
        match self
            .actor
            .call(QueueMsg::Stats, Some(std::time::Duration::from_secs(5)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(s)) => Some(s),
            _ => None,
        }
    }

    /// Stops the queue actor.
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}
