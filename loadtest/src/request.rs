//! One streaming chat completion, measured: send, status, SSE events, content
//! timestamps, usage, and an outcome key for anything that is not a clean
//! `[DONE]`. Also the non-streaming calibration probe.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{MAX_EVENT_BYTES, SseError, SseParser};

/// Error bodies beyond this are not read further (only `error.code` is needed).
const MAX_ERROR_BODY: usize = 64 << 10;
/// After `[DONE]`, how long to wait for the body's end so the connection can
/// go back to the pool, before giving up on it.
const DRAIN_AFTER_DONE: Duration = Duration::from_millis(200);

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: [Message<'a>; 1],
    max_tokens: u32,
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

impl<'a> ChatRequest<'a> {
    fn new(model: &'a str, prompt: &'a str, max_tokens: u32, stream: bool) -> Self {
        Self {
            model,
            messages: [Message {
                role: "user",
                content: prompt,
            }],
            max_tokens,
            stream,
            stream_options: stream.then_some(StreamOptions {
                include_usage: true,
            }),
        }
    }
}

/// `lt-{run}-{n}`: the run's start in nanoseconds and a counter, unique across runs.
fn next_idempotency_key() -> String {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static RUN: OnceLock<u128> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let run = RUN.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    });
    format!("lt-{run:x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Where one request goes; shared by all workers.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub client: reqwest::Client,
    /// Where requests go, in turn (usually one).
    pub endpoints: Vec<String>,
    /// The next request's turn.
    pub turn: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub auth: Option<String>,
    /// A fresh `Idempotency-Key` per request.
    pub idempotency_keys: bool,
}

impl Target {
    fn post(&self, body: &ChatRequest<'_>) -> reqwest::RequestBuilder {
        let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let endpoint = &self.endpoints[turn % self.endpoints.len().max(1)];
        let mut req = self.client.post(endpoint).json(body);
        if self.idempotency_keys {
            req = req.header("idempotency-key", next_idempotency_key());
        }
        match &self.auth {
            Some(a) => req.header(reqwest::header::AUTHORIZATION, a),
            None => req,
        }
    }
}

/// What one streaming request observed, filled in as it goes so that a
/// timeout keeps everything seen before it.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    /// HTTP status, once the response head arrived.
    pub status: u16,
    pub first_content: Option<Instant>,
    pub last_content: Option<Instant>,
    pub content_chunks: u64,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// Set when `[DONE]` arrived: the request's end time.
    pub done_at: Option<Instant>,
}

/// Sends one streaming request and reads it to the end. Returns the outcome
/// key; `obs` holds the measurements. `on_content` runs per content chunk
/// (live progress). Cancel-safe: dropping the future leaves `obs` valid.
pub(crate) async fn stream_one(
    target: &Target,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    obs: &mut Observed,
    on_content: &(dyn Fn() + Sync),
) -> String {
    let body = ChatRequest::new(model, prompt, max_tokens, true);
    let mut resp = match target.post(&body).send().await {
        Ok(r) => r,
        Err(_) => return "transport_error".to_string(),
    };
    let status = resp.status();
    obs.status = status.as_u16();
    if !status.is_success() {
        return match read_error_code(&mut resp).await {
            Some(code) => format!("{} {code}", status.as_u16()),
            None => format!("{} -", status.as_u16()),
        };
    }
    let mut parser = SseParser::new(MAX_EVENT_BYTES);
    let mut end: Option<End> = None;
    loop {
        let bytes = match resp.chunk().await {
            Ok(Some(b)) => b,
            // A body cut by a reset or a missing chunked terminator is, from
            // the client's side, the same as a clean EOF without [DONE].
            Ok(None) | Err(_) => return "interrupted".to_string(),
        };
        // Events of one network read arrived together: one timestamp for all.
        let now = Instant::now();
        let fed = parser.feed(&bytes, |data| {
            match handle_event(data, now, obs, on_content) {
                Ok(()) => true,
                Err(e) => {
                    end = Some(e);
                    false
                }
            }
        });
        if let Err(SseError::EventTooLarge { .. }) = fed {
            return "protocol_error event_too_large".to_string();
        }
        match end.take() {
            None => {}
            Some(End::Done) => {
                // Reading to the end lets the connection be reused.
                let _ = tokio::time::timeout(DRAIN_AFTER_DONE, drain(&mut resp)).await;
                return format!("{} ok", status.as_u16());
            }
            Some(End::Outcome(o)) => return o,
        }
    }
}

