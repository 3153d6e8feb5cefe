//! The simulator's HTTP surface: vLLM's OpenAI routes and probes, plus `/sim/faults`.
//!
//! Handlers validate as vLLM does (unknown model 404, prompt over the context 400, both plain
//! JSON even for streams), hand the sequence to the engine, and render its events as vLLM's
//! SSE chunks or one JSON body. A dropped response drops the receiver, which aborts the
//! sequence in the engine.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::engine::{EngineHandle, Finish, SeqEvent, SeqParams};
use super::faults::{FaultSpec, Faults, scaled};
use super::metrics::{self, CacheInfo};
use super::tokenizer::{ChatMessage, Generator, SimTokenizer};
use super::wire::{self, ChunkHead, StreamUsage};
use super::{ExitMode, SimError};

/// Shared by every handler.
#[derive(Debug)]
pub struct AppState {
    pub model: String,
    /// Mean answer length of requests that give no `max_tokens`.
    pub natural_output_tokens: u32,
    pub max_model_len: u32,
    pub time_scale: f64,
    pub created_unix: u64,
    pub tokenizer: Arc<SimTokenizer>,
    pub engine: EngineHandle,
    pub faults: Mutex<Faults>,
    pub cache_info: CacheInfo,
    pub exit_mode: ExitMode,
    pub shutdown: CancellationToken,
    /// The pending exit fault, if one is armed.
    pub exit_armed: Mutex<Option<CancellationToken>>,
}

impl AppState {
    fn disarm_exit(&self) {
        if let Some(armed) = self
            .exit_armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            armed.cancel();
        }
    }

    fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_page))
        .route(
            "/sim/faults",
            get(get_faults).post(post_faults).delete(delete_faults),
        )
        .with_state(state)
}

/// A vLLM-style error answer.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            param,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = wire::error_body(&self.message, self.kind, self.param, self.status.as_u16());
        (self.status, Json(body)).into_response()
    }
}

impl From<SimError> for ApiError {
    fn from(e: SimError) -> Self {
        match e {
            SimError::BadRequest(m) => ApiError::bad_request(m, None),
            other => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "InternalServerError",
                param: None,
                message: other.to_string(),
            },
        }
    }
}

/// `stop` is a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`; as in vLLM, `include_usage` defaults to true once the object is given.
#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    /// vLLM's extension: every chunk carries the usage so far.
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// The fields of an OpenAI chat request the simulator acts on; the rest are ignored.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    /// Optional in vLLM: the served model when absent.
    #[serde(default)]
    model: Option<String>,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stop: Option<StopField>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    n: Option<u32>,
    /// vLLM's extension: never end at the end-of-sequence token.
    #[serde(default)]
    ignore_eos: Option<bool>,
}

/// Stop strings a request may carry; each is searched at every token.
const MAX_STOPS: usize = 16;
const MAX_STOP_CHARS: usize = 256;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// `chatcmpl-` and 16 hex digits, unique within the process.
fn completion_id() -> String {
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    // A multiplicative hash spreads consecutive ids like vLLM's random ones.
    format!("chatcmpl-{:016x}", n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match start_chat(&state, &body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn start_chat(state: &Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let faults = take_request_faults(state)?;
    let mut req: ChatRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}"), None))?;
    validate(state, &req)?;
    let prompt_tokens = count_prompt(state, std::mem::take(&mut req.messages)).await?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = req
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage.unwrap_or(true));
    let continuous_usage = include_usage
        && req
            .stream_options
            .as_ref()
            .is_some_and(|o| o.continuous_usage_stats.unwrap_or(false));
    let params = seq_params(state, req, prompt_tokens, faults)?;
    let rx = state.engine.submit(params)?;
    let out = Output {
        id: completion_id(),
        created: unix_now(),
        model: state.model.clone(),
        prompt_tokens,
    };
    let usage = match (include_usage, continuous_usage) {
        (false, _) => UsageMode::None,
        (true, false) => UsageMode::Final,
        (true, true) => UsageMode::Continuous,
    };
    Ok(if stream {
        stream_response(out, rx, usage)
    } else {
        collect_response(out, rx).await
    })
}

/// Faults a new request inherits: (crash after, stall after, slow first token).
type RequestFaults = (Option<u32>, Option<u32>, Option<u64>);

/// Answers 503 while loading and 500 while the HTTP-500 fault lasts.
fn take_request_faults(state: &AppState) -> Result<RequestFaults, ApiError> {
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

/// The checks vLLM makes before tokenizing.
fn validate(state: &AppState, req: &ChatRequest) -> Result<(), ApiError> {
    if let Some(model) = req.model.as_deref().filter(|m| *m != state.model) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            param: Some("model"),
            message: format!(
                "The model `{model}` does not exist. Valid aliases: {}.",
                state.model
            ),
        });
    }
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(
            "n must be 1: the simulator generates one choice.",
            Some("n"),
        ));
    }
    if req.max_completion_tokens.or(req.max_tokens) == Some(0) {
        return Err(ApiError::bad_request(
            "max_tokens must be at least 1, got 0.",
            Some("max_tokens"),
        ));
    }
    Ok(())
}

