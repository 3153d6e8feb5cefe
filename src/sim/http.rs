//! The simulator's HTTP surface: vLLM's OpenAI routes and probes, plus `/sim/faults`.
//!
//! Handlers validate as vLLM does (unknown model 404, prompt over the context 400, both plain
//! JSON even for streams), hand the sequence to the engine, and render its events as vLLM's
//! SSE chunks or one JSON body. A dropped response drops the receiver, which aborts the
//! sequence in the engine.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::engine::EngineHandle;
use super::faults::{FaultSpec, Faults, scaled};
use super::generate;
use super::metrics::{self, CacheInfo};
use super::tokenizer::{ChatMessage, SimTokenizer};
use super::wire;
use super::{ExitMode, SimError, chat, completions, embeddings};

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
    /// The GPUs the replica stands for, exported as DCGM's gauges.
    pub gpu: super::gpu::GpuInfo,
    pub exit_mode: ExitMode,
    pub shutdown: CancellationToken,
    /// The pending exit fault, if one is armed.
    pub exit_armed: Mutex<Option<CancellationToken>>,
    /// A second, embedding-only model served on `/v1/embeddings`.
    pub embedding_model: Option<String>,
    /// `--enable-prompt-tokens-details`: usage reports cached prompt tokens.
    pub prompt_tokens_details: bool,
    /// Prompts are named by their blocks' hash chain for the engine's prefix cache, in blocks
    /// of this many tokens; `None` with prefix caching off.
    pub prefix_block_size: Option<u32>,
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

    /// The model a generation request names must be the chat model; the embedding model
    /// has no generation routes in vLLM.
    pub fn check_generation_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if self.embedding_model.as_deref() == Some(m) => {
                Err(ApiError::route_not_found())
            }
            Some(m) if m != self.model => Err(generate::not_found(m, &self.model)),
            _ => Ok(()),
        }
    }

    /// The hash chain of a prompt's full blocks, for the engine's prefix cache (none with
    /// prefix caching off).
    pub fn block_hashes(&self, ids: &[u32]) -> Vec<u64> {
        self.prefix_block_size
            .map(|size| super::engine::kv::block_hashes(ids, size))
            .unwrap_or_default()
    }

    pub fn faults(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_page))
        .route("/sim/gpu/metrics", get(gpu_metrics_page))
        .route(
            "/sim/faults",
            get(get_faults).post(post_faults).delete(delete_faults),
        )
        .with_state(state)
}

/// A vLLM-style error answer.
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            param,
            message: message.into(),
        }
    }
}

impl ApiError {
    /// FastAPI's answer to a route the served model does not have: `{"detail": "Not Found"}`.
    pub fn route_not_found() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "",
            param: None,
            message: "Not Found".into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.kind.is_empty() {
            return (
                self.status,
                Json(serde_json::json!({"detail": self.message})),
            )
                .into_response();
        }
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

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let perm = format!(
        "modelperm-{:016x}",
        state.created_unix.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    );
    let root = format!("/models/{}", state.model);
    let mut list = wire::models(
        &state.model,
        &root,
        state.max_model_len,
        state.created_unix,
        &perm,
    );
    if let Some(embed) = &state.embedding_model {
        let root = format!("/models/{embed}");
        let other = wire::models(embed, &root, state.max_model_len, state.created_unix, &perm);
        if let (Some(data), Some(more)) = (
            list.get_mut("data")
                .and_then(serde_json::Value::as_array_mut),
            other.get("data").and_then(serde_json::Value::as_array),
        ) {
            data.extend(more.iter().cloned());
        }
    }
    Json(list).into_response()
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

/// The simulated GPUs as a DCGM exporter beside the engine would show them: a separate page,
/// as the exporter is a separate scrape target on a real node ([`super::gpu`]).
async fn gpu_metrics_page(State(state): State<Arc<AppState>>) -> Response {
    let page = super::gpu::render(
        &state.engine.stats().busy,
        &state.gpu,
        // The engine's clock (tokio's, which tests may pause).
        tokio::time::Instant::now().into_std(),
    );
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
