//! The one layer every request goes through first: it fixes the request's [`RequestId`] and
//! [`TraceContext`], opens the request's span, stamps `x-request-id` (and, on `/v1/*`,
//! `openai-processing-ms`) on the response, and writes one access-log line (target
//! [`TARGET`]) when the response body ends or the client drops it. The line names the route
//! template, never the raw path; the principal as the auth layer resolved it
//! ([`record_principal`]), never a credential.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use super::request_id::{self, RequestId};

/// The access log's target, for filtering (`RUST_LOG=switchyard::access=off`).
pub const TARGET: &str = "switchyard::access";
/// Longest principal name logged, in characters (a JWT `sub` is the caller's text).
const MAX_PRINCIPAL_CHARS: usize = 128;

/// Who the request's credential named, filled by the auth layer while the handler runs.
type PrincipalSlot = Arc<Mutex<Option<String>>>;

tokio::task_local! {
    static PRINCIPAL: PrincipalSlot;
}

/// Records who is calling, for the access log: `key:{id}` for an API key, `user:{sub}` for a
/// JWT, `admin` for the bootstrap admin token, `node:{id}` for a node. Does nothing outside a
/// request.
pub fn record_principal(principal: &str) {
    let _ = PRINCIPAL.try_with(|slot| {
        let name: String = principal
            .chars()
            .take(MAX_PRINCIPAL_CHARS)
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(name);
    });
}

/// The middleware (`axum::middleware::from_fn(access_log::layer)`), applied with
/// `Router::layer` so it sees the matched route template, and the fallbacks too.
pub async fn layer(mut req: Request, next: Next) -> Response {
    let start = Instant::now();
    let id = RequestId::from_headers(req.headers());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "-".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let openai = req.uri().path().starts_with("/v1/");
    let span = tracing::info_span!(
        "request",
        otel.name = %format_args!("{method} {route}"),
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        request_id = %id,
        principal = tracing::field::Empty,
    );
    let trace = crate::telemetry::continue_trace(&span, req.headers());
    // As an intermediary does (W3C Trace Context): what the handlers pass downstream is the
    // gateway's own position in the trace, or nothing when the caller's was not usable.
    match trace
        .traceparent()
        .and_then(|t| HeaderValue::from_str(t).ok())
    {
        Some(v) => {
            req.headers_mut().insert(request_id::TRACEPARENT, v);
        }
        None => {
            req.headers_mut().remove(request_id::TRACEPARENT);
        }
    }
    req.extensions_mut().insert(id.clone());
    req.extensions_mut().insert(trace);
    let slot = PrincipalSlot::default();
    let handled = request_id::scope(id.clone(), PRINCIPAL.scope(slot.clone(), next.run(req)));
    let mut response = handled.instrument(span.clone()).await;
    let headers = response.headers_mut();
    headers.insert(request_id::HEADER, id.header_value());
    if openai {
        let ms = start.elapsed().as_millis();
        if let Ok(v) = HeaderValue::from_str(&ms.to_string()) {
            headers.insert("openai-processing-ms", v);
        }
    }
    let status = response.status().as_u16();
    span.record("http.response.status_code", status);
    let line = Line {
        start,
        method,
        route,
        status,
        id,
        principal: slot,
        span,
    };
    response.map(|inner| {
        Body::new(Logged {
            inner,
            bytes: 0,
            line: Some(line),
        })
    })
}

/// What the access line says, waiting for the body to end.
struct Line {
    start: Instant,
    method: Method,
    route: String,
    status: u16,
    id: RequestId,
    principal: PrincipalSlot,
    /// Kept open until the body ends, so the exported span covers a stream's whole life.
    span: tracing::Span,
}

impl Line {
    fn write(self, outcome: &'static str, bytes: u64) {
        let principal = self
            .principal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let principal = principal.as_deref().unwrap_or("-");
        self.span.record("principal", principal);
        let duration_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        tracing::info!(
            target: TARGET,
            parent: &self.span,
            method = %self.method,
            route = %self.route,
            status = self.status,
            duration_ms,
            request_id = %self.id,
            principal,
            bytes,
            outcome,
            "access"
        );
    }
}

/// The response body, counted; the access line is written when it ends (`complete`), fails
/// (`error`), or is dropped unfinished because the client left (`aborted`).
struct Logged {
    inner: Body,
    bytes: u64,
    line: Option<Line>,
}

impl Logged {
    fn finish(&mut self, outcome: &'static str) {
        if let Some(line) = self.line.take() {
            line.write(outcome, self.bytes);
        }
    }
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        // Errors rendered while the body streams (SSE error events) name the request too.
        let polled = match &this.line {
            Some(line) => {
                request_id::sync_scope(&line.id, || Pin::new(&mut this.inner).poll_frame(cx))
            }
            None => Pin::new(&mut this.inner).poll_frame(cx),
        };
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.bytes += data.len() as u64;
                }
                if this.inner.is_end_stream() {
                    this.finish("complete");
                }
            }
            Poll::Ready(Some(Err(_))) => this.finish("error"),
            Poll::Ready(None) => this.finish("complete"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let outcome = if self.inner.is_end_stream() {
            "complete"
        } else {
            "aborted"
        };
        self.finish(outcome);
    }
}
