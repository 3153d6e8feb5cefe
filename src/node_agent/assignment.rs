//! One assignment, from `assign` to its last frame. The engine is always asked to stream with
//! running usage, so a stream that ends early still reports exact usage. Every assignment ends
//! in exactly one of two ways:
//! - an `error` and no `done`: the engine refused it before streaming (nothing was generated);
//! - a `done` (kept in the ledger before it is sent), after an `error` when the stream broke.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};
use switchyard_actors::output::{RawJson, WireDelta};
use switchyard_actors::protocol::{Api, NodeFrame, is_finish_reason};
use switchyard_actors::tier::Tier;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::engine::{
    EngineClient, MAX_ERROR_MESSAGE, error_code_for_status, error_message, read_limited,
    truncate_chars,
};
use super::faults::AgentFaults;
use super::ledger::{Done, Key, Ledger};
use super::sse::SseParser;
use super::writer::Outgoing;

/// Largest error body read from the engine.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// Largest embeddings answer read from the engine (2048 inputs of 4096 floats as JSON).
const MAX_EMBEDDINGS_BODY: usize = 256 << 20;
/// Embeddings per `chunk` frame, in bytes: well under the server's 1 MiB frame limit.
const EMBEDDINGS_PER_FRAME: usize = 256 << 10;
/// The largest single embedding a frame can carry.
const MAX_EMBEDDING_BYTES: usize = 900 << 10;

/// An `assign` frame.
#[derive(Debug)]
pub(crate) struct Assignment {
    pub request_id: String,
    pub attempt: u64,
    pub model: String,
    pub body: Value,
    pub api: Api,
    pub x_request_id: Option<String>,
    pub traceparent: Option<String>,
    pub tier: Option<Tier>,
}

/// What an assignment task needs from the session.
#[derive(Debug, Clone)]
pub(crate) struct AssignCtx {
    pub engine: EngineClient,
    pub out: mpsc::Sender<Outgoing>,
    pub ledger: Arc<Ledger>,
    /// Cancelled by a `cancel` frame, an expired lease, a lost connection or shutdown.
    pub cancel: CancellationToken,
    /// Injected faults (tests and drills).
    pub faults: AgentFaults,
    /// The protocol version spoken on this connection: 1 relays text only.
    pub protocol: u32,
    /// The engine schedules by priority (`--engine-priority`): each request carries its
    /// tier as vLLM's `priority`.
    pub engine_priority: bool,
}

/// Runs the assignment to its end; returns its key for the session's bookkeeping.
pub(crate) async fn run(a: Assignment, ctx: AssignCtx) -> Key {
    let key = (a.request_id.clone(), a.attempt);
    // Every line of the assignment names the generation and the client's request id (which
    // the engine's own log shows too).
    let span = tracing::info_span!(
        "assignment",
        request_id = %a.request_id,
        attempt = a.attempt,
        x_request_id = a.x_request_id.as_deref().unwrap_or("-"),
    );
    execute(a, &ctx).instrument(span).await;
    key
}

/// The body sent to the engine: the server's body with the engine's model name, the tier as
/// vLLM's `priority` when the engine schedules by it (`priority`), and, for a generation,
/// forced streaming with running usage (the server renders what its client asked for).
pub(crate) fn engine_body(
    body: Value,
    model: &str,
    api: Api,
    priority: Option<Tier>,
) -> Result<Value, &'static str> {
    let Value::Object(mut map) = body else {
        return Err("assignment body is not a JSON object");
    };
    map.insert("model".into(), Value::from(model));
    if let Some(tier) = priority {
        map.insert("priority".into(), Value::from(tier.engine_priority()));
    }
    if api == Api::Embeddings {
        return Ok(Value::Object(map));
    }
    map.insert("stream".into(), Value::Bool(true));
    let mut options = match map.remove("stream_options") {
        Some(Value::Object(o)) => o,
        _ => Map::new(),
    };
    options.insert("include_usage".into(), Value::Bool(true));
    options.insert("continuous_usage_stats".into(), Value::Bool(true));
    map.insert("stream_options".into(), Value::Object(options));
    Ok(Value::Object(map))
}

