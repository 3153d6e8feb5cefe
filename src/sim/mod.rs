//! `switchyard sim`: a stand-in for a GPU node running vLLM, faithful on the wire and in time.
//!
//! [`SimServer`] serves vLLM's OpenAI API, `/metrics`, `/health`, `/version` and `/tokenize`
//! on one port, backed by a continuous-batching [`engine`] whose timing and KV capacity come
//! from a [`Profile`]. Faults for drills are set by flag or through `/sim/faults`.

mod chat;
mod completions;
mod embeddings;
pub mod engine;
mod faults;
mod generate;
mod gpu;
mod http;
mod logprobs;
mod metrics;
mod profile;
mod schema;
mod tokenizer;
mod tools;
mod wire;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use engine::EngineConfig;
pub use faults::FaultSpec;
pub use metrics::EngineStats;
pub use profile::{Profile, ProfileArg, ProfileSpec, Timing};
pub use tokenizer::{ChatMessage, Generator, SimTokenizer};

/// Tokens per KV block, as vLLM's default on GPUs.
pub const BLOCK_SIZE: u32 = 16;
/// The largest `--block-size` taken.
const MAX_BLOCK_SIZE: u32 = 1024;
/// Bounds that keep every duration and token count of the engine far from overflow.
const MIN_TIME_SCALE: f64 = 0.001;
const MAX_TIME_SCALE: f64 = 10_000.0;
const MAX_MODEL_LEN: u32 = 1 << 24;
const MAX_BLOCKS: u64 = 1 << 32;
const MAX_FIXED_DELAY: std::time::Duration = std::time::Duration::from_secs(3600);

/// Failures of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The request is malformed or impossible.
    #[error("{0}")]
    BadRequest(String),
    /// The embedded tokenizer or template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The engine loop is gone.
    #[error("engine stopped")]
    EngineStopped,
    /// The configuration cannot describe a working engine.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Binding or serving failed.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// What happens when the exit fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExitMode {
    /// Exit the whole process with status 137, like a killed pod (the `sim` command).
    Process,
    /// Cut every stream and stop listening, leaving the process alive (embedded sims).
    #[default]
    Embedded,
}

/// Everything `switchyard sim` can be told.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Model name served, exactly as the server knows it.
    pub model: String,
    /// Model size and hardware.
    pub profile: Profile,
    /// Modeled by the profile (batching, KV cache) or fixed (`--profile fixed`); with fixed
    /// timing the profile only sizes the nominal KV cache and the default context limit.
    pub timing: Timing,
    /// Every delay is divided by this (tests run at 10–100).
    pub time_scale: f64,
    /// `--max-num-seqs`: most sequences in a batch.
    pub max_num_seqs: usize,
    /// `--max-model-len`; the profile's default when absent.
    pub max_model_len: Option<u32>,
    /// `--max-num-batched-tokens`: per-step token budget (chunked prefill).
    pub max_num_batched_tokens: u32,
    /// `--gpu-memory-utilization`.
    pub gpu_memory_utilization: f64,
    /// `--num-gpu-blocks-override`: a KV cache of exactly this many blocks.
    pub num_gpu_blocks_override: Option<u64>,
    /// Mean answer length, in tokens, of requests that set no `max_tokens`: the simulated
    /// model ends them at an end-of-sequence token drawn from the seed.
    pub natural_output_tokens: u32,
    /// Faults in force from the start.
    pub faults: FaultSpec,
    /// What the exit fault does.
    pub exit_mode: ExitMode,
    /// Also serve this embedding model on `/v1/embeddings` (`--embedding-model`).
    pub embedding_model: Option<String>,
    /// Report `prompt_tokens_details.cached_tokens` from a prefix-cache model, as vLLM does
    /// with `--enable-prompt-tokens-details`.
    pub enable_prompt_tokens_details: bool,
    /// Reuse cached prefix blocks across requests (vLLM's default; off with
    /// `--no-enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// `--block-size`: tokens per KV block (16 on GPUs; vLLM's CPU backend takes multiples
    /// of 32, and its captures use 128 and 32).
    pub block_size: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "llama-3.1-8b-instruct".into(),
            profile: Profile::B8,
            timing: Timing::Modeled,
            time_scale: 1.0,
            max_num_seqs: 256,
            max_model_len: None,
            max_num_batched_tokens: 2048,
            gpu_memory_utilization: 0.9,
            num_gpu_blocks_override: None,
            natural_output_tokens: 256,
            faults: FaultSpec::default(),
            exit_mode: ExitMode::Embedded,
            embedding_model: None,
            enable_prompt_tokens_details: false,
            enable_prefix_caching: true,
            block_size: BLOCK_SIZE,
        }
    }
}

