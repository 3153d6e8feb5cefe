//! The extractors' refusals: repeated keys, positions, typed fields, query fields.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use axum::body::Body;
use axum::http::HeaderValue;
use serde::Deserialize;
use serde_json::json;

use super::*;

fn refusal<T: DeserializeOwned + 'static + std::fmt::Debug>(body: &str) -> ApiError {
    Json::<T>::from_bytes(body.as_bytes()).unwrap_err()
}

fn said(e: &ApiError) -> (ErrorCode, &str, Option<&str>) {
    (
        e.failure.code,
        e.failure.message.as_str(),
        e.param.as_deref(),
    )
}

#[test]
fn json_refuses_a_repeated_key_at_any_depth_and_names_it() {
    let e = refusal::<Value>(r#"{"model": "small", "messages": [], "model": "large"}"#);
    assert_eq!(
        said(&e),
        (
            ErrorCode::InvalidRequest,
            "Duplicate key `model` in the JSON body: a key may appear once per object.",
            Some("model")
        )
    );
    let e = refusal::<Value>(
        r#"{"messages": [{"role": "user"}, {"role": "user", "content": "a", "role": "x"}]}"#,
    );
    assert_eq!(e.param.as_deref(), Some("messages[1].role"));
    let e = refusal::<Value>(r#"[{"a": {"b": 1, "b": 2}}]"#);
    assert_eq!(e.param.as_deref(), Some("[0].a.b"));
    // The same key in sibling objects is fine.
    let ok = Json::<Value>::from_bytes(br#"[{"a": 1}, {"a": 2}]"#).unwrap();
    assert_eq!(ok.0, json!([{"a": 1}, {"a": 2}]));
}

#[test]
fn json_echoes_keys_bounded_and_escaped() {
    let key = format!("a\\u0000{}", "k".repeat(10_000));
    let e = refusal::<Value>(&format!(r#"{{"{key}": 1, "{key}": 2}}"#));
    let param = e.param.unwrap();
    assert!(param.starts_with("a\\u{0}k"), "{param}");
    assert!(param.chars().count() <= ECHO_CHARS + 8, "{param}");
    assert!(e.failure.message.len() < 300);
}

#[test]
fn json_keeps_key_order_and_numbers_as_serde_json_does() {
    let body = br#"{"z": 1, "a": -2, "m": 1.5, "big": 18446744073709551615, "n": null, "t": true}"#;
    let strict = Json::<Value>::from_bytes(body).unwrap().0;
    let plain: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(strict, plain);
    let keys: Vec<&String> = strict.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["z", "a", "m", "big", "n", "t"]);
}

#[test]
fn json_syntax_errors_name_the_position() {
    for (body, position) in [
        ("", "line 1 column 0"),
        (r#"{"model": }"#, "line 1 column 11"),
        (r#"{"a": 1} x"#, "line 1 column 10"),
        ("{\n\"a\": 1,\n}", "line 3 column 1"),
    ] {
        let e = refusal::<Value>(body);
        assert_eq!(e.failure.code, ErrorCode::InvalidRequest);
        assert!(
            e.failure
                .message
                .starts_with("The body is not valid JSON: ")
                && e.failure.message.contains(position),
            "{body:?}: {}",
            e.failure.message
        );
    }
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    assert!(
        refusal::<Value>(&deep)
            .failure
            .message
            .contains("recursion limit")
    );
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Typed {
    name: String,
    #[serde(default)]
    count: Option<u32>,
}

#[test]
fn typed_bodies_name_the_field_in_every_rejection() {
    let e = refusal::<Typed>(r#"{"name": "a", "count": "many"}"#);
    assert_eq!(e.param.as_deref(), Some("count"));
    assert!(
        e.failure
            .message
            .starts_with("Invalid `count`: invalid type: string")
    );
    let e = refusal::<Typed>(r#"{"name": "a", "colour": 1}"#);
    assert_eq!(e.param.as_deref(), Some("colour"));
    assert_eq!(
        e.failure.message,
        "Unknown field `colour`; the fields are `name`, `count`."
    );
    let e = refusal::<Typed>(r#"{"count": 1}"#);
    assert_eq!(
        (e.failure.message.as_str(), e.param.as_deref()),
        ("`name` is required.", Some("name"))
    );
    let e = refusal::<Typed>(r#"["a", 1]"#);
    assert_eq!(e.failure.message, "The body must be a JSON object.");
    let e = refusal::<Typed>(r#"{"name": "a", "name": "b"}"#);
    assert_eq!(e.param.as_deref(), Some("name"));
    let ok = Json::<Typed>::from_bytes(br#"{"name": "a", "count": null}"#).unwrap();
    assert_eq!((ok.0.name.as_str(), ok.0.count), ("a", None));
}

/// A chat body close to the 1 MiB limit: thousands of messages and a long content.
fn large_chat_body() -> Vec<u8> {
    let messages: Vec<Value> = (0..4_000)
        .map(|i| {
            json!({"role": if i % 2 == 0 { "user" } else { "assistant" },
                        "content": format!("message {i}: {}", "lorem ipsum ".repeat(18))})
        })
        .collect();
    let body = json!({"model": "small", "messages": messages, "max_tokens": 16,
                      "stream": true, "stream_options": {"include_usage": true}});
    serde_json::to_vec(&body).unwrap()
}

#[test]
fn json_parses_a_large_body_once_and_about_as_fast_as_serde_json() {
    let body = large_chat_body();
    assert!(
        body.len() > 900 * 1024 && body.len() < 1024 * 1024,
        "{}",
        body.len()
    );
    let plain: Value = serde_json::from_slice(&body).unwrap();
    let strict = Json::<Value>::from_bytes(&body).unwrap().0;
    assert_eq!(strict, plain);

    // Best of a few runs each, so a busy machine does not decide the outcome.
    let best = |f: &dyn Fn()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .min()
            .unwrap()
    };
    let baseline = best(&|| {
        serde_json::from_slice::<Value>(&body).unwrap();
    });
    let ours = best(&|| {
        Json::<Value>::from_bytes(&body).unwrap();
    });
    assert!(
        ours <= baseline * 2 + std::time::Duration::from_millis(5),
        "strict {ours:?} vs serde_json {baseline:?}"
    );

    // A repeat in the very last message is still found, and named.
    let mut tail = body.clone();
    assert!(tail.ends_with(b"true}}"));
    tail.truncate(tail.len() - 1);
    tail.extend_from_slice(br#", "stream": false}"#);
    let e = Json::<Value>::from_bytes(&tail).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("stream"));
}

#[test]
fn json_wants_a_json_content_type() {
    let with = |ct: &str| {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::CONTENT_TYPE,
            HeaderValue::from_str(ct).unwrap(),
        );
        json_content_type(&h)
    };
    assert!(with("application/json"));
    assert!(with("Application/JSON; charset=utf-8"));
    assert!(with("application/cloudevents+json"));
    assert!(!with("text/json"));
    assert!(!with("application/+json"));
    assert!(!with("text/plain"));
    assert!(!json_content_type(&axum::http::HeaderMap::new()));
}

async fn query<T: DeserializeOwned>(uri: &str) -> Result<T, ApiError> {
    let (mut parts, _) = Request::builder()
        .uri(uri)
        .body(Body::empty())
        .unwrap()
        .into_parts();
    Query::<T>::from_request_parts(&mut parts, &())
        .await
        .map(|Query(q)| q)
}

#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct Window {
    from: Option<String>,
    to: Option<String>,
}

#[tokio::test]
async fn query_refuses_a_repeated_field_and_names_it() {
    let w: Window = query("/v1/usage?from=a&to=b").await.unwrap();
    assert_eq!((w.from.as_deref(), w.to.as_deref()), (Some("a"), Some("b")));
    let e = query::<Window>("/v1/usage?from=a&from=b")
        .await
        .unwrap_err();
    assert_eq!(
        said(&e),
        (
            ErrorCode::InvalidRequest,
            "`from` is given more than once in the query string.",
            Some("from")
        )
    );
    // Percent-encoded names are the same field.
    let e = query::<Window>("/v1/usage?to=a&%74o=b").await.unwrap_err();
    assert_eq!(e.param.as_deref(), Some("to"));
    let w: Window = query("/v1/usage").await.unwrap();
    assert!(w.from.is_none() && w.to.is_none());
}