async fn execute(a: Assignment, ctx: &AssignCtx) {
    let id = Id {
        request_id: a.request_id,
        attempt: a.attempt,
    };
    let priority = a.tier.filter(|_| ctx.engine_priority);
    let body = match engine_body(a.body, &a.model, a.api, priority) {
        Ok(b) => b,
        Err(why) => return ctx.refuse(&id, "invalid_request", why.into()).await,
    };
    tracing::debug!(model = %a.model, api = a.api.path(), "forwarding to the engine");
    let sent = tokio::select! {
        biased;
        () = ctx.cancel.cancelled() => {
            // Confirms the stop; nothing was generated.
            return ctx.finish(&id, Relay::default().usage(), "abort", None).await;
        }
        r = ctx.engine.post(a.api, &body, a.x_request_id.as_deref(), a.traceparent.as_deref()) => r,
    };
    drop(body);
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "engine request failed");
            let message = truncate_chars(&format!("engine unreachable: {e}"), MAX_ERROR_MESSAGE);
            // Its own code: the server takes a node whose engine cannot be reached out of
            // routing, which an engine's answer (even a 5xx caused by the request) must not do.
            return ctx.refuse(&id, "engine_unreachable", message).await;
        }
    };
    let status = resp.status().as_u16();
    if status != 200 {
        let body = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => Vec::new(),
            b = read_limited(&mut resp, MAX_ERROR_BODY) => b.unwrap_or_default(),
        };
        let code = error_code_for_status(status);
        tracing::warn!(status, code, "engine refused the assignment");
        return ctx.refuse(&id, code, error_message(status, &body)).await;
    }
    if a.api == Api::Embeddings {
        return embeddings(&id, ctx, resp).await;
    }
    stream(&id, ctx, resp).await;
}

/// An embeddings answer is one JSON document: relayed as chunks of `{"data": […]}`, each a
/// slice of the engine's array with its items as the engine wrote them (a frame stays far
/// below the server's limit), then a `done` with its prompt tokens.
async fn embeddings(id: &Id, ctx: &AssignCtx, mut resp: reqwest::Response) {
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<RawJson>,
        #[serde(default)]
        usage: Option<EngineUsage>,
    }
    let accepted = NodeFrame::Accepted {
        request_id: id.request_id.clone(),
        attempt: id.attempt,
    };
    if !ctx.send(accepted).await {
        return ctx.finish(id, (0, 0), "abort", None).await;
    }
    let body = tokio::select! {
        biased;
        () = ctx.cancel.cancelled() => return ctx.finish(id, (0, 0), "abort", None).await,
        b = read_limited(&mut resp, MAX_EMBEDDINGS_BODY) => b,
    };
    let answer = match body.map(|b| serde_json::from_slice::<Answer>(&b)) {
        Ok(Ok(a)) => a,
        Ok(Err(_)) | Err(_) => {
            let message = "engine sent an unreadable embeddings answer".to_owned();
            return ctx.finish(id, (0, 0), "error", Some(message)).await;
        }
    };
    let prompt = answer.usage.as_ref().map_or(0, |u| u.prompt_tokens);
    if answer
        .data
        .iter()
        .any(|item| item.get().len() > MAX_EMBEDDING_BYTES)
    {
        let message = "an embedding is too large to relay".to_owned();
        return ctx.finish(id, (prompt, 0), "error", Some(message)).await;
    }
    let mut chunks = 0;
    for (seq, slice) in (0u64..).zip(slices(&answer.data, EMBEDDINGS_PER_FRAME)) {
        let items: Vec<&str> = slice.iter().map(RawJson::get).collect();
        let Some(delta) = RawJson::parse(&format!(r#"{{"data":[{}]}}"#, items.join(","))) else {
            let message = "engine sent an unreadable embeddings answer".to_owned();
            return ctx.finish(id, (prompt, 0), "error", Some(message)).await;
        };
        let chunk = NodeFrame::Chunk {
            request_id: id.request_id.clone(),
            attempt: id.attempt,
            seq,
            delta: WireDelta::Object(delta),
            logprobs: None,
        };
        if !ctx.send(chunk).await {
            return ctx.finish(id, (prompt, 0), "abort", None).await;
        }
        chunks = seq + 1;
    }
    let counts = Counts {
        chunks,
        ..Counts::from((prompt, 0))
    };
    ctx.finish(id, counts, "stop", None).await;
}

