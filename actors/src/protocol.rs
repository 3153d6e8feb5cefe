//! Node ⇄ server frames of the node control plane (SPEC section 7).
//!
//! Every frame is one JSON text message over the WebSocket, tagged by `"type"`. The same
//! types are used by the server and by `switchyard node`, so the two cannot drift apart.

use serde::{Deserialize, Serialize};

use crate::output::{RawJson, WireDelta};

/// The protocol version this build speaks. 2 added the engine's structured delta
/// (`chunk.delta` as an object, `chunk.logprobs`), `done.cached_tokens`, `assign.api`
/// (legacy completions and embeddings) and the request's `x-request-id`/`traceparent`.
pub const PROTOCOL_VERSION: u32 = 2;
/// The oldest version this build still speaks (the previous one: a fleet upgrades one node
/// at a time). A `register` without `protocol` is version 1.
pub const OLDEST_PROTOCOL_VERSION: u32 = 1;

fn protocol_one() -> u32 {
    1
}

/// Which engine API an assignment runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions` (every version).
    #[default]
    Chat,
    /// `POST /v1/completions` (protocol 2).
    Completions,
    /// `POST /v1/embeddings` (protocol 2).
    Embeddings,
}

impl Api {
    /// Whether this is [`Api::Chat`] (which `assign` leaves out, as version 1 did).
    pub fn is_chat(&self) -> bool {
        *self == Api::Chat
    }

    /// The oldest protocol version that can run it.
    pub fn min_protocol(self) -> u32 {
        match self {
            Api::Chat => 1,
            Api::Completions | Api::Embeddings => 2,
        }
    }

    /// The engine's path for it.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Embeddings => "/v1/embeddings",
        }
    }
}

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
        /// The protocol version the agent speaks (absent: 1).
        #[serde(default = "protocol_one")]
        protocol: u32,
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
        /// Incremental text (version 1) or the engine's delta object (version 2).
        delta: WireDelta,
        /// The engine's `logprobs` for this delta, verbatim (version 2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<RawJson>,
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
        /// `stop`, `length`, `tool_calls`, `abort`, … as the engine sent it.
        finish_reason: String,
        /// `usage.prompt_tokens_details.cached_tokens` as the engine reported it (version 2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cached_tokens: Option<u64>,
        /// How many `chunk`s the attempt sent (its last `seq` plus one; version 2), so a
        /// generation that got fewer knows part of its output was lost on the way.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chunks: Option<u64>,
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
        /// The engine's cumulative token counters (protocol 2; absent from older agents and
        /// from engines without them). A value that is not a `u64` is read as absent.
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            deserialize_with = "lenient_counters"
        )]
        engine_counters: Option<EngineCounters>,
        /// Every assignment the agent holds as it builds this heartbeat: taken and not yet
        /// finished (its `done`, or its final `error`, not yet sent). The server gives back
        /// the slots of assignments the node no longer has (see `node::squared`). Absent
        /// from older agents, and from an agent holding more than
        /// [`MAX_HEARTBEAT_ASSIGNMENTS`] (a list is never cut short: a missing entry would
        /// cost a running assignment its slot): then nothing is squared. More entries than
        /// that is a protocol violation.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        assignments: Option<Vec<Held>>,
    },
    /// The node is going away (its agent got SIGTERM: a pod deleted, a spot reclaim, a
    /// host shutdown): give it no new work; what it runs finishes, then it disconnects. The
    /// node's side of `drain`; a server that predates it counts it as a malformed frame and
    /// learns of the drain from the node's `error {code: "draining"}` refusals instead.
    Draining {},
}

/// The most assignments a `heartbeat` may list: far above what one engine runs at once
/// (vLLM's `--max-num-seqs` defaults to 256), and small enough that squaring stays cheap.
pub const MAX_HEARTBEAT_ASSIGNMENTS: usize = 4_096;

/// One assignment a node holds, as its `heartbeat` lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Held {
    /// The generation.
    pub request_id: String,
    /// Attempt epoch.
    pub attempt: u64,
}

