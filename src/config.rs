//! One typed configuration: built-in defaults, then a TOML file, then `SWITCHYARD_*`
//! environment variables; validated once at boot. Every setting and its default is listed
//! in docs/configuration.md.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use switchyard_actors::generation::{StreamBound, Timeouts};
use switchyard_actors::model_queue::{QueueConfig, RoutingStrategy};
use switchyard_actors::tier::{Allowed, Policy, Tier, TierPolicy};

use crate::env_names;

/// Configuration failures, reported at boot.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        source: toml::de::Error,
    },
    /// A value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// A model the platform serves.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model version as engines serve it (`llama-3.1-8b-instruct`).
    pub name: String,
    /// Names clients may use instead; each resolves to this one version.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Microcredits per million prompt tokens.
    pub price_input_per_mtok: i64,
    /// Microcredits per million completion tokens.
    pub price_output_per_mtok: i64,
    /// Requests one node runs at once for this model (beyond it, requests wait here).
    pub node_concurrency: u32,
    /// Output ceiling reserved for a request that sets no `max_tokens`.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u32,
    /// The engine's context length (vLLM's `--max-model-len`): a prompt this long is refused
    /// before it reaches a node, and no report may bill more completion tokens than this.
    #[serde(default = "default_max_context_tokens")]
    pub max_context_tokens: u32,
    /// The model's `tokenizer.json`, to count prompts as its engine does; absent: the
    /// built-in tokenizer (the simulator's).
    #[serde(default)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// A Jinja chat template for `tokenizer`; absent: the built-in template.
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// An embedding model: served on `/v1/embeddings` only, billed by input tokens
    /// (`price_output_per_mtok` unused).
    #[serde(default)]
    pub embedding: bool,
    /// An embedding model's vector length (bge-m3: 1,024): what one answer may hold per
    /// input (past it the node broke its trust, `completion_over_bound`). Absent: 8,192,
    /// more than any served embedding model has.
    #[serde(default)]
    pub embedding_dimensions: Option<u32>,
    /// Tokens per KV block on its engines (vLLM's `--block-size`; 16 on CUDA): the gateway
    /// hashes prompts in blocks of this size to predict each node's prefix-cache hits.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// KV blocks one node's cache holds (vLLM logs it as `# GPU blocks`; `num_gpu_blocks`
    /// of `vllm:cache_config_info`): the size of the gateway's per-node prefix index.
    #[serde(default = "default_cache_blocks")]
    pub cache_blocks: u64,
}

fn default_block_size() -> u32 {
    16
}

/// An 8B model on one L40S: 22.6 GiB of KV cache at 128 KiB a token, in blocks of 16.
fn default_cache_blocks() -> u64 {
    11_571
}

fn default_max_tokens() -> u32 {
    1024
}

fn default_max_context_tokens() -> u32 {
    8192
}

/// Queue limits, per model.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueSettings {
    /// Requests waiting per model before `queue_full`.
    pub max_waiting: usize,
    /// Tokens of work (prompts and output ceilings) waiting per model before `queue_full`.
    pub max_waiting_tokens: u64,
}

impl Default for QueueSettings {
    fn default() -> Self {
        Self {
            max_waiting: 256,
            max_waiting_tokens: 2_000_000,
        }
    }
}

/// One service tier's policy.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierSettings {
    /// Its share of a saturated model against the other tiers with work waiting.
    pub weight: u32,
    /// Seconds a request may wait for a node: one predicted to start later is refused at
    /// once, one still waiting then gets `capacity_exhausted`.
    pub budget_secs: u64,
    /// The least fraction of dispatches it gets while it has work waiting (0 to 0.5).
    #[serde(default)]
    pub min_share: f64,
}

impl TierSettings {
    fn policy(&self) -> TierPolicy {
        TierPolicy {
            weight: self.weight,
            budget: Duration::from_secs(self.budget_secs),
            min_share: self.min_share,
        }
    }
}