/// `items` in consecutive slices of at most `bytes` of JSON each (an item larger than that
/// alone in its slice).
fn slices(items: &[RawJson], bytes: usize) -> Vec<&[RawJson]> {
    let mut out = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let len = item.get().len() + 1;
        if i > start && size + len > bytes {
            out.push(&items[start..i]);
            (start, size) = (i, 0);
        }
        size += len;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Identity of the attempt, repeated in every frame.
struct Id {
    request_id: String,
    attempt: u64,
}

/// How a stream that started ended.
enum End {
    /// `data: [DONE]`.
    Completed,
    /// `cancel`, an expired lease, a lost connection, or shutdown.
    Cancelled,
    /// Body error, EOF without `[DONE]`, an oversized or unparsable event, an error event:
    /// what went wrong (for the log) and the message for the server (which may quote the
    /// engine, so it is not logged).
    Broken(&'static str, String),
}

async fn stream(id: &Id, ctx: &AssignCtx, mut resp: reqwest::Response) {
    let mut relay = Relay::default();
    let accepted = NodeFrame::Accepted {
        request_id: id.request_id.clone(),
        attempt: id.attempt,
    };
    let sent = if ctx.faults.take_accepted_drop() {
        tracing::warn!("fault injected: accepted frame not sent");
        true
    } else {
        ctx.send(accepted).await
    };
    let end = if sent {
        relay_events(id, ctx, &mut resp, &mut relay).await
    } else {
        End::Cancelled
    };
    // Closing the response closes the engine request: vLLM aborts the sequence at once and
    // frees its KV blocks.
    drop(resp);
    let usage = relay.counts();
    match end {
        End::Completed => {
            let reason = relay.finish_reason.as_deref().unwrap_or("stop");
            ctx.finish(id, usage, reason, None).await;
        }
        End::Cancelled => ctx.finish(id, usage, "abort", None).await,
        End::Broken(kind, message) => {
            tracing::warn!(kind, "engine stream broke");
            ctx.finish(id, usage, "error", Some(message)).await;
        }
    }
}

async fn relay_events(
    id: &Id,
    ctx: &AssignCtx,
    resp: &mut reqwest::Response,
    relay: &mut Relay,
) -> End {
    let mut parser = SseParser::default();
    let mut events = Vec::new();
    loop {
        let read = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => return End::Cancelled,
            r = resp.chunk() => r,
        };
        let eof = match read {
            Ok(Some(bytes)) => parser.push(&bytes, &mut events).map(|()| false),
            Ok(None) => parser.finish(&mut events).map(|()| true),
            Err(e) => {
                tracing::debug!(error = %e, "engine body error");
                return End::Broken("body error", format!("engine stream broke: {e}"));
            }
        };
        let eof = match eof {
            Ok(eof) => eof,
            Err(e) => return End::Broken("oversized event", format!("engine sent a {e}")),
        };
        for data in events.drain(..) {
            match relay.event(&data, ctx.protocol) {
                Event::Nothing => {}
                Event::Piece(delta, logprobs) => {
                    let frame = NodeFrame::Chunk {
                        request_id: id.request_id.clone(),
                        attempt: id.attempt,
                        seq: relay.seq,
                        delta,
                        logprobs,
                    };
                    relay.seq += 1;
                    if !ctx.send(frame).await {
                        return End::Cancelled;
                    }
                }
                Event::Done => return End::Completed,
                Event::Broken(kind, message) => return End::Broken(kind, message),
            }
        }
        if eof {
            return End::Broken("eof", "engine stream ended without [DONE]".into());
        }
    }
}

impl AssignCtx {
    /// Sends a frame unless the assignment is cancelled first; false when it was not sent
    /// (cancelled, or the connection is gone: either way the stream must stop).
    async fn send(&self, frame: NodeFrame) -> bool {
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => false,
            r = self.out.send(Outgoing::Frame(frame)) => r.is_ok(),
        }
    }

    /// The engine refused before streaming: an `error` and no `done`.
    async fn refuse(&self, id: &Id, code: &str, message: String) {
        let _ = self
            .out
            .send(Outgoing::Frame(error_frame(id, code, message)))
            .await;
    }

    /// Records the `done` (so it survives a lost connection), then sends the optional
    /// `model_backend_error` and the `done`. A failed send is fine: the ledger resends.
    async fn finish(
        &self,
        id: &Id,
        counts: impl Into<Counts>,
        reason: &str,
        error: Option<String>,
    ) {
        let Counts {
            prompt,
            completion,
            cached,
            chunks,
        } = counts.into();
        let done = Done {
            request_id: id.request_id.clone(),
            attempt: id.attempt,
            prompt_tokens: prompt,
            completion_tokens: completion,
            // Version 1 servers know no such field; they would ignore it, but say nothing.
            cached_tokens: cached.filter(|_| self.protocol >= 2),
            chunks: Some(chunks).filter(|_| self.protocol >= 2),
            // The server believes only a short word; an engine that says something else
            // failed to say how it ended.
            finish_reason: if is_finish_reason(reason) {
                reason.to_owned()
            } else {
                "error".to_owned()
            },
        };
        tracing::info!(
            finish_reason = %done.finish_reason,
            prompt_tokens = prompt,
            completion_tokens = completion,
            "assignment finished"
        );
        let frame = done.frame();
        self.ledger.record(done);
        // The `done` goes first: it proves the attempt started even when its `accepted` was
        // lost, so the server never reads the error that follows as a refusal and runs the
        // prompt a second time.
        let _ = self.out.send(Outgoing::Frame(frame)).await;
        if let Some(message) = error {
            let message = truncate_chars(&message, MAX_ERROR_MESSAGE);
            let frame = error_frame(id, "model_backend_error", message);
            let _ = self.out.send(Outgoing::Frame(frame)).await;
        }
    }
}