/// Prompt tokens through the chat template, off the async threads; 400 past the context.
async fn count_prompt(state: &AppState, messages: Vec<ChatMessage>) -> Result<u32, ApiError> {
    let max_model_len = state.max_model_len;
    let tokenizer = state.tokenizer.clone();
    let prompt_tokens = tokio::task::spawn_blocking(move || tokenizer.count_chat(&messages))
        .await
        .map_err(|e| ApiError::from(SimError::Tokenizer(e.to_string())))??;
    if prompt_tokens >= max_model_len {
        let shown = prompt_tokens.min(max_model_len.saturating_add(1));
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least {shown} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={shown})"
            ),
            Some("input_tokens"),
        ));
    }
    Ok(prompt_tokens)
}

/// What the engine needs to run the request.
fn seq_params(
    state: &AppState,
    req: ChatRequest,
    prompt_tokens: u32,
    (crash_after, stall_after, slow_first_token_ms): RequestFaults,
) -> Result<SeqParams, ApiError> {
    let room = state.max_model_len - prompt_tokens;
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let seed = req.seed.unwrap_or_else(|| {
        NEXT_ID
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x2545_F491_4F6C_DD1D)
    });
    // Without max_tokens a chat model ends its answer itself: draw where, from the seed.
    let eos_at = (requested.is_none() && !req.ignore_eos.unwrap_or(false))
        .then(|| natural_length(seed, state.natural_output_tokens));
    let stops = match req.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stops.len() > MAX_STOPS || stops.iter().any(|s| s.chars().count() > MAX_STOP_CHARS) {
        return Err(ApiError::bad_request(
            format!("At most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters."),
            Some("stop"),
        ));
    }
    Ok(SeqParams {
        prompt_tokens,
        max_tokens: requested.map_or(room, |m| m.min(room)),
        eos_at,
        generator: Generator::new(state.tokenizer.clone(), seed, stops),
        crash_after,
        stall_after,
        first_token_delay: slow_first_token_ms
            .map_or(std::time::Duration::ZERO, |ms| scaled(ms, state.time_scale)),
    })
}

/// An answer length drawn uniformly from [mean/2, 3·mean/2], reproducible from the seed.
fn natural_length(seed: u64, mean: u32) -> u32 {
    use rand::{Rng, SeedableRng};
    let mean = mean.max(2);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x454F_535F_5345_4544);
    rng.random_range(mean / 2..=mean.saturating_add(mean / 2))
}

/// Identity of one response, repeated in every chunk.
struct Output {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
}

/// Where usage appears in a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UsageMode {
    /// Nowhere (no `include_usage`).
    None,
    /// In a last chunk with `choices: []`.
    Final,
    /// Also on every chunk, as running totals (`continuous_usage_stats`).
    Continuous,
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

fn sse_frame(chunk: &impl serde::Serialize) -> Bytes {
    let mut buf = b"data: ".to_vec();
    if serde_json::to_writer(&mut buf, chunk).is_err() {
        buf.extend_from_slice(b"{}");
    }
    buf.extend_from_slice(b"\n\n");
    Bytes::from(buf)
}

fn finish_fields(f: &Finish) -> (&'static str, Option<&str>) {
    (f.reason.as_str(), f.stop.as_deref())
}

/// The connection is cut, as when the engine process dies under a stream.
fn cut() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "engine crashed")
}

struct StreamState {
    out: Output,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    usage: UsageMode,
    pending: VecDeque<Bytes>,
    sent_role: bool,
    finished: bool,
}

fn stream_response(
    out: Output,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    usage: UsageMode,
) -> Response {
    let st = StreamState {
        out,
        rx,
        usage,
        pending: VecDeque::new(),
        sent_role: false,
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
                }) => st.push_token(&delta, generated, finish.as_ref()),
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

impl StreamState {
    /// Queues the frames one token produces: the role chunk first, the content chunk, and
    /// after the last token the usage chunk and `[DONE]`.
    fn push_token(&mut self, delta: &str, generated: u32, finish: Option<&Finish>) {
        let head = self.out.head();
        let prompt = self.out.prompt_tokens;
        let running =
            |n| (self.usage == UsageMode::Continuous).then(|| StreamUsage::new(prompt, n));
        if !self.sent_role {
            self.sent_role = true;
            let mut role = head.role();
            role.usage = running(0);
            self.pending.push_back(sse_frame(&role));
        }
        let fields = finish.map(finish_fields);
        let fingerprint = finish.is_some() && self.usage == UsageMode::None;
        let mut chunk = head.content(delta, fields, fingerprint);
        chunk.usage = running(generated);
        self.pending.push_back(sse_frame(&chunk));
        if let Some(f) = finish {
            if self.usage != UsageMode::None {
                let usage = head.usage(f.prompt_tokens, f.completion_tokens);
                self.pending.push_back(sse_frame(&usage));
            }
            self.pending
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.finished = true;
        }
    }
}

