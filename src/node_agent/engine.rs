//! The agent's HTTP client for the local engine (vLLM or `switchyard sim`): readiness
//! (`/health`), served models (`/v1/models`), load (`/metrics`) and chat completions, plus
//! the mapping of the engine's error answers onto the node protocol's error codes.

use std::time::Duration;

use serde::Deserialize;
use switchyard_actors::protocol::Api;

use super::config::{AgentError, engine_base};
use super::metrics::{Load, parse_load};

/// Bound on one probe (`/health`, `/v1/models`, `/metrics`).
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on opening a TCP connection to the engine.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pooled connections are dropped before uvicorn's 5 s keep-alive closes them under us (a POST
/// on a connection the server is closing fails and cannot be retried safely).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest probe or error body read.
const MAX_BODY: usize = 4 << 20;
/// Longest error message relayed to the server, in characters.
pub(crate) const MAX_ERROR_MESSAGE: usize = 500;

/// Failures of a probe.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeError {
    #[error("engine unreachable: {0}")]
    Http(#[from] reqwest::Error),
    #[error("engine answered HTTP {0}")]
    Status(u16),
    #[error("engine answer unreadable: {0}")]
    Body(String),
}

/// Cheap to share: one connection pool for every request.
#[derive(Debug, Clone)]
pub(crate) struct EngineClient {
    http: reqwest::Client,
    base: String,
}

#[derive(Deserialize)]
struct ModelList {
    #[serde(default)]
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

impl EngineClient {
    pub(crate) fn new(engine: &str) -> Result<Self, AgentError> {
        let base = engine_base(engine)?;
        let http = reqwest::Client::builder()
            // The engine is local: an HTTP_PROXY meant for the outside world must not apply.
            .no_proxy()
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| AgentError::HttpClient(e.to_string()))?;
        Ok(Self { http, base })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET /health` answered 200 (vLLM answers 503 while loading).
    pub(crate) async fn healthy(&self) -> Result<(), ProbeError> {
        let resp = self
            .http
            .get(self.url("/health"))
            .timeout(PROBE_TIMEOUT)
            .send()
            .await?;
        match resp.status().as_u16() {
            200 => Ok(()),
            other => Err(ProbeError::Status(other)),
        }
    }

    /// Model ids from `GET /v1/models` (`data[].id`).
    pub(crate) async fn models(&self) -> Result<Vec<String>, ProbeError> {
        let body = self.probe("/v1/models").await?;
        let list: ModelList =
            serde_json::from_slice(&body).map_err(|e| ProbeError::Body(e.to_string()))?;
        Ok(list.data.into_iter().map(|m| m.id).collect())
    }

    /// Load from `GET /metrics`.
    pub(crate) async fn load(&self) -> Result<Load, ProbeError> {
        let body = self.probe("/metrics").await?;
        let page = String::from_utf8_lossy(&body);
        parse_load(&page).ok_or_else(|| ProbeError::Body("no vLLM gauges on /metrics".into()))
    }

    async fn probe(&self, path: &str) -> Result<Vec<u8>, ProbeError> {
        let mut resp = self
            .http
            .get(self.url(path))
            .timeout(PROBE_TIMEOUT)
            .send()
            .await?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(ProbeError::Status(status));
        }
        read_limited(&mut resp, MAX_BODY).await
    }

    /// `POST` of an assignment to the engine's `api` route, with the client's request id
    /// and trace context; the response is read by the caller. No overall timeout: a
    /// generation lasts as long as it lasts, and the server cancels what runs too long.
    pub(crate) async fn post(
        &self,
        api: Api,
        body: &serde_json::Value,
        x_request_id: Option<&str>,
        traceparent: Option<&str>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut req = self.http.post(self.url(api.path())).json(body);
        if let Some(id) = x_request_id {
            req = req.header("x-request-id", id);
        }
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        req.send().await
    }
}

/// Reads a body up to `limit` bytes (a larger one is an error, not an allocation).
pub(crate) async fn read_limited(
    resp: &mut reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, ProbeError> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Err(ProbeError::Body(format!("body over {limit} bytes")));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The node protocol's error code for an engine's HTTP status before streaming.
pub(crate) fn error_code_for_status(status: u16) -> &'static str {
    match status {
        400 => "invalid_request",
        404 => "model_not_found",
        503 => "model_loading",
        _ => "model_backend_error",
    }
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorBody,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    message: Option<String>,
}

/// `error.message` of an engine's error body (vLLM's OpenAI shape), truncated; a generic text
/// when the body has none.
pub(crate) fn error_message(status: u16, body: &[u8]) -> String {
    serde_json::from_slice::<ErrorEnvelope>(body)
        .ok()
        .and_then(|e| e.error.message)
        .map_or_else(
            || format!("engine answered HTTP {status}"),
            |m| truncate_chars(&m, MAX_ERROR_MESSAGE),
        )
}

/// At most `max` characters of `s`.
pub(crate) fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => s[..i].to_owned(),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn assignments_reach_the_engine_route_of_their_api_with_the_request_id_and_trace() {
        use axum::http::HeaderMap;
        use axum::routing::post;
        // A stand-in engine answering with the path and the two headers it received.
        let echo = |path: &'static str| {
            move |headers: HeaderMap| async move {
                let h = |n: &str| {
                    headers
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                axum::Json(serde_json::json!({
                    "path": path, "x_request_id": h("x-request-id"), "traceparent": h("traceparent"),
                }))
            }
        };
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(echo("chat")))
            .route("/v1/completions", post(echo("completions")))
            .route("/v1/embeddings", post(echo("embeddings")));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let engine = EngineClient::new(&format!("http://{addr}")).unwrap();
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        for (api, path) in [
            (Api::Chat, "chat"),
            (Api::Completions, "completions"),
            (Api::Embeddings, "embeddings"),
        ] {
            let resp = engine
                .post(
                    api,
                    &serde_json::json!({}),
                    Some("trace-me.chatcmpl-1"),
                    Some(tp),
                )
                .await
                .unwrap();
            let seen: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(seen["path"], path);
            assert_eq!(seen["x_request_id"], "trace-me.chatcmpl-1");
            assert_eq!(seen["traceparent"], tp);
        }
        let resp = engine
            .post(Api::Chat, &serde_json::json!({}), None, None)
            .await
            .unwrap();
        let seen: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(seen["x_request_id"], serde_json::Value::Null);
    }

    #[test]
    fn statuses_map_to_protocol_codes() {
        assert_eq!(error_code_for_status(400), "invalid_request");
        assert_eq!(error_code_for_status(404), "model_not_found");
        assert_eq!(error_code_for_status(503), "model_loading");
        assert_eq!(error_code_for_status(500), "model_backend_error");
        assert_eq!(error_code_for_status(429), "model_backend_error");
    }

    #[test]
    fn error_messages_come_from_the_envelope_and_are_truncated() {
        let body = br#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
        assert_eq!(error_message(404, body), "The model `x` does not exist.");
        assert_eq!(error_message(502, b"<html>"), "engine answered HTTP 502");
        let long = format!(r#"{{"error":{{"message":"{}"}}}}"#, "\u{e9}".repeat(900));
        assert_eq!(error_message(400, long.as_bytes()).chars().count(), 500);
    }
}
