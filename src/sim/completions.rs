//! `POST /v1/completions`, the legacy text completions, in vLLM 0.32's shapes
//! (tests/fixtures/vllm/completions*). Same engine, faults, timing and metrics as chat.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::SimError;
use super::generate::{self, Content, Render, Sampling, TokenEvent, UsageMode, sse_frame};
use super::http::{ApiError, AppState};
use super::logprobs;
use super::tokenizer::SimTokenizer;
use super::wire::{self, StreamUsage};

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Value,
    /// `k`: the sampled token's logprob and the `k` most likely.
    #[serde(default)]
    logprobs: Option<i64>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(flatten)]
    sampling: Sampling,
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match start(&state, &headers, &body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

/// The prompt as vLLM takes it: text, or token ids (then no `<s>` is added).
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

fn parse_prompt(prompt: Value, vocab: u32) -> Result<Prompt, ApiError> {
    let empty = || {
        ApiError::bad_request(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            Some("prompt"),
        )
    };
    let ids = |items: &[Value]| token_ids(items, vocab);
    let prompt = match prompt {
        Value::String(s) => Prompt::Text(s),
        Value::Array(items) => match items.as_slice() {
            [] => return Err(empty()),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(inner)] => Prompt::Ids(ids(inner)?),
            [Value::Number(_), ..] => Prompt::Ids(ids(&items)?),
            // vLLM answers a batch of prompts with one choice each; the simulator serves one.
            _ => {
                return Err(ApiError::bad_request(
                    "The simulator takes one prompt per request.",
                    Some("prompt"),
                ));
            }
        },
        _ => return Err(empty()),
    };
    match &prompt {
        Prompt::Text(s) if s.is_empty() => Err(empty()),
        Prompt::Ids(v) if v.is_empty() => Err(empty()),
        _ => Ok(prompt),
    }
}

async fn start(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let faults = generate::take_request_faults(state)?;
    let req: CompletionRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}"), None))?;
    generate::validate_sampling(&req.sampling, req.logprobs)?;
    state.check_generation_model(req.model.as_deref())?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::bad_request(
            "echo is not supported by the simulator.",
            Some("echo"),
        ));
    }
    let ids = match parse_prompt(req.prompt, state.tokenizer.vocab_size())? {
        Prompt::Ids(ids) => ids,
        Prompt::Text(text) => {
            let tok = state.tokenizer.clone();
            // The captured tokenizer adds no `<s>` to a raw prompt ("Once upon a time" is 6).
            tokio::task::spawn_blocking(move || tok.encode(&text))
                .await
                .map_err(|e| ApiError::from(SimError::Tokenizer(e.to_string())))??
        }
    };
    let prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    generate::check_context(state, prompt_tokens)?;
    let seed = generate::seed_of(&req.sampling);
    let k = req.logprobs.map(|k| u32::try_from(k).unwrap_or(0));
    let stream = req.sampling.stream.unwrap_or(false);
    let usage = generate::usage_mode(&req.sampling);
    let content = Content::Text { logprobs: k };
    let mut params =
        generate::seq_params(state, req.sampling, seed, prompt_tokens, content, faults)?;
    params.block_hashes = state.block_hashes(&ids);
    let rx = state.engine.submit(params)?;
    let out = Out {
        id: generate::response_id("cmpl", headers),
        created: generate::unix_now(),
        model: state.model.clone(),
        prompt_tokens,
        details: state.prompt_tokens_details,
    };
    if stream {
        let render = CompletionRender {
            tok: state.tokenizer.clone(),
            out,
            usage,
            offset: 0,
        };
        return Ok(generate::stream_response(rx, render));
    }
    let done = match generate::collect(rx).await {
        Ok(done) => done,
        Err(cut) => return Ok(cut),
    };
    let (reason, stop) = generate::finish_fields(&done.finish);
    let lp = k.map(|_| logprobs::completion(&state.tokenizer, &done.logprobs, 0));
    let cached = done.finish.cache.cached;
    let details = out.details.then(
        || json!({"cached_tokens": cached, "created_cache_tokens": null, "multimodal_tokens": null}),
    );
    Ok(Json(json!({
        "id": out.id,
        "object": "text_completion",
        "created": out.created,
        "model": out.model,
        "choices": [{
            "index": 0,
            "text": done.text,
            "logprobs": lp,
            "finish_reason": reason,
            "stop_reason": stop,
            "token_ids": null,
            "prompt_logprobs": null,
            "prompt_token_ids": null,
            "routed_experts": null
        }],
        "service_tier": null,
        "system_fingerprint": wire::SYSTEM_FINGERPRINT,
        "usage": wire::full_usage(done.finish.prompt_tokens, done.finish.completion_tokens, details),
        "kv_transfer_params": null,
        "ec_transfer_params": null,
        "metrics": null
    }))
    .into_response())
}