/// An engine's own cumulative token counters, as its `/metrics` page reports them (vLLM's
/// `vllm:prompt_tokens_total` and `vllm:generation_tokens_total`, summed over label sets).
/// They start at 0 when the engine starts, so a value lower than the previous one means a
/// restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// Prefill tokens processed.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
}

/// `heartbeat.engine_counters`, or `None` when absent or unreadable: the counters only feed
/// a report, so a bad value costs the node its counters, never its heartbeat.
fn lenient_counters<'de, D>(deserializer: D) -> Result<Option<EngineCounters>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let value = serde_json::Value::deserialize(deserializer)?;
    // An object only: serde would read a struct from an array of its fields too.
    if !value.is_object() {
        return Ok(None);
    }
    Ok(serde_json::from_value(value).ok())
}

/// Frames the server sends to a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    /// Registration accepted, in the version both sides speak (absent: 1, an older server).
    Registered {
        /// The version the node must speak on this connection.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        protocol: Option<u32>,
    },
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
        /// The engine API to call (absent: chat).
        #[serde(default, skip_serializing_if = "Api::is_chat")]
        api: Api,
        /// The client's request id, sent to the engine as `X-Request-Id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        x_request_id: Option<String>,
        /// The W3C `traceparent` to continue at the engine.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
        /// The attempt's lease: the node stops this work once it has heard nothing from the
        /// server for this long (any frame or pong renews it), because the server may by then
        /// have fenced the attempt and dispatched a new one. Absent: no lease.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_ms: Option<u64>,
        /// The request's service tier: an agent whose engine schedules by priority passes it
        /// on as vLLM's `priority` (older servers send none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tier: Option<crate::tier::Tier>,
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

/// Whether `reason` is a `done.finish_reason` as engines write them (`stop`, `length`,
/// `tool_calls`, `abort`, `error`, …): 1 to 32 lower-case ASCII letters, digits or `_`. The
/// agent sends `error` for anything else; the server refuses anything else as a malformed
/// frame (it would reach the client and the generation's record).
pub fn is_finish_reason(reason: &str) -> bool {
    (1..=32).contains(&reason.len())
        && reason
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Why a node's text frame could not be taken as a [`NodeFrame`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    /// The frame's `type`, when it had a readable one (at most 32 characters).
    pub kind: Option<String>,
}

/// Reads a node's frame. A `done` whose counts are not integers a `u64` holds (negative,
/// fractional, beyond 2^64−1) still names its request and attempt: it is read with those
/// counts as `u64::MAX`, so the generation ends with a typed error and a settled row instead
/// of waiting for a report that will never parse (the counts are a protocol violation either
/// way, see `MAX_TOKEN_COUNT` in `ports`). Anything else unreadable is [`Malformed`].
pub fn decode_node_frame(text: &str) -> Result<NodeFrame, Malformed> {
    // Chunks first: they are most frames, and their raw delta cannot be read through serde's
    // buffering of an internally tagged enum.
    if let Ok(c) = serde_json::from_str::<ChunkFrame>(text) {
        return Ok(NodeFrame::Chunk {
            request_id: c.request_id,
            attempt: c.attempt,
            seq: c.seq,
            delta: c.delta,
            logprobs: c.logprobs,
        });
    }
    if let Ok(frame) = serde_json::from_str::<NodeFrame>(text) {
        return Ok(frame);
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|_| Malformed { kind: None })?;
    let kind = value
        .get("type")
        .and_then(serde_json::Value::as_str)
        .map(|t| t.chars().take(32).collect::<String>());
    let malformed = || Malformed { kind: kind.clone() };
    if kind.as_deref() != Some("done") {
        return Err(malformed());
    }
    let field = |name: &str| value.get(name);
    let request_id = field("request_id")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(malformed)?
        .to_owned();
    let attempt = field("attempt")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(malformed)?;
    let finish_reason = field("finish_reason")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(malformed)?
        .to_owned();
    // Present but unreadable as a u64: out of range.
    let count = |name: &str| match field(name) {
        Some(serde_json::Value::Number(n)) => Ok(n.as_u64().unwrap_or(u64::MAX)),
        _ => Err(malformed()),
    };
    Ok(NodeFrame::Done {
        request_id,
        attempt,
        prompt_tokens: count("prompt_tokens")?,
        completion_tokens: count("completion_tokens")?,
        finish_reason,
        cached_tokens: field("cached_tokens").and_then(serde_json::Value::as_u64),
        chunks: field("chunks").and_then(serde_json::Value::as_u64),
    })
}

