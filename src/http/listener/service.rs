//! The service hyper calls for each request of a connection: it refuses heads over our
//! limits before the router, puts the body under its deadline and turns a body that timed
//! out into 408, and keeps the request counted as in flight until its response body ends.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use tower::ServiceExt;
use tower_http::BoxError;
use tower_http::timeout::{DeadlineBody, TimeoutError};

use super::connection::{Connection, RequestGuard};
use super::refusal::{self, Reason};

/// The limits the service applies to every request.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeadLimits {
    pub(super) max_uri_bytes: usize,
    pub(super) max_header_bytes: usize,
    pub(super) body_timeout: Duration,
}

/// One connection's service.
#[derive(Debug, Clone)]
pub(super) struct ConnService {
    pub(super) app: Router,
    pub(super) conn: Arc<Connection>,
    pub(super) limits: HeadLimits,
    pub(super) peer: SocketAddr,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Tracked>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let guard = self.conn.request_started();
        if let Some((reason, refusal)) = check_head(&req, &self.limits) {
            reason.record(self.peer);
            let response = refusal.into_response();
            return Box::pin(async move { Ok(Tracked::new(response, guard)) });
        }
        let timed_out = Arc::new(AtomicBool::new(false));
        let req = req.map(|body| with_deadline(body, self.limits.body_timeout, &timed_out));
        let (app, conn, peer) = (self.app.clone(), self.conn.clone(), self.peer);
        let body_timeout_secs = self.limits.body_timeout.as_secs();
        Box::pin(async move {
            let response = match app.oneshot(req).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            // Whatever the handler made of the failed body (the JSON extractor says 400), the
            // client's fault is that its body never came: 408, and the rest of that body will
            // not be read, so the connection cannot carry another request.
            let response = if timed_out.load(Ordering::Relaxed) {
                Reason::BodyTimeout.record(peer);
                let mut response = refusal::body_timeout(body_timeout_secs).into_response();
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            } else {
                response
            };
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                conn.upgraded();
            }
            Ok(Tracked::new(response, guard))
        })
    }
}

/// The request body under its deadline, counted from the head; a body already complete with
/// its head (none, or `Content-Length: 0`) needs no timer.
fn with_deadline(body: Incoming, timeout: Duration, timed_out: &Arc<AtomicBool>) -> Body {
    if body.is_end_stream() {
        return Body::new(body);
    }
    let timed_out = timed_out.clone();
    // `DeadlineBody` counts the whole transfer, not the gaps between frames: a body trickled
    // a byte at a time does not escape it.
    Body::new(
        DeadlineBody::new(timeout, body).map_err(move |e: BoxError| {
            if e.is::<TimeoutError>() {
                timed_out.store(true, Ordering::Relaxed);
            }
            e
        }),
    )
}

/// Our limits on the head, checked before any handler so the refusal carries the envelope
/// (hyper's own limits are set above these).
fn check_head<B>(
    req: &Request<B>,
    limits: &HeadLimits,
) -> Option<(Reason, crate::http::error::ApiError)> {
    let uri = uri_len(req.uri());
    if uri > limits.max_uri_bytes {
        return Some((
            Reason::UriTooLong,
            refusal::uri_too_long(limits.max_uri_bytes),
        ));
    }
    if head_len(req, uri) > limits.max_header_bytes {
        return Some((
            Reason::HeadTooLarge,
            refusal::head_too_large(limits.max_header_bytes),
        ));
    }
    None
}

/// The request target's length as sent (origin form, or absolute form with its authority).
fn uri_len(uri: &axum::http::Uri) -> usize {
    let scheme = uri.scheme_str().map_or(0, |s| s.len() + 3);
    let authority = uri.authority().map_or(0, |a| a.as_str().len());
    let path = uri.path_and_query().map_or(0, |p| p.as_str().len());
    scheme + authority + path
}

/// The head's length on the wire: `METHOD SP target SP HTTP/1.1 CRLF`, each header as
/// `name: value CRLF`, and the closing CRLF.
fn head_len<B>(req: &Request<B>, uri: usize) -> usize {
    let line = req.method().as_str().len() + 1 + uri + 1 + "HTTP/1.1".len() + 2;
    let headers: usize = req
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + 2 + value.len() + 2)
        .sum();
    line + headers + 2
}

/// A response body that holds its request's [`RequestGuard`]: hyper drops the body when it
/// has taken the last frame, which is when the connection stops serving that request.
#[derive(Debug)]
pub(super) struct Tracked {
    body: Body,
    _guard: RequestGuard,
}

impl Tracked {
    fn new(response: axum::response::Response, guard: RequestGuard) -> Response<Self> {
        response.map(|body| Self {
            body,
            _guard: guard,
        })
    }
}

impl HttpBody for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn limits() -> HeadLimits {
        HeadLimits {
            max_uri_bytes: 256,
            max_header_bytes: 1024,
            body_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_head_is_measured_as_sent() {
        let req = Request::get("/healthz")
            .header("host", "x")
            .body(())
            .unwrap();
        let wire = "GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n";
        assert_eq!(head_len(&req, uri_len(req.uri())), wire.len());
        assert!(check_head(&req, &limits()).is_none());
    }

    #[test]
    fn a_long_target_is_414_and_a_large_head_431() {
        let long = format!("/v1/models?q={}", "a".repeat(300));
        let req = Request::get(long).body(()).unwrap();
        let (reason, error) = check_head(&req, &limits()).unwrap();
        assert_eq!(reason, Reason::UriTooLong);
        assert_eq!(error.status, Some(StatusCode::URI_TOO_LONG));

        let req = Request::get("/")
            .header("x-big", "b".repeat(1100))
            .body(())
            .unwrap();
        let (reason, error) = check_head(&req, &limits()).unwrap();
        assert_eq!(reason, Reason::HeadTooLarge);
        assert_eq!(
            error.status,
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
    }
}