struct Out {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    /// Whether the usage reports cached prompt tokens.
    details: bool,
}

struct CompletionRender {
    tok: Arc<SimTokenizer>,
    out: Out,
    usage: UsageMode,
    /// Characters of token text sent so far (`text_offset`).
    offset: usize,
}

impl Render for CompletionRender {
    /// One `text_completion` chunk per token (no role chunk; `stop_reason` on every chunk),
    /// then the usage chunk and `[DONE]`.
    fn token(&mut self, ev: TokenEvent<'_>, pending: &mut VecDeque<Bytes>) {
        let lp = ev.logprobs.map(|lp| {
            let v = logprobs::completion(&self.tok, std::slice::from_ref(&lp), self.offset);
            self.offset += self.tok.token_text(lp.id).chars().count();
            v
        });
        let (reason, stop) = match ev.finish {
            Some(f) => {
                let (r, s) = generate::finish_fields(f);
                (Some(r), s)
            }
            None => (None, None),
        };
        let mut chunk = json!({
            "id": self.out.id,
            "object": "text_completion",
            "created": self.out.created,
            "model": self.out.model,
            "choices": [{
                "index": 0,
                "text": ev.delta,
                "logprobs": lp,
                "finish_reason": reason,
                "stop_reason": stop,
                "prompt_token_ids": null,
                "token_ids": null
            }]
        });
        if let Some(obj) = chunk.as_object_mut() {
            if self.usage == UsageMode::Continuous {
                obj.insert(
                    "usage".into(),
                    json!(StreamUsage::new(self.out.prompt_tokens, ev.generated)),
                );
            }
            if ev.finish.is_some() && self.usage == UsageMode::None {
                obj.insert("system_fingerprint".into(), json!(wire::SYSTEM_FINGERPRINT));
            }
        }
        pending.push_back(sse_frame(&chunk));
        if let Some(f) = ev.finish {
            if self.usage != UsageMode::None {
                let mut usage = json!(StreamUsage::new(f.prompt_tokens, f.completion_tokens));
                if let Some(u) = usage.as_object_mut().filter(|_| self.out.details) {
                    u.insert(
                        "prompt_tokens_details".into(),
                        json!({"cached_tokens": f.cache.cached}),
                    );
                }
                pending.push_back(sse_frame(&json!({
                    "id": self.out.id,
                    "object": "text_completion",
                    "created": self.out.created,
                    "model": self.out.model,
                    "choices": [],
                    "usage": usage,
                    "system_fingerprint": wire::SYSTEM_FINGERPRINT
                })));
            }
            pending.push_back(Bytes::from_static(generate::DONE));
        }
    }
}

/// Token ids as vLLM checks them: each a non-negative integer below the vocabulary size
/// (a legacy completion's prompt and an embeddings input alike).
pub(super) fn token_ids(items: &[Value], vocab: u32) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_u64() {
            Some(id) if id < u64::from(vocab) => Ok(id as u32),
            _ => Err(ApiError::bad_request(
                format!("Token id {v} is out of vocabulary"),
                None,
            )),
        })
        .collect()
}
