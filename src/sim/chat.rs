//! `POST /v1/chat/completions`: text, logprobs and forced tool calls, streamed or not, in
//! vLLM 0.32's shapes (tests/fixtures/vllm/stream_chat_*, chat_*, tools_*).

use std::collections::VecDeque;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;

use super::SimError;
use super::engine::Finish;
use super::generate::{
    self, Collected, Content, Render, Sampling, TokenEvent, UsageMode, finish_fields, sse_frame,
};
use super::http::{ApiError, AppState};
use super::logprobs;
use super::metrics::FinishedReason;
use super::tokenizer::{ChatMessage, SimTokenizer};
use super::tools::{self, ToolDelta, ToolPlan, ToolStream};
use super::wire::{self, Answer, ChunkHead, Delta, StreamUsage};

/// The fields of an OpenAI chat request the simulator acts on; the rest are ignored.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    /// Optional in vLLM: the served model when absent.
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    logprobs: Option<bool>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(flatten)]
    sampling: Sampling,
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match start_chat(&state, &headers, &body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

/// vLLM's `top_logprobs` checks, then `k` when logprobs are on.
fn logprobs_k(req: &ChatRequest) -> Result<Option<i64>, ApiError> {
    let on = req.logprobs.unwrap_or(false);
    if let Some(k) = req.top_logprobs {
        if k < 0 && k != -1 {
            return Err(ApiError::bad_request(
                format!(
                    "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value={k})"
                ),
                Some("top_logprobs"),
            ));
        }
        if k != 0 && !on {
            return Err(ApiError::bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                Some("top_logprobs"),
            ));
        }
    }
    Ok(on.then(|| req.top_logprobs.unwrap_or(0)))
}

async fn start_chat(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let faults = generate::take_request_faults(state)?;
    let mut req: ChatRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}"), None))?;
    let seed = generate::seed_of(&req.sampling);
    let plan = tools::plan(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        seed,
        generate::next_id(),
    )
    .map_err(|(message, param)| ApiError::bad_request(message, Some(param)))?;
    let k = logprobs_k(&req)?;
    generate::validate_sampling(&req.sampling, k)?;
    state.check_generation_model(req.model.as_deref())?;
    let ids = prompt_ids(state, std::mem::take(&mut req.messages)).await?;
    let prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    generate::check_context(state, prompt_tokens)?;
    let content = match &plan {
        Some(p) => Content::Script(state.tokenizer.encode(&p.script)?),
        None => Content::Text {
            logprobs: k.map(|k| u32::try_from(k).unwrap_or(0)),
        },
    };
    let stream = req.sampling.stream.unwrap_or(false);
    let usage = generate::usage_mode(&req.sampling);
    let mut params =
        generate::seq_params(state, req.sampling, seed, prompt_tokens, content, faults)?;
    params.block_hashes = state.block_hashes(&ids);
    let rx = state.engine.submit(params)?;
    let out = Output {
        id: generate::response_id("chatcmpl", headers),
        created: generate::unix_now(),
        model: state.model.clone(),
        prompt_tokens,
        details: state.prompt_tokens_details,
    };
    if stream {
        let render = ChatRender {
            tok: state.tokenizer.clone(),
            out,
            usage,
            sent_role: false,
            tools: plan.map(ToolStream::new),
        };
        return Ok(generate::stream_response(rx, render));
    }
    Ok(match generate::collect(rx).await {
        Ok(done) => Json(answer(
            &state.tokenizer,
            &out,
            plan.as_ref(),
            k.is_some(),
            done,
        ))
        .into_response(),
        Err(cut) => cut,
    })
}

/// Prompt token ids through the chat template, off the async threads.
async fn prompt_ids(state: &AppState, messages: Vec<ChatMessage>) -> Result<Vec<u32>, ApiError> {
    let tokenizer = state.tokenizer.clone();
    let ids =
        tokio::task::spawn_blocking(move || tokenizer.encode(&tokenizer.render_chat(&messages)?))
            .await
            .map_err(|e| ApiError::from(SimError::Tokenizer(e.to_string())))??;
    Ok(ids)
}