/// Service tiers: each one's policy, and which a principal may use when its credential says
/// nothing.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceTierSettings {
    /// Weighted fair queueing between tiers and between the teams of one; `false` serves in
    /// arrival order.
    pub fair: bool,
    /// `priority`.
    pub priority: TierSettings,
    /// `default`.
    pub default: TierSettings,
    /// `flex`.
    pub flex: TierSettings,
    /// Tiers a key may use when it names none.
    pub key_tiers: Vec<Tier>,
    /// A key's tier when it names none and the request says `auto` or nothing.
    pub key_default: Tier,
    /// Tiers a JWT principal may use when its token has no `service_tiers` claim (people of
    /// the chat product: seed 001's free tier).
    pub jwt_tiers: Vec<Tier>,
    /// A JWT principal's tier when its token has no `service_tier` claim.
    pub jwt_default: Tier,
}

impl Default for ServiceTierSettings {
    fn default() -> Self {
        let policy = Policy::default();
        let settings = |t: Tier| {
            let p = policy.of(t);
            TierSettings {
                weight: p.weight,
                budget_secs: p.budget.as_secs(),
                min_share: p.min_share,
            }
        };
        Self {
            fair: policy.fair,
            priority: settings(Tier::Priority),
            default: settings(Tier::Default),
            flex: settings(Tier::Flex),
            key_tiers: vec![Tier::Default, Tier::Flex],
            key_default: Tier::Default,
            jwt_tiers: vec![Tier::Flex],
            jwt_default: Tier::Flex,
        }
    }
}

impl ServiceTierSettings {
    /// The queues' policy.
    pub fn policy(&self) -> Policy {
        Policy {
            tiers: [
                self.priority.policy(),
                self.default.policy(),
                self.flex.policy(),
            ],
            fair: self.fair,
        }
    }

    /// What a key that names no tiers may use.
    pub fn keys(&self) -> Allowed {
        Allowed::new(&self.key_tiers, self.key_default).unwrap_or_default()
    }

    /// What a JWT principal without tier claims may use.
    pub fn jwt(&self) -> Allowed {
        Allowed::new(&self.jwt_tiers, self.jwt_default).unwrap_or_default()
    }

    fn validate(&self) -> Result<(), String> {
        for (name, t) in [
            ("priority", &self.priority),
            ("default", &self.default),
            ("flex", &self.flex),
        ] {
            if t.weight == 0 || t.budget_secs == 0 || !(0.0..=0.5).contains(&t.min_share) {
                return Err(format!(
                    "service_tiers.{name}: weight and budget_secs must be > 0 and min_share between 0 and 0.5"
                ));
            }
        }
        if self.priority.min_share + self.default.min_share + self.flex.min_share > 0.9 {
            return Err("service_tiers: the minimum shares add up to more than 0.9".into());
        }
        for (kind, tiers, default) in [
            ("key", &self.key_tiers, self.key_default),
            ("jwt", &self.jwt_tiers, self.jwt_default),
        ] {
            if Allowed::new(tiers, default).is_err() {
                return Err(format!(
                    "service_tiers.{kind}_default must be one of service_tiers.{kind}_tiers"
                ));
            }
        }
        Ok(())
    }
}

/// Deadlines of a generation.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutSettings {
    /// From dispatch to first token.
    pub first_token_secs: u64,
    /// Whole request.
    pub total_secs: u64,
    /// After a client leaves, before the node is told to cancel.
    pub cancel_grace_ms: u64,
    /// Waiting for a node's final usage report after a cancel or node loss.
    pub settle_wait_secs: u64,
    /// How often the sweeper looks for reservations that outlived every deadline.
    pub sweep_interval_secs: u64,
    /// The margin past `total_secs + settle_wait_secs` after which a reservation is swept.
    pub sweep_grace_secs: u64,
    /// An attempt's lease: a node that hears nothing from the server for this long stops
    /// the attempt; after losing a node, the server waits this long before another attempt.
    pub lease_ms: u64,
}