async fn drain(resp: &mut reqwest::Response) {
    while let Ok(Some(_)) = resp.chunk().await {}
}

/// Why a stream stops being read before its body ends.
#[derive(Debug, PartialEq)]
enum End {
    /// `data: [DONE]`.
    Done,
    /// A mid-stream error event or an unparseable event, as its outcome key.
    Outcome(String),
}

/// Handles one SSE event; `Err` ends the stream.
fn handle_event(
    data: &[u8],
    now: Instant,
    obs: &mut Observed,
    on_content: &(dyn Fn() + Sync),
) -> Result<(), End> {
    if data.trim_ascii() == b"[DONE]" {
        obs.done_at = Some(now);
        return Err(End::Done);
    }
    let chunk: StreamChunk = match serde_json::from_slice(data) {
        Ok(c) => c,
        Err(_) => return Err(End::Outcome("protocol_error bad_json".to_string())),
    };
    if let Some(err) = chunk.error {
        let code = render_code(error_code(&err));
        return Err(End::Outcome(format!("stream_error {code}")));
    }
    if chunk.choices.0 {
        obs.first_content.get_or_insert(now);
        obs.last_content = Some(now);
        obs.content_chunks += 1;
        on_content();
    }
    if let Some(u) = chunk.usage {
        obs.prompt_tokens = u.prompt_tokens.or(obs.prompt_tokens);
        obs.completion_tokens = u.completion_tokens.or(obs.completion_tokens);
    }
    Ok(())
}

/// `error.code` of an OpenAI/vLLM error body, or the flat `code` of older vLLM.
fn error_code(v: &Value) -> Option<&Value> {
    match v.get("error") {
        Some(e @ Value::Object(_)) => e.get("code"),
        _ => v.get("code"),
    }
}

/// Switchyard's codes are strings, vLLM's integers; both become the key text.
fn render_code(code: Option<&Value>) -> String {
    match code {
        Some(Value::String(s)) if !s.is_empty() => s.replace(char::is_whitespace, "_"),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::Bool(b)) => b.to_string(),
        _ => "-".to_string(),
    }
}

async fn read_body_capped(resp: &mut reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(b)) = resp.chunk().await {
        body.extend_from_slice(&b);
        if body.len() > MAX_ERROR_BODY {
            break;
        }
    }
    body
}

async fn read_error_code(resp: &mut reqwest::Response) -> Option<String> {
    let body = read_body_capped(resp).await;
    let v: Value = serde_json::from_slice(&body).ok()?;
    let code = error_code(&v)?;
    Some(render_code(Some(code)))
}

/// Sends one non-streaming request with `max_tokens: 1` and returns its
/// `usage.prompt_tokens`; errors describe what the endpoint answered.
pub(crate) async fn probe_prompt_tokens(
    target: &Target,
    model: &str,
    prompt: &str,
    timeout: Duration,
) -> anyhow::Result<u64> {
    let body = ChatRequest::new(model, prompt, 1, false);
    let work = async {
        let mut resp = target
            .post(&body)
            .send()
            .await
            .with_context(|| format!("could not reach {}", target.endpoints.join(",")))?;
        let status = resp.status();
        let bytes = read_body_capped(&mut resp).await;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(2000)]).into_owned();
            bail!("HTTP {status}: {}", text.trim());
        }
        let v: Value = serde_json::from_slice(&bytes).context("response is not JSON")?;
        v.pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64)
            .context("response has no usage.prompt_tokens")
    };
    tokio::time::timeout(timeout, work)
        .await
        .with_context(|| format!("no answer within {timeout:?}"))?
}

