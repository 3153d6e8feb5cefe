//! vLLM's response shapes, key for key and in vLLM's key order (see tests/fixtures/vllm).
//!
//! Presence matters as much as values: the first chunk carries `prompt_token_ids: null` but no
//! `token_ids`, only the finish chunk has `stop_reason`, and the usage chunk alone (or, without
//! usage, the finish chunk) has `system_fingerprint`. `Option<Option<T>>` encodes "absent" vs null.

use serde::Serialize;

/// What vLLM 0.32.0 reports as its version; the simulator speaks that API.
pub const VLLM_VERSION: &str = "0.32.0";
/// `system_fingerprint` of the simulator (vLLM's is `vllm-<version>-<hash>`).
pub const SYSTEM_FINGERPRINT: &str = "vllm-0.32.0-switchyard-sim";

/// One `data:` event of a streamed chat completion.
#[derive(Debug, Serialize)]
pub struct Chunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<StreamUsage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Option<()>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_text: Option<Option<()>>,
}

/// The single choice of a chunk.
#[derive(Debug, Serialize)]
pub struct ChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Option<()>>,
}

/// Incremental message text or tool-call fragments; the first chunk also names the role.
#[derive(Debug, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
}

/// Usage as streamed: key order prompt, total, completion; no `*_details`.
#[derive(Debug, Serialize)]
pub struct StreamUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
    pub completion_tokens: u32,
    /// Only with prompt-token details on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<serde_json::Value>,
}

impl StreamUsage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: None,
        }
    }
}

/// Common head of every chunk of one response.
#[derive(Debug, Clone, Copy)]
pub struct ChunkHead<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

impl<'a> ChunkHead<'a> {
    fn chunk(self, choices: Vec<ChunkChoice<'a>>) -> Chunk<'a> {
        Chunk {
            id: self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model,
            choices,
            usage: None,
            system_fingerprint: None,
            prompt_token_ids: None,
            prompt_text: None,
        }
    }

    /// The opening chunk: role and empty content.
    pub fn role(self) -> Chunk<'a> {
        let mut c = self.chunk(vec![ChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: Some(""),
                tool_calls: None,
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
            token_ids: None,
        }]);
        c.prompt_token_ids = Some(None);
        c.prompt_text = Some(None);
        c
    }

    /// A content chunk; with `finish` it is the last one and names why generation ended.
    /// `fingerprint` is set on the finish chunk when no usage chunk follows.
    #[cfg(test)]
    pub fn content(
        self,
        content: &'a str,
        finish: Option<(&'static str, Option<&'a str>)>,
        fingerprint: bool,
    ) -> Chunk<'a> {
        self.delta(
            Delta {
                role: None,
                content: Some(content),
                tool_calls: None,
            },
            finish,
            fingerprint,
        )
    }

    /// A chunk with any delta (text or tool-call fragments); see [`ChunkHead::content`].
    pub fn delta(
        self,
        delta: Delta<'a>,
        finish: Option<(&'static str, Option<&'a str>)>,
        fingerprint: bool,
    ) -> Chunk<'a> {
        let mut c = self.chunk(vec![ChunkChoice {
            index: 0,
            delta,
            logprobs: None,
            finish_reason: finish.map(|f| f.0),
            stop_reason: finish.map(|f| f.1),
            token_ids: Some(None),
        }]);
        if fingerprint {
            c.system_fingerprint = Some(SYSTEM_FINGERPRINT);
        }
        c
    }

    /// The usage-only chunk, `choices: []`.
    pub fn usage(self, prompt_tokens: u32, completion_tokens: u32) -> Chunk<'a> {
        let mut c = self.chunk(Vec::new());
        c.usage = Some(StreamUsage::new(prompt_tokens, completion_tokens));
        c.system_fingerprint = Some(SYSTEM_FINGERPRINT);
        c
    }
}

/// What a non-streamed chat answer says, beyond its finish.
#[derive(Debug, Default)]
pub struct Answer<'a> {
    /// The text (`""` beside tool calls).
    pub content: &'a str,
    /// `message.tool_calls`, present only for a forced tool call.
    pub tool_calls: Option<serde_json::Value>,
    /// `choice.logprobs` (`{"content": [...]}`) when asked for.
    pub logprobs: Option<serde_json::Value>,
    /// `usage.prompt_tokens_details` (null unless prompt-token details are enabled).
    pub prompt_details: Option<serde_json::Value>,
}

/// A whole non-streamed `chat.completion`, with vLLM's extra keys.
pub fn completion(
    head: ChunkHead<'_>,
    answer: Answer<'_>,
    finish_reason: &str,
    stop_reason: Option<&str>,
    prompt_tokens: u32,
    completion_tokens: u32,
) -> serde_json::Value {
    let mut message = serde_json::json!({
        "role": "assistant",
        "content": answer.content,
        "refusal": null,
        "annotations": null,
        "audio": null,
        "function_call": null,
    });
    if let (Some(obj), Some(calls)) = (message.as_object_mut(), answer.tool_calls) {
        obj.insert("tool_calls".into(), calls);
    }
    if let Some(obj) = message.as_object_mut() {
        obj.insert("reasoning".into(), serde_json::Value::Null);
    }
    serde_json::json!({
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": answer.logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "token_ids": null,
            "routed_experts": null
        }],
        "service_tier": null,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": full_usage(prompt_tokens, completion_tokens, answer.prompt_details),
        "prompt_logprobs": null,
        "prompt_token_ids": null,
        "prompt_text": null,
        "kv_transfer_params": null,
        "ec_transfer_params": null,
        "metrics": null
    })
}

/// Usage of a non-streamed answer: the `*_details` keys are there, null by default.
pub fn full_usage(
    prompt_tokens: u32,
    completion_tokens: u32,
    prompt_details: Option<serde_json::Value>,
) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": prompt_details,
        "completion_tokens_details": null
    })
}

/// vLLM's error envelope: `{"error": {message, type, param, code}}` with an integer code.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: u16) -> serde_json::Value {
    serde_json::json!({
        "error": { "message": message, "type": kind, "param": param, "code": code }
    })
}

/// `GET /v1/models` for one served model.
pub fn models(
    model: &str,
    root: &str,
    max_model_len: u32,
    created: u64,
    perm_id: &str,
) -> serde_json::Value {
    serde_json::json!({
        "object": "list",
        "data": [{
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": null,
            "max_model_len": max_model_len,
            "permission": [{
                "id": perm_id,
                "object": "model_permission",
                "created": created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false
            }]
        }]
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const HEAD: ChunkHead<'static> = ChunkHead {
        id: "chatcmpl-1",
        created: 7,
        model: "m",
    };

    #[test]
    fn role_chunk_matches_vllm_key_order() {
        let s = serde_json::to_string(&HEAD.role()).unwrap();
        assert_eq!(
            s,
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}"#
        );
    }

    #[test]
    fn finish_and_usage_chunks_match_vllm() {
        let fin =
            serde_json::to_string(&HEAD.content("x", Some(("stop", Some("e"))), false)).unwrap();
        assert_eq!(
            fin,
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":"stop","stop_reason":"e","token_ids":null}]}"#
        );
        let usage = serde_json::to_string(&HEAD.usage(30, 20)).unwrap();
        assert_eq!(
            usage,
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":[],"usage":{"prompt_tokens":30,"total_tokens":50,"completion_tokens":20},"system_fingerprint":"vllm-0.32.0-switchyard-sim"}"#
        );
    }
}
