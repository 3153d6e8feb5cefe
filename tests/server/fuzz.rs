//! Fuzzing what clients send: arbitrary bytes and mutated JSON as bodies of every route,
//! arbitrary header values, through the router in-process; and arbitrary bytes at the
//! listener. Whatever arrives: nothing panics, nothing answers 500, every refusal is the JSON
//! error envelope with a code of SPEC section 4, and the server still answers afterwards.
//! `SWITCHYARD_FUZZ_CASES` sets the number of cases per property (64 in the test command;
//! `SWITCHYARD_FUZZ_CASES=20000 cargo test --test server fuzz::` runs them at length).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};
use switchyard_actors::error::ErrorCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

use crate::common::{fleet, http};

fn cases() -> u32 {
    std::env::var("SWITCHYARD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// Any JSON value, a few levels deep, with the values that break parsers and databases:
/// NUL, long strings, numbers past i64 and u64, floats.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,40}".prop_map(Value::from),
        Just(Value::from("a\u{0}b")),
        (1usize..5000).prop_map(|n| Value::from("x".repeat(n))),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A valid body of each route, and the fields worth mutating.
fn valid_body(route: usize) -> Value {
    match route {
        0 => json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "stream": false}),
        1 => json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                    "max_output_tokens": 3}),
        2 => json!({"name": "fuzz-team"}),
        3 => json!({"team": "demo", "rpm": 5, "model_allowlist": ["small"]}),
        4 => json!({"team": "demo", "amount": 5}),
        _ => json!({"node_id": "fuzz-node", "location": "onprem"}),
    }
}

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "stream",
    "stream_options",
    "n",
    "tools",
    "name",
    "team",
    "rpm",
    "tokens_per_day",
    "max_streams",
    "expires_at",
    "message_quota",
    "burst_capacity",
    "burst_refill_seconds",
    "model_allowlist",
    "amount",
    "node_id",
    "location",
    "temperature",
];

#[derive(Debug, Clone)]
enum Payload {
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// The route's valid body with one field set to any value (or removed).
    Mutated { field: usize, value: Option<Value> },
}

#[derive(Debug, Clone)]
struct Input {
    route: usize,
    /// Another method than the route's own, sometimes.
    method: Option<usize>,
    payload: Payload,
    /// Extra header (name index, raw value bytes).
    header: Option<(usize, Vec<u8>)>,
    path_id: String,
}

fn input() -> impl Strategy<Value = Input> {
    let payload = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Payload::Bytes),
        (0..FIELDS.len(), prop::option::of(any_json()))
            .prop_map(|(field, value)| Payload::Mutated { field, value }),
    ];
    (
        0..15usize,
        prop::option::weighted(0.1, 0..METHODS.len()),
        payload,
        prop::option::of((0..4usize, prop::collection::vec(any::<u8>(), 0..40))),
        prop_oneof![".{0,20}", "[0-9]{1,25}", Just("gen_x".to_owned())],
    )
        .prop_map(|(route, method, payload, header, path_id)| Input {
            route,
            method,
            payload,
            header,
            path_id,
        })
}

const METHODS: [Method; 5] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
];

const HEADERS: [&str; 4] = [
    "authorization",
    "idempotency-key",
    "content-type",
    "x-request-id",
];