impl Default for TimeoutSettings {
    fn default() -> Self {
        Self {
            first_token_secs: 60,
            total_secs: 600,
            cancel_grace_ms: 2000,
            settle_wait_secs: 20,
            sweep_interval_secs: 30,
            sweep_grace_secs: 60,
            lease_ms: 5000,
        }
    }
}

/// The Generations API's message policy and result retention (SPEC section 5), and the
/// bound on every stream's unread output.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationSettings {
    /// Messages per window of a JWT principal (a person); a key has none unless its
    /// `message_quota` sets one.
    pub messages_per_window: u32,
    /// Window length in hours; windows are fixed and UTC-aligned (it must divide 24).
    pub window_hours: u32,
    /// Burst bucket capacity of a JWT principal; a key has no bucket unless its
    /// `burst_capacity` sets one.
    pub burst_capacity: u32,
    /// Seconds per bucket token (a key's `burst_refill_seconds` overrides it).
    pub burst_refill_secs: u32,
    /// Hours a terminal generation's result stays readable.
    pub retention_hours: u32,
    /// Unread bytes a stream may hold before its reader counts as too slow.
    pub stream_buffer_bytes: usize,
    /// Age in ms of the oldest unread event before the reader counts as too slow.
    pub stream_buffer_age_ms: u64,
    /// Kernel send buffer of each client connection (SO_SNDBUF), so a reader that stops
    /// reading backs up into the bounded stream buffer instead of megabytes of kernel
    /// autotuned buffer; 0 leaves the kernel's autotuning.
    pub socket_send_buffer_bytes: usize,
}

impl Default for GenerationSettings {
    fn default() -> Self {
        Self {
            messages_per_window: 40,
            window_hours: 3,
            burst_capacity: 20,
            burst_refill_secs: 3,
            retention_hours: 24,
            stream_buffer_bytes: 256 * 1024,
            stream_buffer_age_ms: 10_000,
            socket_send_buffer_bytes: 64 * 1024,
        }
    }
}

/// The node control plane.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSettings {
    /// A node silent this long is dropped (two missed 5 s heartbeats plus slack).
    pub heartbeat_timeout_secs: u64,
    /// Registrations accepted per second across all nodes (reconnect storms).
    pub registrations_per_second: u32,
}

impl Default for NodeSettings {
    fn default() -> Self {
        Self {
            heartbeat_timeout_secs: 15,
            registrations_per_second: 50,
        }
    }
}

/// The public listener's limits: what a slow, silent or greedy client may hold.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenerSettings {
    /// A request's head (request line and headers) must arrive within this many seconds of
    /// the connection opening or of the previous response; otherwise the connection closes.
    pub header_timeout_secs: u64,
    /// A request's body must arrive within this many seconds of its head; otherwise 408.
    pub body_timeout_secs: u64,
    /// A kept-alive connection with no request for this many seconds is closed.
    pub idle_timeout_secs: u64,
    /// Connections one client address may hold open at once; further ones are refused at
    /// accept. `0`: no cap (behind a proxy that hides client addresses).
    pub max_connections_per_client: u32,
    /// Largest request head in bytes (request line plus headers); above it 431.
    pub max_header_bytes: usize,
    /// Longest request target (path and query) in bytes; above it 414.
    pub max_uri_bytes: usize,
    /// PEM certificate chain (leaf first) to terminate TLS with; set together with
    /// `tls_key`. Unset: plain HTTP (TLS ends at a proxy in front, if anywhere).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
}

impl Default for ListenerSettings {
    fn default() -> Self {
        Self {
            header_timeout_secs: 10,
            body_timeout_secs: 30,
            idle_timeout_secs: 75,
            max_connections_per_client: 1024,
            max_header_bytes: 32 * 1024,
            max_uri_bytes: 8 * 1024,
            tls_cert: None,
            tls_key: None,
        }
    }
}