impl SimConfig {
    /// The engine parameters this configuration implies, validated.
    pub fn engine_config(&self) -> Result<EngineConfig, SimError> {
        let spec = self.profile.spec();
        if !(self.time_scale.is_finite()
            && (MIN_TIME_SCALE..=MAX_TIME_SCALE).contains(&self.time_scale))
        {
            return Err(SimError::Config(format!(
                "--time-scale must be between {MIN_TIME_SCALE} and {MAX_TIME_SCALE}"
            )));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(SimError::Config(
                "--gpu-memory-utilization must be in (0, 1]".into(),
            ));
        }
        if self.max_num_seqs == 0 || (self.max_num_batched_tokens as usize) < self.max_num_seqs {
            return Err(SimError::Config(
                "--max-num-batched-tokens must be at least --max-num-seqs (and both > 0)".into(),
            ));
        }
        let max_model_len = self.max_model_len.unwrap_or(spec.max_model_len);
        if !(2..=MAX_MODEL_LEN).contains(&max_model_len) {
            return Err(SimError::Config(format!(
                "--max-model-len must be between 2 and {MAX_MODEL_LEN}"
            )));
        }
        let num_blocks = self
            .num_gpu_blocks_override
            .unwrap_or_else(|| spec.num_gpu_blocks(self.gpu_memory_utilization, self.block_size));
        if num_blocks > MAX_BLOCKS {
            return Err(SimError::Config(format!("at most {MAX_BLOCKS} KV blocks")));
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(SimError::Config(format!(
                "--block-size must be between 1 and {MAX_BLOCK_SIZE}"
            )));
        }
        // vLLM keeps one block aside (its null block): the rest hold tokens.
        let kv_tokens = num_blocks.saturating_sub(1) * u64::from(self.block_size);
        if kv_tokens < u64::from(max_model_len) {
            return Err(SimError::Config(format!(
                "max_model_len {max_model_len} is larger than the KV cache ({kv_tokens} tokens)"
            )));
        }
        if let Timing::Fixed { ttft, itl } = self.timing
            && (ttft > MAX_FIXED_DELAY || itl > MAX_FIXED_DELAY)
        {
            return Err(SimError::Config(
                "--ttft-ms and --itl-ms must be at most one hour".into(),
            ));
        }
        Ok(EngineConfig {
            spec,
            timing: self.timing,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            num_blocks,
            block_size: self.block_size,
            prefix_caching: self.enable_prefix_caching,
            max_model_len,
            time_scale: self.time_scale,
        })
    }
}

/// A running simulator.
#[derive(Debug)]
pub struct SimServer {
    addr: SocketAddr,
    state: Arc<http::AppState>,
    server: tokio::task::JoinHandle<()>,
    engine_task: tokio::task::JoinHandle<()>,
}