async fn collect_response(out: Output, mut rx: mpsc::UnboundedReceiver<SeqEvent>) -> Response {
    let mut text = String::new();
    while let Some(event) = rx.recv().await {
        match event {
            SeqEvent::Token { delta, finish, .. } => {
                text.push_str(&delta);
                if let Some(f) = finish {
                    let (reason, stop) = finish_fields(&f);
                    let body = wire::completion(
                        out.head(),
                        &text,
                        reason,
                        stop,
                        f.prompt_tokens,
                        f.completion_tokens,
                    );
                    return Json(body).into_response();
                }
            }
            SeqEvent::Crashed => break,
        }
    }
    // The engine died before answering: headers go out, then the connection is cut.
    let body = futures::stream::once(async { Err::<Bytes, _>(cut()) });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let perm = format!(
        "modelperm-{:016x}",
        state.created_unix.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    );
    let root = format!("/models/{}", state.model);
    Json(wire::models(
        &state.model,
        &root,
        state.max_model_len,
        state.created_unix,
        &perm,
    ))
    .into_response()
}

/// vLLM's `/tokenize`: a chat (`messages`) or a raw `prompt`.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    return_token_strs: bool,
}

async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: TokenizeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(format!("Invalid request body: {e}"), None)
                .into_response();
        }
    };
    let tokenizer = state.tokenizer.clone();
    let result = tokio::task::spawn_blocking(move || {
        let ids = match (&req.messages, &req.prompt) {
            (Some(m), _) => tokenizer.encode(&tokenizer.render_chat(m)?)?,
            (None, Some(p)) => tokenizer.encode(p)?,
            (None, None) => {
                return Err(SimError::BadRequest(
                    "Either messages or prompt is required.".into(),
                ));
            }
        };
        let strs: Option<Vec<String>> = req.return_token_strs.then(|| {
            ids.iter()
                .map(|&i| tokenizer.token_str(i).unwrap_or_default())
                .collect()
        });
        Ok((ids, strs))
    })
    .await;
    match result {
        Ok(Ok((ids, strs))) => Json(serde_json::json!({
            "count": ids.len(),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }))
        .into_response(),
        Ok(Err(e)) => ApiError::from(e).into_response(),
        Err(e) => ApiError::from(SimError::Tokenizer(e.to_string())).into_response(),
    }
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.faults().loading() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": wire::VLLM_VERSION }))
}

async fn metrics_page(State(state): State<Arc<AppState>>) -> Response {
    let page = metrics::render(&state.engine.stats(), &state.cache_info);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        page,
    )
        .into_response()
}

async fn get_faults(State(state): State<Arc<AppState>>) -> Json<FaultSpec> {
    Json(state.faults().snapshot(state.time_scale))
}

async fn post_faults(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match serde_json::from_slice::<FaultSpec>(&body) {
        Ok(spec) => {
            apply_faults(&state, &spec);
            Json(state.faults().snapshot(state.time_scale)).into_response()
        }
        Err(e) => ApiError::bad_request(format!("Invalid fault spec: {e}"), None).into_response(),
    }
}

async fn delete_faults(State(state): State<Arc<AppState>>) -> Json<FaultSpec> {
    *state.faults() = Faults::default();
    state.disarm_exit();
    Json(FaultSpec::default())
}

/// Merges a fault spec into the state and arms the exit fault.
pub fn apply_faults(state: &Arc<AppState>, spec: &FaultSpec) {
    state.faults().merge(spec, state.time_scale);
    if let Some(ms) = spec.exit_after_ms {
        schedule_exit(state.clone(), ms);
    }
    tracing::warn!(faults = ?spec, "simulator faults set");
}

/// Fires the exit fault after `ms` engine milliseconds; a later call or `DELETE` disarms it.
pub fn schedule_exit(state: Arc<AppState>, ms: u64) {
    let delay = scaled(ms, state.time_scale);
    let armed = CancellationToken::new();
    if let Some(previous) = state
        .exit_armed
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .replace(armed.clone())
    {
        previous.cancel();
    }
    tokio::spawn(async move {
        tokio::select! {
            () = armed.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        tracing::warn!("simulator exit fault fired");
        match state.exit_mode {
            ExitMode::Process => std::process::exit(137),
            ExitMode::Embedded => {
                state.engine.crash_all();
                state.shutdown.cancel();
            }
        }
    });
}