/// A `chunk` frame read directly (see [`decode_node_frame`]).
#[derive(Deserialize)]
struct ChunkFrame {
    #[serde(rename = "type")]
    _kind: ChunkTag,
    request_id: String,
    attempt: u64,
    seq: u64,
    delta: WireDelta,
    #[serde(default)]
    logprobs: Option<RawJson>,
}

#[derive(Deserialize)]
enum ChunkTag {
    #[serde(rename = "chunk")]
    Chunk,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
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
        const { assert!(PROTOCOL_VERSION > OLDEST_PROTOCOL_VERSION) };
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
    fn a_done_with_counts_out_of_range_still_names_its_attempt() {
        for count in ["18446744073709551616", "-1", "1.5", "1e30"] {
            let text = format!(
                r#"{{"type":"done","request_id":"r","attempt":1,"prompt_tokens":3,"completion_tokens":{count},"finish_reason":"stop"}}"#
            );
            let Ok(NodeFrame::Done {
                completion_tokens,
                prompt_tokens,
                ..
            }) = decode_node_frame(&text)
            else {
                panic!("{count}: not read as a done");
            };
            assert_eq!((prompt_tokens, completion_tokens), (3, u64::MAX), "{count}");
        }
        let missing = r#"{"type":"done","request_id":"r","attempt":1,"finish_reason":"stop"}"#;
        assert_eq!(
            decode_node_frame(missing),
            Err(Malformed {
                kind: Some("done".into())
            })
        );
        assert_eq!(decode_node_frame("{"), Err(Malformed { kind: None }));
    }

    #[test]
    fn chunks_of_both_versions_round_trip_with_the_engines_bytes() {
        let v1 = r#"{"type":"chunk","request_id":"r","attempt":1,"seq":0,"delta":"hi"}"#;
        let f = decode_node_frame(v1).unwrap();
        assert_eq!(serde_json::to_string(&f).unwrap(), v1);
        let v2 = r#"{"type":"chunk","request_id":"r","attempt":1,"seq":1,"delta":{"content":"a b","x":[1, 2]},"logprobs":{"content":[]}}"#;
        let f = decode_node_frame(v2).unwrap();
        assert_eq!(serde_json::to_string(&f).unwrap(), v2);
        let bad = r#"{"type":"chunk","request_id":"r","attempt":1,"seq":1,"delta":[1]}"#;
        assert_eq!(
            decode_node_frame(bad),
            Err(Malformed {
                kind: Some("chunk".into())
            })
        );
    }