fn error_frame(id: &Id, code: &str, message: String) -> NodeFrame {
    NodeFrame::Error {
        request_id: id.request_id.clone(),
        attempt: id.attempt,
        code: code.to_owned(),
        message,
    }
}

/// A `done`'s counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    prompt: u64,
    completion: u64,
    /// Prompt tokens served from the engine's prefix cache, when it said.
    cached: Option<u64>,
    /// `chunk`s sent for the attempt.
    chunks: u64,
}

impl From<(u64, u64)> for Counts {
    fn from((prompt, completion): (u64, u64)) -> Self {
        Self {
            prompt,
            completion,
            cached: None,
            chunks: 0,
        }
    }
}

/// What one engine event means for the relay.
#[derive(Debug, PartialEq)]
enum Event {
    Nothing,
    /// A delta to relay, and its logprobs.
    Piece(WireDelta, Option<RawJson>),
    Done,
    Broken(&'static str, String),
}

/// The state of one relayed stream.
#[derive(Debug, Default)]
struct Relay {
    /// Next `chunk` sequence number (from 0 per attempt).
    seq: u64,
    /// Latest running usage `(prompt, completion)` the engine reported.
    usage: Option<(u64, u64)>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the engine reported it.
    cached: Option<u64>,
    /// `finish_reason` of the finish chunk.
    finish_reason: Option<String>,
    /// Pieces relayed, the completion count of last resort.
    content_chunks: u64,
}

/// The parts of a `chat.completion.chunk` the relay reads (and vLLM's error shapes).
#[derive(Deserialize)]
struct EngineChunk {
    #[serde(default)]
    choices: Vec<EngineChoice>,
    #[serde(default)]
    usage: Option<EngineUsage>,
    #[serde(default)]
    error: Option<EngineError>,
    /// Older vLLM streams errors as `{"object": "error", "message": …}`.
    #[serde(default)]
    object: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// A choice of a chat chunk (`delta`) or of a legacy completion chunk (`text`).
#[derive(Deserialize)]
struct EngineChoice {
    #[serde(default)]
    delta: Option<RawJson>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    logprobs: Option<RawJson>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct EngineUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Whether a delta carries nothing: every field null, empty, or the role. vLLM opens with
/// `{"role":"assistant","content":""}` and sends empty deltas now and then; the gateway
/// writes the role itself.
fn is_empty_delta(delta: &RawJson) -> bool {
    let Ok(fields) = serde_json::from_str::<Map<String, Value>>(delta.get()) else {
        return false;
    };
    fields.iter().all(|(k, v)| match v {
        Value::Null => true,
        Value::String(s) => s.is_empty() || k == "role",
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    })
}

/// A delta's `content`, for a version 1 server (text only).
fn delta_text(delta: &RawJson) -> Option<String> {
    #[derive(Deserialize)]
    struct Content {
        #[serde(default)]
        content: Option<String>,
    }
    serde_json::from_str::<Content>(delta.get())
        .ok()
        .and_then(|c| c.content)
}

#[derive(Deserialize)]
struct EngineError {
    #[serde(default)]
    message: Option<String>,
}

impl Relay {
    /// Reads one engine event; `protocol` is the server's (1: text only).
    fn event(&mut self, data: &[u8], protocol: u32) -> Event {
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            return Event::Done;
        }
        if data.is_empty() {
            return Event::Nothing;
        }
        let Ok(chunk) = serde_json::from_slice::<EngineChunk>(data) else {
            return Event::Broken(
                "unparsable event",
                "engine sent an event that is not a chunk".into(),
            );
        };
        if let Some(e) = chunk.error {
            let m = e.message.unwrap_or_default();
            return Event::Broken("error event", format!("engine error: {m}"));
        }
        if chunk.object.as_deref() == Some("error") {
            let m = chunk.message.unwrap_or_default();
            return Event::Broken("error event", format!("engine error: {m}"));
        }
        if let Some(u) = chunk.usage {
            self.usage = Some((u.prompt_tokens, u.completion_tokens));
            if let Some(c) = u.prompt_tokens_details.and_then(|d| d.cached_tokens) {
                self.cached = Some(c);
            }
        }
        let Some(choice) = chunk.choices.into_iter().next() else {
            return Event::Nothing;
        };
        if let Some(reason) = choice.finish_reason {
            self.finish_reason = Some(reason);
        }
        let logprobs = choice.logprobs.filter(|l| l.get() != "null");
        let delta = match (choice.delta, choice.text) {
            (Some(delta), _) if !is_empty_delta(&delta) || logprobs.is_some() => delta,
            // A legacy completion: its text is the delta.
            (None, Some(text)) if !text.is_empty() || logprobs.is_some() => {
                match RawJson::from_value(&serde_json::json!({ "text": text })) {
                    Some(d) => d,
                    None => return Event::Nothing,
                }
            }
            _ => return Event::Nothing,
        };
        if protocol < 2 {
            return match delta_text(&delta) {
                Some(text) if !text.is_empty() => {
                    self.content_chunks += 1;
                    Event::Piece(WireDelta::Text(text), None)
                }
                _ => Event::Nothing,
            };
        }
        self.content_chunks += 1;
        Event::Piece(WireDelta::Object(delta), logprobs)
    }

