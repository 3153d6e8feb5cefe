//! The request's identity, fixed once at the edge of the router (`access_log::layer`): its
//! [`RequestId`] (`x-request-id`: the client's when bounded and printable, otherwise minted)
//! and its W3C [`TraceContext`]. Both sit in the request's extensions; a handler takes them as
//! `Extension<RequestId>` / `Extension<TraceContext>`. The id is also in scope (a task-local)
//! while the handler runs and while its body is polled, so every error envelope carries it.

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue};

/// The header that carries the request id, both ways.
pub const HEADER: &str = "x-request-id";
/// Longest client-sent request id kept, in bytes.
pub const MAX_LEN: usize = 128;
/// The W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

/// The id of one HTTP request: the client's `x-request-id` when it is one header of 1 to
/// [`MAX_LEN`] visible ASCII characters (`!` to `~`), otherwise `req_` and 24 random hex
/// digits. It names the request in the response header, the error envelope, the access log
/// and the spans. It is not a resource id: completions and generations keep their own ids.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// The id as text (visible ASCII, at most [`MAX_LEN`] bytes).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The client's id from `headers` when it qualifies, otherwise a fresh one.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let mut values = headers.get_all(HEADER).iter();
        match (values.next(), values.next()) {
            (Some(v), None) => Self::from_client(v).unwrap_or_else(Self::mint),
            // None, or several copies (which one a proxy kept is unknowable): ours.
            _ => Self::mint(),
        }
    }

    /// `value` when it is a usable id: 1 to [`MAX_LEN`] bytes, all visible ASCII.
    pub fn from_client(value: &HeaderValue) -> Option<Self> {
        let bytes = value.as_bytes();
        let ok =
            !bytes.is_empty() && bytes.len() <= MAX_LEN && bytes.iter().all(u8::is_ascii_graphic);
        ok.then(|| std::str::from_utf8(bytes).ok().map(|s| Self(s.into())))
            .flatten()
    }

    /// `req_` and 24 random hex digits.
    pub fn mint() -> Self {
        Self(format!("req_{:024x}", rand::random::<u128>() >> 32).into())
    }

    /// The id as a header value.
    pub fn header_value(&self) -> HeaderValue {
        // Visible ASCII by construction, so this never falls back.
        HeaderValue::from_str(&self.0).unwrap_or_else(|_| HeaderValue::from_static("-"))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The W3C `traceparent` of the request, to forward to the node agent and the engine. With
/// OpenTelemetry export on, it names this request's own span (in the caller's trace when the
/// caller sent one); with it off, it is the caller's `traceparent` when well-formed, so the
/// trace still continues downstream; `None` otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceContext(Option<Arc<str>>);

impl TraceContext {
    /// A context from a `traceparent` value, kept only when well-formed.
    pub fn from_traceparent(value: &str) -> Self {
        Self(is_traceparent(value).then(|| value.into()))
    }

    /// The caller's well-formed `traceparent`, when it sent exactly one.
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let mut values = headers.get_all(TRACEPARENT).iter();
        match (values.next().and_then(|v| v.to_str().ok()), values.next()) {
            (Some(v), None) => Self::from_traceparent(v),
            _ => Self::default(),
        }
    }

    /// The `traceparent` value to send downstream, if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// `00-{32 hex}-{16 hex}-{2 hex}` in lower case, ids not all zero (W3C Trace Context §3.2).
pub fn is_traceparent(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    matches!(parts.as_slice(), [version, trace, span, flags]
        if hex(version, 2) && *version != "ff"
            && hex(trace, 32) && nonzero(trace)
            && hex(span, 16) && nonzero(span)
            && hex(flags, 2))
}

tokio::task_local! {
    static CURRENT: RequestId;
}

/// The id of the request being served on this task, if any (`None` outside a request, and in
/// tasks a handler spawns).
pub fn current() -> Option<RequestId> {
    CURRENT.try_with(Clone::clone).ok()
}

/// Runs `fut` with `id` as [`current`].
pub(crate) async fn scope<F: Future>(id: RequestId, fut: F) -> F::Output {
    CURRENT.scope(id, fut).await
}

/// Runs `f` with `id` as [`current`] (for a response body's polls).
pub(crate) fn sync_scope<R>(id: &RequestId, f: impl FnOnce() -> R) -> R {
    CURRENT.sync_scope(id.clone(), f)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn headers(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    #[test]
    fn a_bounded_printable_id_is_kept_anything_else_replaced() {
        let kept = RequestId::from_headers(&headers(&[(HEADER, b"abc-123_XYZ:/.~")]));
        assert_eq!(kept.as_str(), "abc-123_XYZ:/.~");
        let max = "a".repeat(MAX_LEN);
        assert_eq!(
            RequestId::from_headers(&headers(&[(HEADER, max.as_bytes())])).as_str(),
            max
        );
        let too_long = "a".repeat(MAX_LEN + 1);
        for bad in [
            too_long.as_bytes(),
            b"has space",
            b"tab\there",
            b"",
            b"caf\xc3\xa9",
        ] {
            let id = RequestId::from_headers(&headers(&[(HEADER, bad)]));
            assert!(id.as_str().starts_with("req_"), "{bad:?} → {id}");
            assert_eq!(id.as_str().len(), 28);
        }
        let two = RequestId::from_headers(&headers(&[(HEADER, b"a"), (HEADER, b"b")]));
        assert!(two.as_str().starts_with("req_"));
        assert_ne!(RequestId::mint(), RequestId::mint());
    }

    #[test]
    fn traceparent_must_be_well_formed() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            TraceContext::from_traceparent(good).traceparent(),
            Some(good)
        );
        for bad in [
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "",
        ] {
            assert_eq!(
                TraceContext::from_traceparent(bad).traceparent(),
                None,
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn the_id_is_current_inside_its_scope_only() {
        assert!(current().is_none());
        let id = RequestId::mint();
        let seen = scope(id.clone(), async { current() }).await;
        assert_eq!(seen, Some(id.clone()));
        assert_eq!(sync_scope(&id, current), Some(id));
    }
}
