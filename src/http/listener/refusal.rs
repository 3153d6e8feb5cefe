//! What the listener refuses and how it says so: the error envelope for each refusal, the
//! count in `switchyard_listener_refusals_total`, and the recognition of hyper's own
//! bodiless error answers so they can be rewritten into the envelope.

use axum::http::StatusCode;
use axum::response::IntoResponse;
use bytes::Bytes;
use switchyard_actors::error::ErrorCode;
use switchyard_actors::metric_names::LISTENER_REFUSALS_TOTAL;

use crate::config::ListenerSettings;
use crate::http::error::ApiError;

/// Why the listener refused a request or closed a connection before a handler saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    /// The head did not arrive in time.
    HeaderTimeout,
    /// The body did not arrive in time.
    BodyTimeout,
    /// The head is over `max_header_bytes` (or hyper's own buffer or header count).
    HeadTooLarge,
    /// The request target is over `max_uri_bytes` (or the `http` crate's limit).
    UriTooLong,
    /// The request line or a header could not be parsed.
    Malformed,
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Self::HeaderTimeout => "header_timeout",
            Self::BodyTimeout => "body_timeout",
            Self::HeadTooLarge => "head_too_large",
            Self::UriTooLong => "uri_too_long",
            Self::Malformed => "malformed",
        }
    }

    /// Counts one refusal and logs it at debug: a flood of them is a metric, not a log flood.
    pub(super) fn record(self, peer: std::net::SocketAddr) {
        metrics::counter!(LISTENER_REFUSALS_TOTAL, "reason" => self.as_str()).increment(1);
        tracing::debug!(client = %peer, reason = self.as_str(), "listener refusal");
    }
}

/// 414 `request_too_large`.
pub(super) fn uri_too_long(max: usize) -> ApiError {
    ApiError::new(
        ErrorCode::RequestTooLarge,
        format!("The request target (path and query) is longer than {max} bytes."),
    )
    .with_status(StatusCode::URI_TOO_LONG)
}

/// 431 `request_too_large`.
pub(super) fn head_too_large(max: usize) -> ApiError {
    ApiError::new(
        ErrorCode::RequestTooLarge,
        format!("The request head (request line and headers) is larger than {max} bytes."),
    )
    .with_status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
}

/// 408 `invalid_request`.
pub(super) fn body_timeout(secs: u64) -> ApiError {
    ApiError::new(
        ErrorCode::InvalidRequest,
        format!("The request body did not arrive within {secs} s of the request head."),
    )
    .with_status(StatusCode::REQUEST_TIMEOUT)
}

/// The enveloped answers that replace hyper's own refusals, rendered once per listener.
#[derive(Debug)]
pub(super) struct Rewrites {
    malformed: Rendered,
    uri_too_long: Rendered,
    head_too_large: Rendered,
}

/// A response serialised up to (not including) its `date` line, and its body.
#[derive(Debug)]
struct Rendered {
    head: Vec<u8>,
    body: Vec<u8>,
}

impl Rendered {
    fn new(error: ApiError) -> Self {
        let body = serde_json::to_vec(&error.body()).unwrap_or_default();
        // The headers `ApiError` itself sets (content type, x-should-retry), so a rewritten
        // refusal looks exactly like one a handler returns.
        let response = error.into_response();
        let status = response.status();
        let mut head = format!(
            "HTTP/1.1 {} {}\r\n",
            status.as_str(),
            status.canonical_reason().unwrap_or("Error")
        )
        .into_bytes();
        for (name, value) in response.headers() {
            if name == axum::http::header::CONTENT_LENGTH {
                continue;
            }
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(format!("content-length: {}\r\n", body.len()).as_bytes());
        // hyper closes the connection after its own refusals; say so.
        head.extend_from_slice(b"connection: close\r\n");
        Self { head, body }
    }

    fn with_date(&self, date: Option<&[u8]>) -> Bytes {
        let mut out = Vec::with_capacity(self.head.len() + self.body.len() + 48);
        out.extend_from_slice(&self.head);
        if let Some(date) = date {
            out.extend_from_slice(b"date: ");
            out.extend_from_slice(date);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&self.body);
        Bytes::from(out)
    }
}

impl Rewrites {
    pub(super) fn new(settings: &ListenerSettings) -> Self {
        Self {
            malformed: Rendered::new(ApiError::new(
                ErrorCode::InvalidRequest,
                "The request line or a header is malformed.",
            )),
            uri_too_long: Rendered::new(uri_too_long(settings.max_uri_bytes)),
            head_too_large: Rendered::new(
                ApiError::new(
                    ErrorCode::RequestTooLarge,
                    format!(
                        "The request head is larger than {} bytes or has more than {} headers.",
                        settings.max_header_bytes, MAX_HEADERS
                    ),
                )
                .with_status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
            ),
        }
    }

