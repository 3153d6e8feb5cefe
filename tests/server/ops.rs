//! What operators and SDKs read around every answer: the request id (the client's when
//! usable, the same in the header and the error envelope), `openai-processing-ms`, the
//! rate-limit reset headers, 401 versus 403 on admin routes, `GET /v1/models/{id}`, and the
//! export of spans to an OTLP collector that continues the caller's trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{fleet, http};

/// A request with `x-request-id: id` (when given) and the fleet's key.
async fn get_with_id(url: &str, bearer: &str, id: Option<&[u8]>) -> reqwest::Response {
    let mut req = http().get(url).bearer_auth(bearer);
    if let Some(id) = id {
        req = req.header(
            "x-request-id",
            reqwest::header::HeaderValue::from_bytes(id).unwrap(),
        );
    }
    req.send().await.unwrap()
}

/// The response's `x-request-id`, and its error envelope's `request_id` when it has one.
async fn ids(resp: reqwest::Response) -> (String, Option<String>) {
    let header = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    let envelope = body["error"]["request_id"].as_str().map(str::to_owned);
    (header, envelope)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usable_client_request_id_is_kept_on_answers_and_errors_alike() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.server.base_url();
    let v1 = fleet.openai_base_url();
    let id = "client-7f3a.9c_/~:ok";

    let chat = http()
        .post(format!("{v1}/chat/completions"))
        .bearer_auth(&fleet.api_key)
        .header("x-request-id", id)
        .json(&json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    assert_eq!(chat.headers()["x-request-id"], id);
    let body: Value = chat.json().await.unwrap();
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));

    for (url, bearer, status) in [
        (format!("{v1}/models"), "sk-sy-not-a-key", 401),
        (format!("{base}/no/such/route"), fleet.api_key.as_str(), 404),
        (format!("{v1}/models/nope"), fleet.api_key.as_str(), 404),
        (format!("{base}/admin/teams"), "sk-sy-not-a-key", 401),
    ] {
        let resp = get_with_id(&url, bearer, Some(id.as_bytes())).await;
        assert_eq!(resp.status(), status, "{url}");
        assert_eq!(
            ids(resp).await,
            (id.to_owned(), Some(id.to_owned())),
            "{url}"
        );
    }
    // 405 from the method fallback, and a body the JSON extractor refuses.
    let wrong_method = http()
        .delete(format!("{v1}/models"))
        .header("x-request-id", id)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong_method.status(), 405);
    assert_eq!(
        ids(wrong_method).await,
        (id.to_owned(), Some(id.to_owned()))
    );
    let bad_json = http()
        .post(format!("{v1}/chat/completions"))
        .bearer_auth(&fleet.api_key)
        .header("x-request-id", id)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad_json.status(), 400);
    assert_eq!(ids(bad_json).await, (id.to_owned(), Some(id.to_owned())));
    // A chat refusal after the handler named its completion: the envelope still carries the
    // request id, and nothing but OpenAI's fields.
    let unknown_model = http()
        .post(format!("{v1}/chat/completions"))
        .bearer_auth(&fleet.api_key)
        .header("x-request-id", id)
        .json(&json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown_model.status(), 404);
    assert_eq!(unknown_model.headers()["x-request-id"], id);
    let err: Value = unknown_model.json().await.unwrap();
    assert_eq!(err["error"]["request_id"], id);
    assert!(err["error"].get("details").is_none(), "{err}");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_unprintable_or_long_request_id_is_replaced_by_a_minted_one() {
    let fleet = fleet(&[], 20.0, |_| {}).await;
    let url = format!("{}/models/nope", fleet.openai_base_url());
    let too_long = "a".repeat(129);
    let longest = "b".repeat(128);
    let mut seen = Vec::new();
    for sent in [
        None,
        Some(too_long.as_bytes()),
        Some(b"two words".as_slice()),
        Some(b"caf\xc3\xa9".as_slice()),
        Some(b"tab\there".as_slice()),
    ] {
        let (header, envelope) = ids(get_with_id(&url, &fleet.api_key, sent).await).await;
        assert!(
            header.starts_with("req_") && header.len() == 28,
            "{sent:?} → {header}"
        );
        assert_eq!(envelope.as_deref(), Some(header.as_str()));
        seen.push(header);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "every minted id is new");
    let (header, envelope) =
        ids(get_with_id(&url, &fleet.api_key, Some(longest.as_bytes())).await).await;
    assert_eq!(
        (header.as_str(), envelope.as_deref()),
        (longest.as_str(), Some(longest.as_str()))
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// `20ms`, `54s`, `6m0s`, `13h3m45s`.
fn is_openai_duration(v: &str) -> bool {
    if let Some(ms) = v.strip_suffix("ms") {
        return !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit());
    }
    let Some(rest) = v.strip_suffix('s') else {
        return false;
    };
    let mut units = rest.split(['h', 'm']);
    let numbers = units.all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    numbers && rest.matches('h').count() <= 1 && rest.matches('m').count() <= 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_answers_carry_processing_ms_and_every_rate_limit_reset() {
    assert!(
        is_openai_duration("6m0s") && is_openai_duration("20ms") && is_openai_duration("13h3m45s")
    );
    assert!(!is_openai_duration("6 s") && !is_openai_duration("s") && !is_openai_duration("1h"));
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let v1 = fleet.openai_base_url();
    let chat = http()
        .post(format!("{v1}/chat/completions"))
        .bearer_auth(&fleet.api_key)
        .json(&json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    let h = chat.headers();
    let ms: u64 = h["openai-processing-ms"].to_str().unwrap().parse().unwrap();
    assert!(ms < 10_000, "{ms}");
    for name in ["x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"] {
        let v = h[name].to_str().unwrap();
        assert!(is_openai_duration(v), "{name}: {v}");
    }
    // Tokens per day reset at the next UTC midnight: under a day away.
    let tokens = h["x-ratelimit-reset-tokens"].to_str().unwrap();
    assert!(
        !tokens.contains('h') || tokens.split('h').next().unwrap().parse::<u32>().unwrap() < 24
    );

    for resp in [
        http()
            .get(format!("{v1}/models"))
            .bearer_auth(&fleet.api_key)
            .send()
            .await
            .unwrap(),
        http().get(format!("{v1}/models")).send().await.unwrap(),
    ] {
        assert!(resp.headers().contains_key("openai-processing-ms"));
    }
    let health = http()
        .get(format!("{}/healthz", fleet.server.base_url()))
        .send()
        .await
        .unwrap();
    assert!(!health.headers().contains_key("openai-processing-ms"));
    assert!(health.headers().contains_key("x-request-id"));
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_answer_401_to_unknown_credentials_and_403_to_valid_non_admin_ones() {
    let fleet = fleet(&[], 20.0, |_| {}).await;
    let url = format!("{}/admin/teams", fleet.server.base_url());
    for (bearer, status, code) in [
        (
            "sk-sy-AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
            401,
            "unauthorized",
        ),
        ("not-even-a-key", 401, "unauthorized"),
        ("a.b.c", 401, "unauthorized"),
        (fleet.api_key.as_str(), 403, "forbidden"),
        (fleet.admin_token.as_str(), 200, ""),
    ] {
        let resp = http().get(&url).bearer_auth(bearer).send().await.unwrap();
        assert_eq!(resp.status(), status, "{bearer}");
        let body: Value = resp.json().await.unwrap();
        if status != 200 {
            assert_eq!(body["error"]["code"], code, "{bearer}");
        }
    }
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_by_id_is_shown_only_to_keys_that_may_use_it() {
    let fleet = fleet(&[], 20.0, |_| {}).await;
    let base = fleet.server.base_url();
    let v1 = fleet.openai_base_url();
    let admin = |path: &str, body: Value| {
        http()
            .post(format!("{base}{path}"))
            .bearer_auth(&fleet.admin_token)
            .json(&body)
            .send()
    };
    assert_eq!(
        admin("/admin/teams", json!({"name": "narrow"}))
            .await
            .unwrap()
            .status(),
        201
    );
    let key: Value = admin(
        "/admin/keys",
        json!({"team": "narrow", "model_allowlist": ["small"]}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let narrow = key["key"].as_str().unwrap().to_owned();
    let get = |id: &str, bearer: &str| {
        http()
            .get(format!("{v1}/models/{id}"))
            .bearer_auth(bearer)
            .send()
    };

    // The same entries GET /v1/models lists for the key.
    let listed: Value = http()
        .get(format!("{v1}/models"))
        .bearer_auth(&narrow)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for entry in listed["data"].as_array().unwrap() {
        let id = entry["id"].as_str().unwrap();
        let resp = get(id, &narrow).await.unwrap();
        assert_eq!(resp.status(), 200, "{id}");
        let model: Value = resp.json().await.unwrap();
        assert_eq!(model["id"], id);
        assert_eq!(model["object"], "model");
        assert_eq!(model["owned_by"], "switchyard");
        assert!(model["created"].is_i64());
    }
    assert_eq!(get("small", &narrow).await.unwrap().status(), 200);
    // A model outside the allowlist looks exactly like one that does not exist.
    let mut messages = Vec::new();
    for id in ["large", "llama-3.3-70b-instruct", "no-such-model"] {
        let resp = get(id, &narrow).await.unwrap();
        assert_eq!(resp.status(), 404, "{id}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["code"], "model_not_found");
        assert_eq!(err["error"]["param"], "model");
        messages.push(err["error"]["message"].as_str().unwrap().replace(id, "ID"));
    }
    messages.dedup();
    assert_eq!(messages.len(), 1, "{messages:?}");
    // A key without an allowlist sees every model and alias.
    for id in ["large", "medium", "qwen2.5-32b-instruct"] {
        assert_eq!(get(id, &fleet.api_key).await.unwrap().status(), 200, "{id}");
    }
    // Same credential rules as the list; the envelope on wrong methods.
    let anonymous = http()
        .get(format!("{v1}/models/small"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    let post = http()
        .post(format!("{v1}/models/small"))
        .bearer_auth(&narrow)
        .send()
        .await
        .unwrap();
    assert_eq!(post.status(), 405);
    let err: Value = post.json().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_request");
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// An OTLP/HTTP collector on port 0 that keeps every body posted to `/v1/traces`.
async fn collector() -> (String, Arc<Mutex<Vec<u8>>>) {
    let received = Arc::new(Mutex::new(Vec::new()));
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().extend_from_slice(&body);
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_in_the_callers_trace() {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let (endpoint, received) = collector().await;
    let (layer, otel) = switchyard::telemetry::otlp_layer(&endpoint).unwrap();
    tracing_subscriber::registry()
        .with(layer)
        .with(switchyard::telemetry::filter("info"))
        .init();
    let fleet = fleet(&[], 20.0, |_| {}).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_span = "00f067aa0ba902b7";
    let resp = http()
        .get(format!("{}/models", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .header("traceparent", format!("00-{trace_id}-{parent_span}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    // Untraced requests start traces of their own.
    http()
        .get(format!("{}/healthz", fleet.server.base_url()))
        .send()
        .await
        .unwrap();
    fleet.shutdown(Duration::from_secs(1)).await;
    let otel = Arc::new(otel);
    let flushing = otel.clone();
    tokio::task::spawn_blocking(move || flushing.flush())
        .await
        .unwrap();
    let body = received.lock().unwrap().clone();
    let contains = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    assert!(!body.is_empty(), "spans were exported");
    assert!(
        contains(&unhex(trace_id)),
        "the caller's trace id is exported"
    );
    assert!(
        contains(&unhex(parent_span)),
        "the caller's span is the parent"
    );
    assert!(
        contains(b"GET /v1/models"),
        "the request span is named by its route"
    );
    tokio::task::spawn_blocking(move || otel.shutdown())
        .await
        .unwrap();
}