/// What the server believes of a node (SPEC section 7, trust): the bounds on reported usage
/// and how many protocol violations a node may commit.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrustSettings {
    /// A node may report this percentage more prompt tokens than the gateway counted (the
    /// engine's template or tokenizer may differ a little) before its report is clamped.
    pub prompt_margin_percent: u32,
    /// ... and at least this many tokens more.
    pub prompt_margin_tokens: u32,
    /// Protocol violations a node may commit within `violation_window_secs` before it is
    /// disconnected.
    pub max_violations: u32,
    /// The window over which violations are counted.
    pub violation_window_secs: u64,
}

impl Default for TrustSettings {
    fn default() -> Self {
        Self {
            prompt_margin_percent: 10,
            prompt_margin_tokens: 64,
            max_violations: 10,
            violation_window_secs: 60,
        }
    }
}

/// Observability beyond logs and metrics.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySettings {
    /// OTLP/HTTP collector base URL (`http://collector:4318`); spans go to `{it}/v1/traces`.
    /// Absent: no trace export, and no OpenTelemetry work per request.
    pub otlp_endpoint: Option<String>,
}

/// What GPU time costs, for `GET /admin/reports/cost`. Report figures only: nothing here
/// touches billing, which is in microcredits.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostSettings {
    /// The month's budget for GPU time, USD; absent: no budget to report against.
    pub monthly_budget_usd: Option<f64>,
    /// USD per GPU-hour by node pool (`PUT /admin/nodes/{id}/pool`; a node without one is
    /// in `unassigned`, which may be priced too). A pool not listed costs nothing.
    pub pools: BTreeMap<String, f64>,
}

/// The most a GPU-hour may be priced at, USD (a typo's guard, far above any real price).
pub const MAX_USD_PER_GPU_HOUR: f64 = 1_000_000.0;

impl CostSettings {
    /// Checks the amounts and the pool names.
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if let Some(b) = self.monthly_budget_usd
            && !(b.is_finite() && (0.0..=1e15).contains(&b))
        {
            return invalid("costs.monthly_budget_usd must be a number from 0 to 1e15".into());
        }
        for (pool, price) in &self.pools {
            if !crate::store::valid_pool(pool) {
                return invalid(format!(
                    "costs.pools: {pool:?} is not a pool name (1 to 63 of a-z, 0-9 and -)"
                ));
            }
            if !(price.is_finite() && (0.0..=MAX_USD_PER_GPU_HOUR).contains(price)) {
                return invalid(format!(
                    "costs.pools.{pool} must be USD per GPU-hour from 0 to {MAX_USD_PER_GPU_HOUR}"
                ));
            }
        }
        Ok(())
    }

    /// Micro-USD per GPU-hour of `pool` (0 when unpriced), an integer so sums are exact.
    pub fn micro_usd_per_gpu_hour(&self, pool: &str) -> i64 {
        self.pools
            .get(pool)
            // Validated to at most 1e12 micro-USD: the cast neither saturates nor wraps.
            .map_or(0, |usd| (usd * 1e6).round() as i64)
    }

    /// The budget in micro-USD.
    pub fn monthly_budget_micro_usd(&self) -> Option<i64> {
        self.monthly_budget_usd
            .map(|usd| (usd * 1e6).round() as i64)
    }
}