    #[test]
    fn a_version_one_register_and_a_version_two_assign_read_across_versions() {
        let reg = r#"{"type":"register","node_id":"n","token":"t","gpus":[],"models":["m"],"version":"0.1.0","location":"cloud"}"#;
        let Ok(NodeFrame::Register { protocol, .. }) = decode_node_frame(reg) else {
            panic!("register not read");
        };
        assert_eq!(protocol, 1);
        let assign = ServerFrame::Assign {
            request_id: "r".into(),
            attempt: 1,
            model: "m".into(),
            body: serde_json::json!({}),
            api: Api::Chat,
            x_request_id: None,
            traceparent: None,
            lease_ms: None,
            tier: None,
        };
        // A chat assignment is written as version 1 wrote it.
        assert_eq!(
            serde_json::to_string(&assign).unwrap(),
            r#"{"type":"assign","request_id":"r","attempt":1,"model":"m","body":{}}"#
        );
        let registered: ServerFrame = serde_json::from_str(r#"{"type":"registered"}"#).unwrap();
        assert_eq!(registered, ServerFrame::Registered { protocol: None });
    }

    #[test]
    fn heartbeat_counters_are_optional_and_bad_ones_are_ignored() {
        let base = r#"{"type":"heartbeat","queue_depth":1,"running":2,"kv_cache_usage":0.5,"gpu_util":0.0,"models":["m"]"#;
        let read = |extra: &str| match decode_node_frame(&format!("{base}{extra}}}")) {
            Ok(NodeFrame::Heartbeat {
                engine_counters, ..
            }) => engine_counters,
            other => panic!("{extra}: not read as a heartbeat: {other:?}"),
        };
        // A version 1 agent sends none; the frame it sends is unchanged by the new field.
        assert_eq!(read(""), None);
        let v1 = decode_node_frame(&format!("{base}}}")).unwrap();
        assert_eq!(serde_json::to_string(&v1).unwrap(), format!("{base}}}"));
        assert_eq!(
            read(r#","engine_counters":{"prompt_tokens":7,"generation_tokens":9}"#),
            Some(EngineCounters {
                prompt_tokens: 7,
                generation_tokens: 9
            })
        );
        for bad in [
            r#","engine_counters":{"prompt_tokens":-1,"generation_tokens":9}"#,
            r#","engine_counters":{"prompt_tokens":1.5,"generation_tokens":9}"#,
            r#","engine_counters":{"prompt_tokens":18446744073709551616,"generation_tokens":9}"#,
            r#","engine_counters":{"prompt_tokens":1}"#,
            r#","engine_counters":"lots""#,
            r#","engine_counters":[1,2]"#,
            r#","engine_counters":null"#,
        ] {
            assert_eq!(read(bad), None, "{bad}");
        }
    }

    #[test]
    fn heartbeat_assignments_are_optional_both_ways() {
        let base = r#"{"type":"heartbeat","queue_depth":0,"running":1,"kv_cache_usage":0.0,"gpu_util":0.0,"models":["m"]"#;
        let read = |extra: &str| match decode_node_frame(&format!("{base}{extra}}}")) {
            Ok(NodeFrame::Heartbeat { assignments, .. }) => assignments,
            other => panic!("{extra}: not read as a heartbeat: {other:?}"),
        };
        // An older agent lists nothing: no squaring, and its frame is written as it was.
        assert_eq!(read(""), None);
        let old = decode_node_frame(&format!("{base}}}")).unwrap();
        assert_eq!(serde_json::to_string(&old).unwrap(), format!("{base}}}"));
        // Holding nothing is a list, not an absence.
        assert_eq!(read(r#","assignments":[]"#), Some(Vec::new()));
        let listed = format!(r#"{base},"assignments":[{{"request_id":"r","attempt":2}}]}}"#);
        let frame = decode_node_frame(&listed).unwrap();
        let NodeFrame::Heartbeat { assignments, .. } = &frame else {
            panic!("not a heartbeat");
        };
        assert_eq!(
            assignments.as_deref(),
            Some(
                &[Held {
                    request_id: "r".into(),
                    attempt: 2
                }][..]
            )
        );
        assert_eq!(serde_json::to_string(&frame).unwrap(), listed);
        // An older server reads a new agent's heartbeat: the field is one it does not know.
        #[derive(Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum OlderNodeFrame {
            Heartbeat { running: u64, models: Vec<String> },
        }
        let OlderNodeFrame::Heartbeat { running, models } = serde_json::from_str(&listed).unwrap();
        assert_eq!((running, models), (1, vec!["m".to_owned()]));
        for bad in [
            r#","assignments":[{"request_id":"r"}]"#,
            r#","assignments":[{"request_id":"r","attempt":-1}]"#,
            r#","assignments":"r""#,
        ] {
            assert_eq!(
                decode_node_frame(&format!("{base}{bad}}}")),
                Err(Malformed {
                    kind: Some("heartbeat".into())
                }),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_draining_frame_is_its_type_alone() {
        let text = r#"{"type":"draining"}"#;
        assert_eq!(decode_node_frame(text), Ok(NodeFrame::Draining {}));
        assert_eq!(
            serde_json::to_string(&NodeFrame::Draining {}).unwrap(),
            text
        );
    }

    #[test]
    fn unknown_frame_type_is_an_error_not_a_panic() {
        assert!(serde_json::from_str::<NodeFrame>(r#"{"type":"nope"}"#).is_err());
        assert!(serde_json::from_str::<NodeFrame>("\u{0}\u{ff}").is_err());
    }
}
