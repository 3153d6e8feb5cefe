//! Log filtering and optional trace export. Whatever level an operator asks for, the
//! libraries that log raw frames, bodies or headers at debug and trace (WebSocket frames carry
//! prompts; HTTP internals can carry credentials) are held at `info`, so logs never contain
//! prompts, outputs, keys or tokens. When an OTLP endpoint is configured, spans are exported
//! over OTLP/HTTP and a caller's `traceparent` is continued; otherwise nothing of
//! OpenTelemetry runs.

use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Layer};

use crate::http::request_id::{TRACEPARENT, TraceContext};

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

/// Whether spans are exported (set once, by [`otlp_layer`]); when not, the request layer does
/// no OpenTelemetry work at all.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Why the OTLP exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("OTLP trace exporter: {0}")]
pub struct TelemetryError(String);

/// The running exporter; [`Otel::shutdown`] (or dropping it) flushes the spans still queued.
#[derive(Debug)]
pub struct Otel {
    provider: SdkTracerProvider,
}

impl Otel {
    /// Exports what is queued now (blocking: call it off the async workers).
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "could not flush the trace exporter");
        }
    }

    /// Flushes and stops the exporter (blocking).
    pub fn shutdown(&self) {
        EXPORTING.store(false, Ordering::Relaxed);
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "could not shut the trace exporter down");
        }
    }
}

/// The endpoint's traces URL: `{base}/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` means it.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

/// A tracing layer that exports spans over OTLP/HTTP (protobuf) to `endpoint`, a base URL
/// such as `http://collector:4318`, in batches from a background thread. Incoming
/// `traceparent` headers are continued from then on (see [`continue_trace`]).
pub fn otlp_layer<S>(endpoint: &str) -> Result<(impl Layer<S>, Otel), TelemetryError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(traces_url(endpoint))
        .build()
        .map_err(|e| TelemetryError(e.to_string()))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("switchyard")
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("switchyard"));
    EXPORTING.store(true, Ordering::Relaxed);
    Ok((layer, Otel { provider }))
}

/// Reads `traceparent` (and `tracestate`) from a request's headers.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Makes `span` continue the caller's W3C trace (its `traceparent`) when spans are exported,
/// and returns the trace context to send downstream: `span`'s own when exporting, otherwise
/// the caller's well-formed `traceparent` as it came.
pub fn continue_trace(span: &tracing::Span, headers: &HeaderMap) -> TraceContext {
    if !EXPORTING.load(Ordering::Relaxed) {
        return TraceContext::from_headers(headers);
    }
    let propagator = TraceContextPropagator::new();
    let parent = propagator.extract(&Headers(headers));
    // Refused only for a span that is disabled (filtered out): nothing to continue then.
    let _ = span.set_parent(parent);
    let mut carrier = std::collections::HashMap::new();
    propagator.inject_context(&span.context(), &mut carrier);
    carrier
        .get(TRACEPARENT)
        .map(|v| TraceContext::from_traceparent(v))
        .unwrap_or_default()
}