impl SimServer {
    /// Starts a simulator on a free loopback port.
    pub async fn start(config: SimConfig) -> Result<Self, SimError> {
        Self::bind(config, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts a simulator on `addr`.
    pub async fn bind(config: SimConfig, addr: SocketAddr) -> Result<Self, SimError> {
        let listener = TcpListener::bind(addr).await?;
        Self::serve(config, listener)
    }

    /// Starts a simulator on an already bound listener.
    pub fn serve(config: SimConfig, listener: TcpListener) -> Result<Self, SimError> {
        let engine_cfg = config.engine_config()?;
        let tokenizer = SimTokenizer::load()?;
        let addr = listener.local_addr()?;
        let started_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let cache_info = metrics::CacheInfo {
            model: config.model.clone(),
            block_size: engine_cfg.block_size,
            num_gpu_blocks: engine_cfg.num_blocks,
            gpu_memory_utilization: config.gpu_memory_utilization,
            max_model_len: engine_cfg.max_model_len,
            kv_cache_memory_bytes: engine_cfg.num_blocks
                * u64::from(engine_cfg.block_size)
                * engine_cfg.spec.kv_bytes_per_token(),
            started_unix,
        };
        let mut faults = faults::Faults::default();
        faults.merge(&config.faults, config.time_scale);
        let (engine, engine_task) = engine::EngineHandle::spawn(engine_cfg.clone());
        let shutdown = CancellationToken::new();
        let state = Arc::new(http::AppState {
            model: config.model.clone(),
            natural_output_tokens: config.natural_output_tokens,
            exit_armed: Mutex::new(None),
            max_model_len: engine_cfg.max_model_len,
            time_scale: config.time_scale,
            created_unix: started_unix as u64,
            tokenizer,
            engine,
            faults: Mutex::new(faults),
            cache_info,
            gpu: gpu::GpuInfo {
                gpus: engine_cfg.spec.gpus,
                memory_mib: engine_cfg.spec.gpu_memory_gib * 1024.0,
                utilization: config.gpu_memory_utilization,
                serial: (started_unix * 1e3) as u64,
                hostname: gpu::GpuInfo::hostname(),
            },
            exit_mode: config.exit_mode,
            shutdown: shutdown.clone(),
            embedding_model: config.embedding_model.clone(),
            prompt_tokens_details: config.enable_prompt_tokens_details,
            prefix_block_size: config
                .enable_prefix_caching
                .then_some(engine_cfg.block_size),
        });
        if let Some(ms) = config.faults.exit_after_ms {
            http::schedule_exit(state.clone(), ms);
        }
        let app = http::router(state.clone());
        let server = tokio::spawn(async move {
            // Like uvicorn, send each SSE event as soon as it is written: without TCP_NODELAY,
            // Nagle's algorithm holds chunks on a kept-alive connection until the peer's ACK.
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!(error = %e, "could not set TCP_NODELAY");
                }
            });
            let serve =
                axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned());
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "simulator server failed");
            }
        });
        match config.timing {
            Timing::Modeled => {
                tracing::info!(%addr, model = %config.model, profile = %config.profile, "simulator listening");
            }
            Timing::Fixed { ttft, itl } => {
                tracing::info!(%addr, model = %config.model, profile = "fixed", ?ttft, ?itl, "simulator listening");
            }
        }
        Ok(Self {
            addr,
            state,
            server,
            engine_task,
        })
    }

    /// Socket address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` (append `/v1` for an OpenAI base URL).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The engine's statistics right now (what `/metrics` shows).
    pub fn stats(&self) -> EngineStats {
        self.state.engine.stats()
    }

    /// Sets faults as `POST /sim/faults` does.
    pub fn set_faults(&self, spec: &FaultSpec) {
        http::apply_faults(&self.state, spec);
    }

    /// Resolves when the simulator stopped serving (the exit fault, or [`SimServer::shutdown`]).
    pub async fn stopped(&self) {
        self.state.shutdown.cancelled().await;
    }

    /// Cuts every stream and stops the server and the engine.
    pub async fn shutdown(self) {
        self.state.engine.crash_all();
        self.state.shutdown.cancel();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.server).await;
        self.engine_task.abort();
    }
}