/// The request for `input` on the fleet's routes, or `None` when the bytes make no valid
/// request (`http` refuses them before any server would see them).
fn request(input: &Input, key: &str, admin: &str) -> Option<Request<Body>> {
    let id: String = url_escape(&input.path_id);
    let (method, path, bearer, body_route) = match input.route {
        0 => (Method::POST, "/v1/chat/completions".to_owned(), key, 0),
        1 => (Method::POST, "/v1/generations".to_owned(), key, 1),
        2 => (Method::POST, "/admin/teams".to_owned(), admin, 2),
        3 => (Method::POST, "/admin/keys".to_owned(), admin, 3),
        4 => (Method::POST, "/admin/credits".to_owned(), admin, 4),
        5 => (Method::POST, "/admin/nodes".to_owned(), admin, 5),
        6 => (Method::GET, format!("/v1/usage?from={id}&to={id}"), key, 0),
        7 => (Method::GET, format!("/v1/generations/{id}"), key, 0),
        8 => (Method::DELETE, format!("/admin/keys/{id}"), admin, 0),
        9 => (Method::POST, format!("/v1/generations/{id}/cancel"), key, 0),
        10 => (Method::GET, "/v1/nodes/connect".to_owned(), key, 0),
        11 => (
            Method::GET,
            format!("/admin/reports/drift?from={id}&to={id}"),
            admin,
            0,
        ),
        12 => (Method::POST, format!("/admin/nodes/{id}/drain"), admin, 0),
        13 => (Method::DELETE, format!("/admin/nodes/{id}/token"), admin, 0),
        _ => (
            Method::POST,
            format!("/admin/nodes/{id}/load_model"),
            admin,
            5,
        ),
    };
    let method = input.method.map_or(method, |m| METHODS[m].clone());
    let body = match &input.payload {
        Payload::Bytes(b) => b.clone(),
        Payload::Mutated { field, value } => {
            let mut v = valid_body(body_route);
            if let Value::Object(o) = &mut v {
                match value {
                    Some(value) => o.insert(FIELDS[*field].to_owned(), value.clone()),
                    None => o.remove(FIELDS[*field]),
                };
            }
            v.to_string().into_bytes()
        }
    };
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {bearer}"))
        .header("content-type", "application/json")
        .header("idempotency-key", "fuzz-key");
    if let Some((name, value)) = &input.header {
        let value = HeaderValue::from_bytes(value).ok()?;
        req = req.header(HeaderName::from_static(HEADERS[*name]), value);
    }
    req.body(Body::from(body)).ok()
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A refusal is the envelope with a known code; nothing is a 500.
fn check(status: u16, body: &[u8]) -> Result<(), String> {
    if status == 500 || !(200..=599).contains(&status) {
        return Err(format!("status {status}"));
    }
    if status >= 400 {
        let v: Value = serde_json::from_slice(body).map_err(|e| {
            format!(
                "{status} without a JSON body ({e}): {:?}",
                String::from_utf8_lossy(body)
            )
        })?;
        let code = v["error"]["code"].as_str().unwrap_or_default();
        if ErrorCode::parse(code).is_none()
            || !v["error"]["message"].is_string()
            || !v["error"]["type"].is_string()
        {
            return Err(format!(
                "{status} with a body that is not the envelope: {v}"
            ));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_body_or_header_on_any_route_gets_an_answer_or_the_envelope() {
    // No node: what passes every check ends at the queue (503), never on a GPU.
    let fleet = fleet(&[], 20.0, |_| {}).await;
    let router = switchyard::http::router(fleet.server.state().clone());
    let (key, admin) = (fleet.api_key.clone(), fleet.admin_token.clone());
    let handle = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let result = tokio::task::block_in_place(|| {
        runner
            .run(&input(), |input| {
                let Some(req) = request(&input, &key, &admin) else {
                    return Ok(());
                };
                let router = router.clone();
                let (status, body) = handle
                    .block_on(async move {
                        let resp = router.oneshot(req).await.map_err(|e| e.to_string())?;
                        let status = resp.status().as_u16();
                        let body = axum::body::to_bytes(resp.into_body(), 4 << 20)
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>((status, body))
                    })
                    .map_err(TestCaseError::fail)?;
                check(status, &body).map_err(TestCaseError::fail)
            })
            .map_err(|e| e.to_string())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let alive = http()
        .get(format!("{}/healthz", fleet.server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(alive.status(), 200);
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// A request head with one byte range replaced by arbitrary bytes.
fn raw_request() -> impl Strategy<Value = Vec<u8>> {
    let base = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}".to_vec();
    let len = base.len();
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..400),
        (0..len, 0..len, prop::collection::vec(any::<u8>(), 0..60)).prop_map(
            move |(a, b, fill)| {
                let (a, b) = (a.min(b), a.max(b));
                let mut out = base[..a].to_vec();
                out.extend_from_slice(&fill);
                out.extend_from_slice(&base[b..]);
                out
            }
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_bytes_at_the_listener_get_the_envelope_or_a_close() {
    let fleet = fleet(&[], 20.0, |c| {
        c.server.listener.header_timeout_secs = 1;
        c.server.listener.body_timeout_secs = 1;
    })
    .await;
    let addr = fleet.server.addr();
    let handle = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let result = tokio::task::block_in_place(|| {
        runner
            .run(&raw_request(), |bytes| {
                let answer = handle
                    .block_on(async move {
                        let mut tcp = tokio::net::TcpStream::connect(addr)
                            .await
                            .map_err(|e| e.to_string())?;
                        // Half-close: the server sees the end of what was sent at once.
                        let _ = tcp.write_all(&bytes).await;
                        let _ = tcp.shutdown().await;
                        let mut answer = Vec::new();
                        let _ = tokio::time::timeout(
                            Duration::from_secs(3),
                            tcp.read_to_end(&mut answer),
                        )
                        .await;
                        Ok::<_, String>(answer)
                    })
                    .map_err(TestCaseError::fail)?;
                if answer.is_empty() {
                    return Ok(()); // closed without an answer: nothing complete was asked
                }
                let text = String::from_utf8_lossy(&answer);
                let Some((head, body)) = text.split_once("\r\n\r\n") else {
                    return Err(TestCaseError::fail(format!("not an HTTP answer: {text:?}")));
                };
                let status: u16 = head
                    .split(' ')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| TestCaseError::fail(format!("no status: {head:?}")))?;
                // One answer per connection here, unless the bytes held several requests.
                let body = body.split("HTTP/1.1 ").next().unwrap_or_default();
                if body.trim().is_empty() && status < 400 {
                    return Ok(());
                }
                check(status, body.trim().as_bytes()).map_err(TestCaseError::fail)
            })
            .map_err(|e| e.to_string())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let alive = http()
        .get(format!("{}/healthz", fleet.server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(alive.status(), 200);
    fleet.shutdown(Duration::from_secs(1)).await;
}