    /// Exact usage when the engine reported any; else 0 prompt tokens and one completion
    /// token per relayed piece.
    fn usage(&self) -> (u64, u64) {
        self.usage.unwrap_or((0, self.content_chunks))
    }

    /// [`Relay::usage`] with the cached prompt tokens.
    fn counts(&self) -> Counts {
        let (prompt, completion) = self.usage();
        Counts {
            prompt,
            completion,
            cached: self.cached,
            chunks: self.seq,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn the_engine_body_forces_streaming_with_running_usage() {
        let body = serde_json::json!({
            "model": "small", "messages": [], "stream": false,
            "stream_options": {"include_usage": false, "other": 1}, "max_tokens": 3
        });
        let b = engine_body(body.clone(), "llama", Api::Chat, None).unwrap();
        assert_eq!(b["model"], "llama");
        assert!(b.get("priority").is_none());
        // Only to an engine that schedules by priority: the tier, lower first.
        let b = engine_body(body, "llama", Api::Chat, Some(Tier::Flex)).unwrap();
        assert_eq!(b["priority"], 2);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["stream_options"]["continuous_usage_stats"], true);
        assert_eq!(b["stream_options"]["other"], 1);
        assert_eq!(b["max_tokens"], 3);
        assert!(engine_body(serde_json::json!([1]), "m", Api::Chat, None).is_err());
    }

    #[test]
    fn relay_reads_vllm_chunks() {
        let mut r = Relay::default();
        let role = br#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":30,"total_tokens":30,"completion_tokens":0}}"#;
        assert_eq!(r.event(role, 1), Event::Nothing);
        assert_eq!(r.usage(), (30, 0));
        let text = br#"{"choices":[{"index":0,"delta":{"content":"AR"},"finish_reason":null}],"usage":{"prompt_tokens":30,"total_tokens":31,"completion_tokens":1}}"#;
        assert_eq!(
            r.event(text, 1),
            Event::Piece(WireDelta::Text("AR".into()), None)
        );
        let fin = br#"{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":30,"total_tokens":32,"completion_tokens":2}}"#;
        assert_eq!(r.event(fin, 1), Event::Nothing);
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":30,"total_tokens":32,"completion_tokens":2}}"#;
        assert_eq!(r.event(usage, 1), Event::Nothing);
        assert_eq!(r.event(b"[DONE]", 1), Event::Done);
        assert_eq!(r.usage(), (30, 2));
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn version_two_relays_the_engines_delta_bytes_with_tool_calls_and_logprobs() {
        let mut r = Relay::default();
        let role = br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(r.event(role, 2), Event::Nothing);
        let call = r#"{"tool_calls":[{"index":0,"id":"chatcmpl-tool-1","type":"function","function":{"name":"get_weather","arguments":""}}]}"#;
        let chunk = format!(
            r#"{{"choices":[{{"index":0,"delta":{call},"logprobs":null,"finish_reason":null}}]}}"#
        );
        let Event::Piece(WireDelta::Object(raw), None) = r.event(chunk.as_bytes(), 2) else {
            panic!("tool call not relayed");
        };
        assert_eq!(raw.get(), call, "the engine's bytes, not a re-encoding");
        let lp = r#"{"content":[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[]}]}"#;
        let chunk = format!(
            r#"{{"choices":[{{"index":0,"delta":{{"content":"a"}},"logprobs":{lp},"finish_reason":"tool_calls"}}],"usage":{{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{{"cached_tokens":4}}}}}}"#
        );
        let Event::Piece(_, Some(logprobs)) = r.event(chunk.as_bytes(), 2) else {
            panic!("logprobs not relayed");
        };
        assert_eq!(logprobs.get(), lp);
        assert_eq!(r.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(
            r.counts(),
            Counts {
                prompt: 9,
                completion: 2,
                cached: Some(4),
                chunks: 0,
            }
        );
        // A legacy completion's text becomes a `text` delta.
        let text =
            br#"{"choices":[{"index":0,"text":" hi","logprobs":null,"finish_reason":null}]}"#;
        let Event::Piece(WireDelta::Object(raw), None) = r.event(text, 2) else {
            panic!("completion text not relayed");
        };
        assert_eq!(raw.get(), r#"{"text":" hi"}"#);
        // To a version 1 server, only text travels.
        assert_eq!(
            r.event(chunk.as_bytes(), 1),
            Event::Piece(WireDelta::Text("a".into()), None)
        );
        assert_eq!(
            Relay::default().event(
                format!(r#"{{"choices":[{{"delta":{call}}}]}}"#).as_bytes(),
                1
            ),
            Event::Nothing
        );
    }

    #[test]
    fn embeddings_are_sliced_in_order_under_the_frame_budget() {
        let items: Vec<RawJson> = (0..10)
            .map(|i| RawJson::parse(&format!("[{}]", "1,".repeat(i * 10) + "0")).unwrap())
            .collect();
        let parts = slices(&items, 64);
        let flat: Vec<&RawJson> = parts.iter().flat_map(|p| p.iter()).collect();
        assert_eq!(flat.len(), 10, "every item, once");
        assert!(flat.iter().zip(&items).all(|(a, b)| *a == b), "in order");
        for part in &parts {
            let size: usize = part.iter().map(|i| i.get().len() + 1).sum();
            assert!(part.len() == 1 || size <= 64, "{size}");
        }
        assert!(slices(&[], 64).is_empty());
    }

    #[test]
    fn without_usage_the_content_chunks_are_counted() {
        let mut r = Relay::default();
        for _ in 0..3 {
            r.event(br#"{"choices":[{"delta":{"content":"x"}}]}"#, 1);
        }
        r.event(br#"{"choices":[{"delta":{"content":""}}]}"#, 1);
        assert_eq!(r.usage(), (0, 3));
    }

    #[test]
    fn error_events_and_garbage_break_the_stream() {
        let mut r = Relay::default();
        assert!(matches!(
            r.event(br#"{"error":{"message":"boom","type":"InternalServerError","code":500}}"#, 1),
            Event::Broken(_, m) if m.contains("boom")
        ));
        assert!(matches!(
            r.event(br#"{"object":"error","message":"old"}"#, 1),
            Event::Broken(..)
        ));
        assert!(matches!(r.event(b"{not json", 1), Event::Broken(..)));
        assert!(matches!(r.event(b"\xff\xfe", 1), Event::Broken(..)));
    }
}