/// Identity of one response, repeated in every chunk.
struct Output {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    /// Whether the usage reports cached prompt tokens (`prompt_tokens_details`).
    details: bool,
}

impl Output {
    fn head(&self) -> ChunkHead<'_> {
        ChunkHead {
            id: &self.id,
            created: self.created,
            model: &self.model,
        }
    }
}

/// The finish reason a tool call reports: the end-of-sequence token completes the call.
fn tool_finish(plan: &ToolPlan, f: &Finish) -> &'static str {
    match f.reason {
        FinishedReason::Stop => plan.finish_reason(),
        other => other.as_str(),
    }
}

fn answer(
    tok: &SimTokenizer,
    out: &Output,
    plan: Option<&ToolPlan>,
    with_logprobs: bool,
    done: Collected,
) -> Value {
    let f = &done.finish;
    let (reason, stop) = match plan {
        Some(p) => (tool_finish(p, f), None),
        None => finish_fields(f),
    };
    let answer = Answer {
        content: if plan.is_some() { "" } else { &done.text },
        tool_calls: plan.and_then(|p| p.message_tool_calls(&done.text)),
        logprobs: with_logprobs.then(|| logprobs::chat(tok, &done.logprobs)),
        prompt_details: out.details.then(|| {
            serde_json::json!({
                "cached_tokens": f.cache.cached,
                "created_cache_tokens": f.cache.created,
                "multimodal_tokens": null
            })
        }),
    };
    wire::completion(
        out.head(),
        answer,
        reason,
        stop,
        f.prompt_tokens,
        f.completion_tokens,
    )
}

struct ChatRender {
    tok: Arc<SimTokenizer>,
    out: Output,
    usage: UsageMode,
    sent_role: bool,
    tools: Option<ToolStream>,
}

impl Render for ChatRender {
    /// The role chunk first, the token's chunk (text or tool-call fragment), and after the
    /// last token the usage chunk and `[DONE]`.
    fn token(&mut self, ev: TokenEvent<'_>, pending: &mut VecDeque<Bytes>) {
        let head = self.out.head();
        let prompt = self.out.prompt_tokens;
        let running =
            |n| (self.usage == UsageMode::Continuous).then(|| StreamUsage::new(prompt, n));
        if !self.sent_role {
            self.sent_role = true;
            let mut role = head.role();
            role.usage = running(0);
            pending.push_back(sse_frame(&role));
        }
        let fingerprint = ev.finish.is_some() && self.usage == UsageMode::None;
        let (delta, fields) = match self.tools.as_mut() {
            Some(ts) => {
                let fields = ev.finish.map(|f| (tool_finish(ts.plan(), f), None));
                let calls = match ts.push(ev.delta, ev.finish.is_some()) {
                    ToolDelta::Fragment(v) => Some(v),
                    ToolDelta::Empty => None,
                    ToolDelta::Nothing if ev.finish.is_none() => return,
                    ToolDelta::Nothing => None,
                };
                let delta = Delta {
                    role: None,
                    content: None,
                    tool_calls: calls,
                };
                (delta, fields)
            }
            None => {
                let delta = Delta {
                    role: None,
                    content: Some(ev.delta),
                    tool_calls: None,
                };
                (delta, ev.finish.map(finish_fields))
            }
        };
        let mut chunk = head.delta(delta, fields, fingerprint);
        chunk.usage = running(ev.generated);
        if let (Some(lp), Some(choice)) = (&ev.logprobs, chunk.choices.first_mut()) {
            choice.logprobs = Some(serde_json::json!({
                "content": [logprobs::chat_entry(&self.tok, lp)]
            }));
        }
        pending.push_back(sse_frame(&chunk));
        if let Some(f) = ev.finish {
            if self.usage != UsageMode::None {
                let mut usage = head.usage(f.prompt_tokens, f.completion_tokens);
                if let Some(u) = usage.usage.as_mut().filter(|_| self.out.details) {
                    u.prompt_tokens_details = Some(serde_json::json!({
                        "cached_tokens": f.cache.cached,
                        "created_cache_tokens": f.cache.created
                    }));
                }
                pending.push_back(sse_frame(&usage));
            }
            pending.push_back(Bytes::from_static(generate::DONE));
        }
    }
}
