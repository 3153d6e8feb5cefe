//! Log filtering. Whatever level an operator asks for, the libraries that log raw frames,
//! bodies or headers at debug and trace (WebSocket frames carry prompts; HTTP internals can
//! carry credentials) are held at `info`, so logs never contain prompts, outputs, keys or
//! tokens.

use tracing_subscriber::EnvFilter;

/// Libraries whose debug output includes payloads.
const PAYLOAD_LOGGERS: &[&str] = &[
    "tungstenite",
    "tokio_tungstenite",
    "hyper",
    "hyper_util",
    "h2",
    "reqwest",
    "sqlx",
];

/// The filter for `spec` (`RUST_LOG` syntax; `info` when empty or invalid), with the
/// payload-logging libraries capped at `info`.
pub fn filter(spec: &str) -> EnvFilter {
    let spec = if spec.trim().is_empty() { "info" } else { spec };
    let mut filter = EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("info"));
    for target in PAYLOAD_LOGGERS {
        if let Ok(directive) = format!("{target}=info").parse() {
            filter = filter.add_directive(directive);
        }
    }
    filter
}
