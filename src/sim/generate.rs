//! What chat and legacy completions share: admission faults, sampling fields, the prompt check,
//! the engine parameters, request ids, prefix-cache accounting, and the two ways of answering
//! (an SSE stream that owns the engine's receiver, or one body once the sequence is over).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tokio::sync::mpsc;

use super::engine::{Finish, SeqEvent, SeqParams};
use super::faults::scaled;
use super::http::{ApiError, AppState};
use super::tokenizer::{Generator, MAX_LOGPROBS, TokenLogprobs};

/// `stop` is a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`; as in vLLM, `include_usage` defaults to true once the object is given.
#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    /// vLLM's extension: every chunk carries the usage so far.
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// Sampling fields chat and completions share.
#[derive(Debug, Deserialize)]
pub struct Sampling {
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub n: Option<u32>,
    /// vLLM's extension: never end at the end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// Stop strings a request may carry; each is searched at every token.
const MAX_STOPS: usize = 16;
const MAX_STOP_CHARS: usize = 256;
/// Longest client request id taken into a response id.
const MAX_REQUEST_ID: usize = 256;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A process-unique number, spread like vLLM's random ids.
pub fn next_id() -> u64 {
    NEXT_ID
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The response id: `prefix-` and the client's `X-Request-Id` when it sent a usable one (vLLM
/// takes it as the request id, and does not echo the header), else 16 hex digits.
pub fn response_id(prefix: &str, headers: &HeaderMap) -> String {
    match headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID)
    {
        Some(id) => format!("{prefix}-{id}"),
        None => format!("{prefix}-{:016x}", next_id()),
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Faults a new request inherits: (crash after, stall after, slow first token).
pub type RequestFaults = (Option<u32>, Option<u32>, Option<u64>);

/// Answers 503 while loading and 500 while the HTTP-500 fault lasts.
pub fn take_request_faults(state: &AppState) -> Result<RequestFaults, ApiError> {
    let mut faults = state.faults();
    if faults.loading() {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            param: None,
            message: "The model is still loading.".into(),
        });
    }
    if faults.take_http_500() {
        return Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            param: None,
            message: "Simulated engine failure (fault http_500).".into(),
        });
    }
    Ok((
        faults.crash_after_tokens,
        faults.stall_after_tokens,
        faults.slow_first_token_ms,
    ))
}

/// vLLM's 404 for a model it does not serve.
pub fn not_found(model: &str, valid: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "NotFoundError",
        param: Some("model"),
        message: format!("The model `{model}` does not exist. Valid aliases: {valid}."),
    }
}

/// The checks vLLM makes on the sampling fields before tokenizing.
pub fn validate_sampling(s: &Sampling, logprobs: Option<i64>) -> Result<(), ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(
            "n must be 1: the simulator generates one choice.",
            Some("n"),
        ));
    }
    if s.max_completion_tokens.or(s.max_tokens) == Some(0) {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.",
            Some("max_tokens"),
        ));
    }
    if let Some(k) = logprobs {
        // -1 asks for the whole vocabulary, which is over the limit too.
        let asked = if k == -1 { 2000 } else { k };
        if asked > i64::from(MAX_LOGPROBS) {
            return Err(ApiError::bad_request(
                format!(
                    "Requested sample logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS} (parameter=logprobs, value={asked})"
                ),
                Some("logprobs"),
            ));
        }
        if asked < 0 {
            return Err(ApiError::bad_request(
                format!(
                    "`logprobs` must be a positive value or -1. (parameter=logprobs, value={k})"
                ),
                Some("logprobs"),
            ));
        }
    }
    Ok(())
}

/// 400 when the prompt leaves no room in the context, worded as vLLM.
pub fn check_context(state: &AppState, prompt_tokens: u32) -> Result<(), ApiError> {
    let max_model_len = state.max_model_len;
    if prompt_tokens >= max_model_len {
        let shown = prompt_tokens.min(max_model_len.saturating_add(1));
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least {shown} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={shown})"
            ),
            Some("input_tokens"),
        ));
    }
    Ok(())
}

/// What the sequence generates instead of sampled text.
pub enum Content {
    /// Sampled text, with logprobs of `k` alternatives when asked for.
    Text { logprobs: Option<u32> },
    /// Exactly these tokens, then the end-of-sequence token.
    Script(Vec<u32>),
}

/// The seed a request gives, or a fresh one.
pub fn seed_of(s: &Sampling) -> u64 {
    s.seed
        .unwrap_or_else(|| next_id().wrapping_mul(0x2545_F491_4F6C_DD1D))
}