/// The parts of a streamed chunk the harness reads; everything else is
/// skipped by serde without allocating.
#[derive(Deserialize)]
struct StreamChunk {
    #[serde(default)]
    choices: FirstHasContent,
    #[serde(default)]
    usage: Option<UsageCounts>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct UsageCounts {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Choice {
    #[serde(default)]
    delta: Option<DeltaContent>,
}

#[derive(Deserialize, Default)]
struct DeltaContent {
    #[serde(default)]
    content: NonEmpty,
}

/// Whether `choices[0].delta.content` is a non-empty string, decided while
/// parsing so no `Vec` or `String` is built per chunk.
#[derive(Default)]
struct FirstHasContent(bool);

impl<'de> Deserialize<'de> for FirstHasContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FirstHasContent;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array of choices or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstHasContent(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstHasContent(false))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first: Option<Choice> = seq.next_element()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                let has = first.and_then(|c| c.delta).is_some_and(|d| d.content.0);
                Ok(FirstHasContent(has))
            }
        }
        d.deserialize_any(V)
    }
}

/// A string field reduced to "is it non-empty"; null counts as empty.
#[derive(Default)]
struct NonEmpty(bool);

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NonEmpty;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or null")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(NonEmpty(!s.is_empty()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn handle(data: &str, obs: &mut Observed) -> Result<(), String> {
        handle_event(data.as_bytes(), Instant::now(), obs, &|| {}).map_err(|e| match e {
            End::Done => "DONE".to_string(),
            End::Outcome(o) => o,
        })
    }

    #[test]
    fn vllm_chunks() {
        let mut o = Observed::default();
        handle(
            r#"{"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null}"#,
            &mut o,
        )
        .unwrap();
        assert_eq!(o.content_chunks, 0);
        handle(
            r#"{"choices":[{"delta":{"content":"hi \"x\""}}],"usage":null}"#,
            &mut o,
        )
        .unwrap();
        handle(r#"{"choices":[{"delta":{"content":null}}]}"#, &mut o).unwrap();
        handle(
            r#"{"choices":[{"delta":{}, "finish_reason":"length"}]}"#,
            &mut o,
        )
        .unwrap();
        handle(
            r#"{"choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}"#,
            &mut o,
        )
        .unwrap();
        assert_eq!(o.content_chunks, 1);
        assert_eq!(o.prompt_tokens, Some(7));
        assert_eq!(o.completion_tokens, Some(2));
        assert_eq!(handle(" [DONE] ", &mut o), Err("DONE".into()));
        assert!(o.done_at.is_some());
    }

    #[test]
    fn errors_and_garbage_become_outcomes() {
        let mut o = Observed::default();
        let e = handle(r#"{"error":{"message":"m","code":"queue_full"}}"#, &mut o);
        assert_eq!(e, Err("stream_error queue_full".into()));
        let e = handle(r#"{"error":{"message":"m","type":"x","code":500}}"#, &mut o);
        assert_eq!(e, Err("stream_error 500".into()));
        let e = handle(r#"{"error":{"message":"m"}}"#, &mut o);
        assert_eq!(e, Err("stream_error -".into()));
        let bad = handle("{not json", &mut o);
        assert_eq!(bad, Err("protocol_error bad_json".into()));
        let e = handle_event(b"{\"choices\":\"\xff\"}", Instant::now(), &mut o, &|| {});
        assert_eq!(e, Err(End::Outcome("protocol_error bad_json".into())));
        let e = handle(r#"{"choices":[{"delta":{"content":5}}]}"#, &mut o);
        assert_eq!(e, Err("protocol_error bad_json".into()));
    }

    #[test]
    fn error_code_shapes() {
        let v: Value = serde_json::json!({"error": {"code": 404}});
        assert_eq!(render_code(error_code(&v)), "404");
        let v: Value = serde_json::json!({"object": "error", "code": 400});
        assert_eq!(render_code(error_code(&v)), "400");
        let v: Value = serde_json::json!({"error": {"code": "queue full"}});
        assert_eq!(render_code(error_code(&v)), "queue_full");
        let v: Value = serde_json::json!({"error": "just text"});
        assert_eq!(render_code(error_code(&v)), "-");
    }

    #[test]
    fn request_body_shape() {
        let body = serde_json::to_value(ChatRequest::new("m", "hello", 5, true)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"model":"m","messages":[{"role":"user","content":"hello"}],
                "max_tokens":5,"stream":true,"stream_options":{"include_usage":true}})
        );
        let probe = serde_json::to_value(ChatRequest::new("m", "x", 1, false)).unwrap();
        assert!(probe.get("stream_options").is_none());
    }
}