    /// The enveloped replacement of `written` when it is one of hyper's own refusals, with
    /// the reason to count.
    pub(super) fn rewrite(&self, written: &[u8]) -> Option<(Reason, Bytes)> {
        let (status, date) = hyper_refusal(written)?;
        let (reason, rendered) = match status {
            400 => (Reason::Malformed, &self.malformed),
            414 => (Reason::UriTooLong, &self.uri_too_long),
            431 => (Reason::HeadTooLarge, &self.head_too_large),
            _ => return None,
        };
        Some((reason, rendered.with_date(date)))
    }
}

/// hyper's limit on header lines per request (its default, which we keep).
pub(super) const MAX_HEADERS: usize = 100;

/// Recognises the answer hyper writes by itself when it cannot parse a request head
/// (`Server::on_error` in hyper 1.x `proto/h1/role.rs`): a status line with no body and no
/// header but `content-length: 0`, `date` and `connection`. Returns the status and the date
/// value. Anything else (a handler's answer always has a content type) is not recognised.
fn hyper_refusal(written: &[u8]) -> Option<(u16, Option<&[u8]>)> {
    let rest = written
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| written.strip_prefix(b"HTTP/1.0 "))?;
    let head = rest.strip_suffix(b"\r\n\r\n")?;
    let mut lines = head.split(|&b| b == b'\n');
    let status_line = lines.next()?.strip_suffix(b"\r")?;
    let status = std::str::from_utf8(status_line.get(..3)?)
        .ok()?
        .parse::<u16>()
        .ok()?;
    if status_line.get(3) != Some(&b' ') {
        return None;
    }
    let mut date = None;
    for line in lines {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"date") {
            date = Some(value);
        } else if name.eq_ignore_ascii_case(b"content-length") {
            if value != b"0" {
                return None;
            }
        } else if !name.eq_ignore_ascii_case(b"connection") {
            return None;
        }
    }
    Some((status, date))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn hyper_refusals_are_recognised_and_nothing_else() {
        let hyper = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: Tue, 01 Jan 2030 00:00:00 GMT\r\n\r\n";
        assert_eq!(
            hyper_refusal(hyper),
            Some((400, Some(&b"Tue, 01 Jan 2030 00:00:00 GMT"[..])))
        );
        let closing = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(hyper_refusal(closing), Some((431, None)));
        // A handler's answer has a body and a content type.
        let handler = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(hyper_refusal(handler), None);
        let head_only = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n";
        assert_eq!(hyper_refusal(head_only), None);
        assert_eq!(
            hyper_refusal(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
            None
        );
        assert_eq!(hyper_refusal(b"HTTP/1.1 400 Bad Request\r\n"), None);
    }

    #[test]
    fn a_rewrite_is_a_complete_enveloped_response() {
        let rewrites = Rewrites::new(&ListenerSettings::default());
        let hyper = b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\ndate: D\r\n\r\n";
        let (reason, bytes) = rewrites.rewrite(hyper).unwrap();
        assert_eq!(reason, Reason::UriTooLong);
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 414 URI Too Long\r\n"), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(head.contains("date: D"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], "request_too_large");
        let (reason, _) = rewrites
            .rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        assert_eq!(reason, Reason::Malformed);
        assert!(
            rewrites
                .rewrite(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
                .is_none()
        );
    }
}