/// Everything the server is told.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Database: `sqlite://…` (embedded) or `postgres://…`.
    pub database_url: String,
    /// Redis; absent means in-process coordination (one replica).
    pub redis_url: Option<String>,
    /// PEM CA file a `rediss://` Redis must be signed by (instead of the web PKI roots).
    pub redis_ca_file: Option<PathBuf>,
    /// Namespace of every Redis key and channel: the replicas of one cluster share it.
    pub redis_prefix: String,
    /// Seconds a replica's lease on a model's queue or a team's budget lasts (a queue's is
    /// renewed every third of it): when an owner dies, another replica owns what it owned
    /// within this.
    pub owner_lease_secs: u64,
    /// This replica's id; random when absent.
    pub replica_id: Option<String>,
    /// Bootstrap admin token.
    pub admin_token: Option<String>,
    /// JWKS URL for JWT callers; JWTs are refused unless this, the audience and the issuer
    /// are all set.
    pub jwks_url: Option<String>,
    /// Expected `aud` of JWTs.
    pub jwt_audience: Option<String>,
    /// Expected `iss` of JWTs.
    pub jwt_issuer: Option<String>,
    /// Concurrent generations of a JWT principal (a person, seed 001: 2).
    pub jwt_max_streams: u32,
    /// Requests per minute of a principal whose key sets none.
    pub default_rpm: u32,
    /// Tokens per UTC day of a principal whose key sets none.
    pub default_tokens_per_day: u64,
    /// Node choice.
    pub routing: RoutingStrategy,
    /// Largest request body in bytes (`request_too_large` above).
    pub max_body_bytes: usize,
    /// Queue limits.
    pub queue: QueueSettings,
    /// Service tiers: weights, budgets, minimum shares, and who may use which.
    pub service_tiers: ServiceTierSettings,
    /// Generation deadlines.
    pub timeouts: TimeoutSettings,
    /// Node control plane.
    pub nodes: NodeSettings,
    /// Generations API policy and stream bounds.
    pub generations: GenerationSettings,
    /// The public listener's timeouts and limits.
    pub listener: ListenerSettings,
    /// Bounds on what nodes may claim.
    pub trust: TrustSettings,
    /// Trace export.
    pub telemetry: TelemetrySettings,
    /// GPU prices and the monthly budget of the cost report.
    pub costs: CostSettings,
    /// The models.
    pub models: Vec<ModelConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            database_url: "sqlite://.switchyard/switchyard.db?mode=rwc".into(),
            redis_url: None,
            redis_ca_file: None,
            redis_prefix: "switchyard:".into(),
            owner_lease_secs: 6,
            replica_id: None,
            admin_token: None,
            jwks_url: None,
            jwt_audience: None,
            jwt_issuer: None,
            jwt_max_streams: 2,
            default_rpm: 10_000,
            default_tokens_per_day: 1_000_000_000,
            routing: RoutingStrategy::CacheAware,
            max_body_bytes: 1024 * 1024,
            queue: QueueSettings::default(),
            service_tiers: ServiceTierSettings::default(),
            timeouts: TimeoutSettings::default(),
            nodes: NodeSettings::default(),
            generations: GenerationSettings::default(),
            listener: ListenerSettings::default(),
            trust: TrustSettings::default(),
            telemetry: TelemetrySettings::default(),
            costs: CostSettings::default(),
            models: default_models(),
        }
    }
}

/// SPEC section 1's three models, and one embedding model for retrieval pipelines (served
/// beside the smallest chat model). Prices are in microcredits per million tokens.
pub fn default_models() -> Vec<ModelConfig> {
    // The KV cache of each on its L40S replica (docs/capacity.md), in blocks of 16.
    let model =
        |name: &str, alias: &str, input: i64, output: i64, concurrency: u32, blocks| ModelConfig {
            name: name.into(),
            aliases: vec![alias.into()],
            price_input_per_mtok: input,
            price_output_per_mtok: output,
            node_concurrency: concurrency,
            default_max_tokens: default_max_tokens(),
            max_context_tokens: default_max_context_tokens(),
            embedding: false,
            embedding_dimensions: None,
            tokenizer: None,
            chat_template: None,
            block_size: default_block_size(),
            cache_blocks: blocks,
        };
    vec![
        model(
            "llama-3.1-8b-instruct",
            "small",
            100_000,
            200_000,
            32,
            11_571,
        ),
        model(
            "qwen2.5-32b-instruct",
            "medium",
            400_000,
            800_000,
            16,
            3_635,
        ),
        model(
            "llama-3.3-70b-instruct",
            "large",
            1_200_000,
            2_400_000,
            8,
            17_346,
        ),
        ModelConfig {
            max_context_tokens: 8192,
            embedding: true,
            embedding_dimensions: Some(1024),
            ..model("bge-m3", "embed", 20_000, 0, 64, 11_571)
        },
    ]
}

