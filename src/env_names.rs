//! Every environment variable Switchyard reads, in one place (docs/configuration.md).

/// Address the server listens on.
pub const LISTEN: &str = "SWITCHYARD_LISTEN";
/// `postgres://…` or `sqlite://…`.
pub const DATABASE_URL: &str = "DATABASE_URL";
/// Redis for cluster coordination; absent means in-process (single replica).
pub const REDIS_URL: &str = "REDIS_URL";
/// Bootstrap admin token.
pub const ADMIN_TOKEN: &str = "SWITCHYARD_ADMIN_TOKEN";
/// JWKS URL for JWT verification.
pub const JWKS_URL: &str = "SWITCHYARD_JWKS_URL";
/// Expected JWT audience.
pub const JWT_AUDIENCE: &str = "SWITCHYARD_JWT_AUDIENCE";
/// Expected JWT issuer.
pub const JWT_ISSUER: &str = "SWITCHYARD_JWT_ISSUER";
/// This replica's id (default: random per process).
pub const REPLICA_ID: &str = "SWITCHYARD_REPLICA_ID";
/// `least_loaded` or `round_robin`.
pub const ROUTING: &str = "SWITCHYARD_ROUTING";
/// Most requests waiting per model.
pub const QUEUE_MAX_WAITING: &str = "SWITCHYARD_QUEUE_MAX_WAITING";
/// Seconds a request may wait for a node.
pub const QUEUE_DEADLINE_SECS: &str = "SWITCHYARD_QUEUE_DEADLINE_SECS";
/// Overrides `owner_lease_secs`.
pub const OWNER_LEASE_SECS: &str = "SWITCHYARD_OWNER_LEASE_SECS";
/// OTLP/HTTP collector base URL for trace export (OpenTelemetry's standard variable).
pub const OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// `json` for JSON logs.
pub const LOG_FORMAT: &str = "SWITCHYARD_LOG_FORMAT";
/// PEM certificate chain the listener serves TLS with (`listener.tls_cert`).
pub const TLS_CERT: &str = "SWITCHYARD_TLS_CERT";
/// PEM private key of that certificate (`listener.tls_key`).
pub const TLS_KEY: &str = "SWITCHYARD_TLS_KEY";
/// Namespace of every Redis key and channel (`redis_prefix`).
pub const REDIS_PREFIX: &str = "SWITCHYARD_REDIS_PREFIX";
/// PEM CA file a `rediss://` Redis is verified with, instead of the web PKI roots.
pub const REDIS_CA_FILE: &str = "SWITCHYARD_REDIS_CA_FILE";
/// `switchyard node --ca-file`: extra CAs the agent trusts for a `wss://` server.
pub const NODE_CA_FILE: &str = "SWITCHYARD_NODE_CA_FILE";
/// `switchyard node --token`: the node's token.
pub const NODE_TOKEN: &str = "SWITCHYARD_NODE_TOKEN";
/// `switchyard node --token-file`: the file the node's token is read from.
pub const NODE_TOKEN_FILE: &str = "SWITCHYARD_NODE_TOKEN_FILE";
/// `switchyard node --gpus`: GPUs the node registers.
pub const NODE_GPUS: &str = "SWITCHYARD_NODE_GPUS";
/// `switchyard node --engine-priority`: the engine schedules by vLLM's `priority`.
pub const ENGINE_PRIORITY: &str = "SWITCHYARD_ENGINE_PRIORITY";
