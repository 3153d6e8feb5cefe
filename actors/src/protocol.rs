//! Node ⇄ server frames of the node control plane (SPEC section 7).
//!
//! Every frame is one JSON text message over the WebSocket, tagged by `"type"`. The same
//! types are used by the server and by `switchyard node`, so the two cannot drift apart.

use serde::{Deserialize, Serialize};

/// Where a node runs: behind NAT in a company data centre, or in the cloud GPU pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Location {
    /// On premises, dialing out through NAT.
    Onprem,
    /// A cloud GPU node (EKS).
    Cloud,
}

/// One GPU as the node reports it at registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Device index on the node.
    pub index: u32,
    /// Marketing name, e.g. `NVIDIA L40S`.
    pub name: String,
    /// Total device memory.
    pub memory_mib: u64,
}

/// Frames a node sends to the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum NodeFrame {
    /// First frame, within 5 s of connecting: who the node is and what it serves.
    Register {
        /// The node's id, as issued with its token.
        node_id: String,
        /// The per-node secret; the server stores only its hash.
        token: String,
        /// GPUs on the node.
        gpus: Vec<Gpu>,
        /// Model names the engine serves (from the engine's `/v1/models`).
        models: Vec<String>,
        /// Agent version.
        version: String,
        /// On premises or cloud.
        location: Location,
    },
    /// The engine took the assignment; sent before inference starts.
    Accepted {
        /// The generation this belongs to.
        request_id: String,
        /// Attempt epoch; frames of older epochs are rejected.
        attempt: u64,
    },
    /// Generated text, possibly several tokens.
    Chunk {
        /// The generation this belongs to.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
        /// Position of this chunk in the attempt, from 0, to drop duplicates and see gaps.
        seq: u64,
        /// Incremental text.
        delta: String,
    },
    /// The engine finished; exact usage from the engine's final usage chunk.
    Done {
        /// The generation this belongs to.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
        /// Prompt tokens as the engine counted them.
        prompt_tokens: u64,
        /// Completion tokens as the engine counted them.
        completion_tokens: u64,
        /// `stop`, `length`, `abort`, …
        finish_reason: String,
    },
    /// The engine failed this assignment.
    Error {
        /// The generation this belongs to.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
        /// Machine-readable cause.
        code: String,
        /// Human-readable cause (never prompt or output text).
        message: String,
    },
    /// Load report, every 5 s.
    Heartbeat {
        /// `vllm:num_requests_waiting`.
        queue_depth: u64,
        /// `vllm:num_requests_running`.
        running: u64,
        /// `vllm:kv_cache_usage_perc`, a fraction 0–1.
        kv_cache_usage: f64,
        /// GPU utilisation 0–1 where known.
        gpu_util: f64,
        /// Models currently served.
        models: Vec<String>,
    },
}

/// Frames the server sends to a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    /// Registration accepted.
    Registered {},
    /// Registration refused; the server closes the socket after this frame.
    Rejected {
        /// Why, for the node's log.
        reason: String,
        /// When a retry may succeed (registration rate limit).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
    /// Run this chat completion on the engine.
    Assign {
        /// The generation.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
        /// Model name as the engine serves it.
        model: String,
        /// The OpenAI request body to forward.
        body: serde_json::Value,
        /// The attempt's lease: the node stops this work once it has heard nothing from the
        /// server for this long (any frame or pong renews it), because the server may by then
        /// have fenced the attempt and dispatched a new one. Absent: no lease.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_ms: Option<u64>,
    },
    /// Stop this assignment.
    Cancel {
        /// The generation.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
    },
    /// Load another model.
    LoadModel {
        /// Model name.
        name: String,
    },
    /// Take no new work; finish what runs.
    Drain {},
    /// The `done` of this attempt is settled; the node may forget it.
    Ack {
        /// The generation.
        request_id: String,
        /// Attempt epoch.
        attempt: u64,
    },
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn frames_are_tagged_by_type() {
        let f = NodeFrame::Accepted {
            request_id: "r1".into(),
            attempt: 2,
        };
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            r#"{"type":"accepted","request_id":"r1","attempt":2}"#
        );
        let s: ServerFrame = serde_json::from_str(r#"{"type":"drain"}"#).unwrap();
        assert_eq!(s, ServerFrame::Drain {});
        let r: ServerFrame =
            serde_json::from_str(r#"{"type":"rejected","reason":"bad token"}"#).unwrap();
        assert_eq!(
            r,
            ServerFrame::Rejected {
                reason: "bad token".into(),
                retry_after_ms: None
            }
        );
    }

    #[test]
    fn unknown_frame_type_is_an_error_not_a_panic() {
        assert!(serde_json::from_str::<NodeFrame>(r#"{"type":"nope"}"#).is_err());
        assert!(serde_json::from_str::<NodeFrame>("\u{0}\u{ff}").is_err());
    }
}