/// What the engine needs to run the request.
pub fn seq_params(
    state: &AppState,
    s: Sampling,
    seed: u64,
    prompt_tokens: u32,
    content: Content,
    (crash_after, stall_after, slow_first_token_ms): RequestFaults,
) -> Result<SeqParams, ApiError> {
    let room = state.max_model_len.saturating_sub(prompt_tokens);
    let requested = s.max_completion_tokens.or(s.max_tokens);
    let stops = match s.stop {
        None => Vec::new(),
        Some(StopField::One(x)) => vec![x],
        Some(StopField::Many(v)) => v,
    };
    if stops.len() > MAX_STOPS || stops.iter().any(|x| x.chars().count() > MAX_STOP_CHARS) {
        return Err(ApiError::bad_request(
            format!("At most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters."),
            Some("stop"),
        ));
    }
    let (generator, eos_at) = match content {
        Content::Text { logprobs } => {
            // Without max_tokens a chat model ends its answer itself: draw where, from the seed.
            let eos_at = (requested.is_none() && !s.ignore_eos.unwrap_or(false))
                .then(|| natural_length(seed, state.natural_output_tokens));
            let g = Generator::new(state.tokenizer.clone(), seed, stops);
            let g = match logprobs {
                Some(k) => g.with_logprobs(k, seed),
                None => g,
            };
            (g, eos_at)
        }
        Content::Script(ids) => {
            let eos = u32::try_from(ids.len())
                .unwrap_or(u32::MAX)
                .saturating_add(1);
            (
                Generator::scripted(state.tokenizer.clone(), seed, ids),
                Some(eos),
            )
        }
    };
    Ok(SeqParams {
        prompt_tokens,
        max_tokens: requested.map_or(room, |m| m.min(room)),
        eos_at,
        generator,
        crash_after,
        stall_after,
        first_token_delay: slow_first_token_ms
            .map_or(std::time::Duration::ZERO, |ms| scaled(ms, state.time_scale)),
        block_hashes: Vec::new(),
    })
}

/// An answer length drawn uniformly from [mean/2, 3·mean/2], reproducible from the seed.
fn natural_length(seed: u64, mean: u32) -> u32 {
    use rand::{Rng, SeedableRng};
    let mean = mean.max(2);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x454F_535F_5345_4544);
    rng.random_range(mean / 2..=mean.saturating_add(mean / 2))
}

/// Where usage appears in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageMode {
    /// Nowhere (no `include_usage`).
    None,
    /// In a last chunk with `choices: []`.
    Final,
    /// Also on every chunk, as running totals (`continuous_usage_stats`).
    Continuous,
}

pub fn usage_mode(s: &Sampling) -> UsageMode {
    let opts = s.stream_options.as_ref();
    let include = opts.is_some_and(|o| o.include_usage.unwrap_or(true));
    let continuous = include && opts.is_some_and(|o| o.continuous_usage_stats.unwrap_or(false));
    match (include, continuous) {
        (false, _) => UsageMode::None,
        (true, false) => UsageMode::Final,
        (true, true) => UsageMode::Continuous,
    }
}

pub fn sse_frame(chunk: &impl serde::Serialize) -> Bytes {
    let mut buf = b"data: ".to_vec();
    if serde_json::to_writer(&mut buf, chunk).is_err() {
        buf.extend_from_slice(b"{}");
    }
    buf.extend_from_slice(b"\n\n");
    Bytes::from(buf)
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

pub fn finish_fields(f: &Finish) -> (&'static str, Option<&str>) {
    (f.reason.as_str(), f.stop.as_deref())
}

/// The connection is cut, as when the engine process dies under a stream.
fn cut() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "engine crashed")
}

/// One engine token, as the renderers see it.
pub struct TokenEvent<'a> {
    pub delta: &'a str,
    pub generated: u32,
    pub finish: Option<&'a Finish>,
    pub logprobs: Option<TokenLogprobs>,
}

/// Turns engine tokens into SSE frames (the renderer queues `[DONE]` itself).
pub trait Render: Send + 'static {
    fn token(&mut self, ev: TokenEvent<'_>, out: &mut VecDeque<Bytes>);
}

struct StreamState<R> {
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    render: R,
    pending: VecDeque<Bytes>,
    finished: bool,
}

/// An SSE response owning the engine's receiver: when the client leaves, the body is dropped,
/// the receiver with it, and the engine aborts the sequence.
pub fn stream_response<R: Render>(rx: mpsc::UnboundedReceiver<SeqEvent>, render: R) -> Response {
    let st = StreamState {
        rx,
        render,
        pending: VecDeque::new(),
        finished: false,
    };
    let body = futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(frame) = st.pending.pop_front() {
                return Some((Ok::<Bytes, std::io::Error>(frame), st));
            }
            if st.finished {
                return None;
            }
            match st.rx.recv().await {
                Some(SeqEvent::Token {
                    delta,
                    generated,
                    finish,
                    logprobs,
                }) => {
                    st.finished = finish.is_some();
                    let ev = TokenEvent {
                        delta: &delta,
                        generated,
                        finish: finish.as_ref(),
                        logprobs,
                    };
                    st.render.token(ev, &mut st.pending);
                }
                Some(SeqEvent::Crashed) | None => {
                    st.finished = true;
                    return Some((Err(cut()), st));
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A whole sequence, for a non-streamed answer.
pub struct Collected {
    pub text: String,
    pub finish: Finish,
    pub logprobs: Vec<TokenLogprobs>,
}

/// Waits for the sequence to end; `Err` carries the response for an engine that died (headers
/// go out, then the connection is cut).
pub async fn collect(mut rx: mpsc::UnboundedReceiver<SeqEvent>) -> Result<Collected, Response> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            SeqEvent::Token {
                delta,
                finish,
                logprobs: lp,
                ..
            } => {
                text.push_str(&delta);
                logprobs.extend(lp);
                if let Some(finish) = finish {
                    return Ok(Collected {
                        text,
                        finish,
                        logprobs,
                    });
                }
            }
            SeqEvent::Crashed => break,
        }
    }
    let body = futures::stream::once(async { Err::<Bytes, _>(cut()) });
    Err(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}