impl Config {
    /// Defaults, then `file` if given, then the environment; validated.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let shown = path.display().to_string();
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: shown.clone(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: shown,
                    source,
                })?
            }
            None => Config::default(),
        };
        config.apply_env(|name| std::env::var(name).ok())?;
        config.validate()?;
        Ok(config)
    }

    /// Overrides from the environment (`get` is `std::env::var` outside tests).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let bad = |name: &str, v: &str| ConfigError::Invalid(format!("{name}={v:?} is not valid"));
        if let Some(v) = get(env_names::LISTEN) {
            self.listen = v.parse().map_err(|_| bad(env_names::LISTEN, &v))?;
        }
        if let Some(v) = get(env_names::DATABASE_URL) {
            self.database_url = v;
        }
        if let Some(v) = get(env_names::REDIS_URL) {
            self.redis_url = Some(v);
        }
        if let Some(v) = get(env_names::REDIS_CA_FILE) {
            self.redis_ca_file = Some(v.into());
        }
        if let Some(v) = get(env_names::REDIS_PREFIX) {
            self.redis_prefix = v;
        }
        if let Some(v) = get(env_names::TLS_CERT) {
            self.listener.tls_cert = Some(v.into());
        }
        if let Some(v) = get(env_names::TLS_KEY) {
            self.listener.tls_key = Some(v.into());
        }
        if let Some(v) = get(env_names::REPLICA_ID) {
            self.replica_id = Some(v);
        }
        if let Some(v) = get(env_names::ADMIN_TOKEN) {
            self.admin_token = Some(v);
        }
        if let Some(v) = get(env_names::JWKS_URL) {
            self.jwks_url = Some(v);
        }
        if let Some(v) = get(env_names::JWT_AUDIENCE) {
            self.jwt_audience = Some(v);
        }
        if let Some(v) = get(env_names::JWT_ISSUER) {
            self.jwt_issuer = Some(v);
        }
        if let Some(v) = get(env_names::ROUTING) {
            self.routing = RoutingStrategy::parse(&v).ok_or_else(|| bad(env_names::ROUTING, &v))?;
        }
        if let Some(v) = get(env_names::QUEUE_MAX_WAITING) {
            self.queue.max_waiting = v
                .parse()
                .map_err(|_| bad(env_names::QUEUE_MAX_WAITING, &v))?;
        }
        if let Some(v) = get(env_names::OTLP_ENDPOINT).filter(|v| !v.is_empty()) {
            self.telemetry.otlp_endpoint = Some(v);
        }
        if let Some(v) = get(env_names::QUEUE_DEADLINE_SECS) {
            self.service_tiers.default.budget_secs = v
                .parse()
                .map_err(|_| bad(env_names::QUEUE_DEADLINE_SECS, &v))?;
        }
        if let Some(v) = get(env_names::OWNER_LEASE_SECS) {
            self.owner_lease_secs = v
                .parse()
                .map_err(|_| bad(env_names::OWNER_LEASE_SECS, &v))?;
        }
        Ok(())
    }

    /// Checks that the configuration can run.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.models.is_empty() {
            return invalid("at least one model is required".into());
        }
        let mut names = BTreeMap::new();
        for m in &self.models {
            if m.node_concurrency == 0 {
                return invalid(format!("model {}: node_concurrency must be > 0", m.name));
            }
            if m.price_input_per_mtok < 0 || m.price_output_per_mtok < 0 {
                return invalid(format!("model {}: prices cannot be negative", m.name));
            }
            if m.max_context_tokens < 2
                || m.default_max_tokens == 0
                || m.default_max_tokens > m.max_context_tokens
            {
                return invalid(format!(
                    "model {}: max_context_tokens must be >= 2 and default_max_tokens from 1 to max_context_tokens",
                    m.name
                ));
            }
            if m.embedding_dimensions
                .is_some_and(|d| d == 0 || !m.embedding)
            {
                return invalid(format!(
                    "model {}: embedding_dimensions must be > 0, and only for an embedding model",
                    m.name
                ));
            }
            for n in std::iter::once(&m.name).chain(&m.aliases) {
                if names.insert(n.clone(), ()).is_some() {
                    return invalid(format!("model name or alias {n} is used twice"));
                }
            }
        }
        if self.timeouts.total_secs == 0 {
            return invalid("timeouts.total_secs must be > 0".into());
        }
        if let Err(e) = self.service_tiers.validate() {
            return invalid(e);
        }
        if self.owner_lease_secs == 0 || self.owner_lease_secs > 3600 {
            return invalid("owner_lease_secs must be between 1 and 3600".into());
        }
        let g = &self.generations;
        if g.window_hours == 0 || 24 % g.window_hours != 0 {
            return invalid("generations.window_hours must divide 24".into());
        }
        if g.burst_refill_secs == 0 || g.stream_buffer_bytes == 0 || self.timeouts.lease_ms == 0 {
            return invalid(
                "generations.burst_refill_secs, stream_buffer_bytes and timeouts.lease_ms must be > 0"
                    .into(),
            );
        }
        let l = &self.listener;
        if l.header_timeout_secs == 0
            || l.body_timeout_secs == 0
            || l.idle_timeout_secs == 0
            || l.max_header_bytes < 1024
            || l.max_uri_bytes < 256
        {
            return invalid(
                "listener timeouts must be > 0, max_header_bytes >= 1024 and max_uri_bytes >= 256"
                    .into(),
            );
        }
        if l.tls_cert.is_some() != l.tls_key.is_some() {
            return invalid("listener.tls_cert and listener.tls_key must be set together".into());
        }
        if self.redis_ca_file.is_some()
            && !self
                .redis_url
                .as_deref()
                .is_some_and(|u| u.starts_with("rediss://"))
        {
            return invalid("redis_ca_file needs a rediss:// redis_url".into());
        }
        if self.trust.max_violations == 0 || self.trust.violation_window_secs == 0 {
            return invalid("trust.max_violations and violation_window_secs must be > 0".into());
        }
        if self.nodes.registrations_per_second == 0 {
            return invalid("nodes.registrations_per_second must be > 0".into());
        }
        self.costs.validate()
    }

    /// Deadlines for the actors.
    pub fn generation_timeouts(&self) -> Timeouts {
        Timeouts {
            first_token: Duration::from_secs(self.timeouts.first_token_secs),
            total: Duration::from_secs(self.timeouts.total_secs),
            cancel_grace: Duration::from_millis(self.timeouts.cancel_grace_ms),
            settle_wait: Duration::from_secs(self.timeouts.settle_wait_secs),
            lease: Duration::from_millis(self.timeouts.lease_ms),
        }
    }

    /// How far behind a stream's reader may fall.
    pub fn stream_bound(&self) -> StreamBound {
        StreamBound {
            max_bytes: self.generations.stream_buffer_bytes,
            max_age: Duration::from_millis(self.generations.stream_buffer_age_ms),
        }
    }

    /// Hours a terminal result stays readable, in ms.
    pub fn retention_ms(&self) -> i64 {
        i64::from(self.generations.retention_hours) * 3_600_000
    }

    /// Queue limits of one model.
    pub fn queue_config(&self, model: &ModelConfig) -> QueueConfig {
        QueueConfig {
            max_waiting: self.queue.max_waiting,
            max_waiting_tokens: self.queue.max_waiting_tokens,
            policy: self.service_tiers.policy(),
            node_capacity: model.node_concurrency,
            routing: self.routing,
            cache_blocks: usize::try_from(model.cache_blocks).unwrap_or(usize::MAX),
        }
    }

    /// The model a client-supplied name (alias or version) resolves to.
    pub fn resolve_model(&self, name: &str) -> Option<&ModelConfig> {
        self.models
            .iter()
            .find(|m| m.name == name || m.aliases.iter().any(|a| a == name))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn defaults_are_valid_and_resolve_aliases() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(
            c.resolve_model("small").unwrap().name,
            "llama-3.1-8b-instruct"
        );
        assert_eq!(
            c.resolve_model("llama-3.3-70b-instruct").unwrap().aliases,
            ["large"]
        );
        assert!(c.resolve_model("gpt-4").is_none());
    }

    #[test]
    fn file_then_env_override() {
        let mut c: Config =
            toml::from_str("routing = \"round_robin\"\n[queue]\nmax_waiting = 3\n").unwrap();
        assert_eq!(c.routing, RoutingStrategy::RoundRobin);
        c.apply_env(|n| (n == env_names::QUEUE_MAX_WAITING).then(|| "7".to_string()))
            .unwrap();
        assert_eq!(c.queue.max_waiting, 7);
        assert!(
            c.apply_env(|n| (n == env_names::ROUTING).then(|| "random".to_string()))
                .is_err()
        );
    }

    #[test]
    fn tls_settings_come_from_file_and_env_and_pair_up() {
        let mut c: Config =
            toml::from_str("[listener]\ntls_cert = \"/etc/sy/cert.pem\"\n").unwrap();
        assert!(c.validate().is_err(), "a certificate without its key");
        c.apply_env(|n| (n == env_names::TLS_KEY).then(|| "/etc/sy/key.pem".to_string()))
            .unwrap();
        c.validate().unwrap();
        assert_eq!(c.listener.tls_key, Some(PathBuf::from("/etc/sy/key.pem")));
        c.redis_ca_file = Some("/etc/sy/redis-ca.pem".into());
        assert!(c.validate().is_err(), "a Redis CA without rediss://");
        c.redis_url = Some("rediss://redis.internal:6380".into());
        c.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_duplicate_aliases_are_refused() {
        assert!(toml::from_str::<Config>("listn = \"x\"").is_err());
        let mut c = Config::default();
        c.models[1].aliases.push("small".into());
        assert!(c.validate().is_err());
    }

    #[test]
    fn embedding_dimensions_belong_to_embedding_models() {
        let mut c = Config::default();
        assert_eq!(c.models[3].embedding_dimensions, Some(1024), "bge-m3");
        c.models[3].embedding_dimensions = Some(0);
        assert!(c.validate().is_err(), "no dimensions at all");
        c.models[3].embedding_dimensions = None;
        c.validate().unwrap();
        c.models[0].embedding_dimensions = Some(1024);
        assert!(c.validate().is_err(), "a chat model has none");
    }

    #[test]
    fn costs_are_parsed_and_checked() {
        let c: Config = toml::from_str(
            "[costs]\nmonthly_budget_usd = 25000\n[costs.pools]\ngpu-l40s = 1.85\nunassigned = 2\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.costs.micro_usd_per_gpu_hour("gpu-l40s"), 1_850_000);
        assert_eq!(c.costs.micro_usd_per_gpu_hour("unassigned"), 2_000_000);
        assert_eq!(c.costs.micro_usd_per_gpu_hour("other"), 0);
        assert_eq!(c.costs.monthly_budget_micro_usd(), Some(25_000_000_000));
        assert!(Config::default().validate().is_ok(), "no [costs] is fine");
        for bad in [
            "[costs.pools]\nGPU = 1.0\n",
            "[costs.pools]\ngpu_a = 1.0\n",
            "[costs.pools]\ngpu = -1.0\n",
            "[costs.pools]\ngpu = nan\n",
            "[costs.pools]\ngpu = 1e9\n",
            "[costs]\nmonthly_budget_usd = -5\n",
            "[costs]\nmonthly_budget_usd = inf\n",
        ] {
            let c: Config = toml::from_str(bad).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
        assert!(toml::from_str::<Config>("[costs]\nbudget = 1\n").is_err());
    }
}
