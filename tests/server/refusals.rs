//! Clean refusals: every bad input gets its 4xx with the error envelope, on both backends,
//! and changes nothing.
//!
//! One table of bad requests (admin bodies past their limits, repeated JSON keys and query
//! fields, malformed path ids, `Authorization` headers that are not exactly `Bearer` + one
//! space + a credential) runs against a fleet on SQLite and one on PostgreSQL + Redis. Each
//! case checks the status, `error.code`, `error.type`, `error.param` and a message free of
//! store or parser internals, and that teams, keys, credits, nodes and the ledger are as
//! they were.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::common::{clean_redis, drop_pg, fleet, fresh_pg, http, redis_url};

/// How a case authenticates.
#[derive(Debug, Clone)]
enum Auth {
    /// `Bearer` + the bootstrap admin token.
    Admin,
    /// `Bearer` + the fleet's API key.
    Key,
    /// These `Authorization` header values, as given.
    Raw(Vec<String>),
    /// No `Authorization` header.
    Nothing,
}

/// What a case sends as its body.
#[derive(Debug, Clone)]
enum Body {
    Nothing,
    /// JSON text exactly as written (repeated keys survive), `application/json`.
    Json(String),
    /// A body with another content type.
    Typed(&'static str, String),
}

#[derive(Debug, Clone)]
struct Case {
    what: String,
    method: Method,
    path: String,
    auth: Auth,
    body: Body,
    status: u16,
    code: &'static str,
    param: Option<&'static str>,
}

fn case(what: impl Into<String>, method: Method, path: impl Into<String>, body: Body) -> Case {
    Case {
        what: what.into(),
        method,
        path: path.into(),
        auth: Auth::Admin,
        body,
        status: 400,
        code: "invalid_request",
        param: None,
    }
}

impl Case {
    fn auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    fn expect(mut self, status: u16, code: &'static str, param: Option<&'static str>) -> Self {
        self.status = status;
        self.code = code;
        self.param = param;
        self
    }

    fn bad(self, param: &'static str) -> Self {
        self.expect(400, "invalid_request", Some(param))
    }
}

fn post(what: impl Into<String>, path: &str, json: impl Into<String>) -> Case {
    case(what, Method::POST, path, Body::Json(json.into()))
}

fn get(what: impl Into<String>, path: impl Into<String>) -> Case {
    case(what, Method::GET, path, Body::Nothing)
}

/// A key body for the `demo` team with `field` set to `value` (JSON text).
fn key_with(field: &str, value: &str) -> String {
    format!(r#"{{"team": "demo", "{field}": {value}}}"#)
}

/// Every bad input of issue 10's findings 6 and 7 that the HTTP layer owns.
fn cases() -> Vec<Case> {
    let long_name = "n".repeat(2_700);
    let mut cases = vec![
        // Team names.
        post("team name of 2,700 characters", "/admin/teams", format!(r#"{{"name": "{long_name}"}}"#)).bad("name"),
        post("team name of 129 characters", "/admin/teams", format!(r#"{{"name": "{}"}}"#, "é".repeat(129))).bad("name"),
        post("NUL in a team name", "/admin/teams", r#"{"name": "a\u0000b"}"#).bad("name"),
        post("tab in a team name", "/admin/teams", r#"{"name": "a\tb"}"#).bad("name"),
        post("blank team name", "/admin/teams", r#"{"name": "   "}"#).bad("name"),
        post("empty team name", "/admin/teams", r#"{"name": ""}"#).bad("name"),
        post("team name with a leading space", "/admin/teams", r#"{"name": " research"}"#).bad("name"),
        post("team name that is an integer", "/admin/teams", r#"{"name": "42"}"#).bad("name"),
        post("team name that is not a string", "/admin/teams", r#"{"name": 42}"#).bad("name"),
        post("team name missing", "/admin/teams", "{}").bad("name"),
        post("team name given twice", "/admin/teams", r#"{"name": "a", "name": "b"}"#).bad("name"),
        post("unknown field in a team", "/admin/teams", r#"{"name": "a", "budget": 5}"#).bad("budget"),
        post("team name taken", "/admin/teams", r#"{"name": "demo"}"#).bad("name"),
        post("truncated JSON", "/admin/teams", r#"{"name": "#),
        post("team body not an object", "/admin/teams", r#"["research"]"#),
        case(
            "team body that is not JSON",
            Method::POST,
            "/admin/teams",
            Body::Typed("text/plain", r#"{"name": "research"}"#.into()),
        ),
        // Key limits.
        post("burst_refill_seconds 0", "/admin/keys", key_with("burst_refill_seconds", "0")).bad("burst_refill_seconds"),
        post("burst_refill_seconds over a day", "/admin/keys", key_with("burst_refill_seconds", "86401")).bad("burst_refill_seconds"),
        post("burst_capacity 0", "/admin/keys", key_with("burst_capacity", "0")).bad("burst_capacity"),
        post("negative rpm", "/admin/keys", key_with("rpm", "-1")).bad("rpm"),
        post("rpm over its maximum", "/admin/keys", key_with("rpm", "1000001")).bad("rpm"),
        post("fractional rpm", "/admin/keys", key_with("rpm", "1.5")).bad("rpm"),
        post("rpm as a string", "/admin/keys", key_with("rpm", r#""60""#)).bad("rpm"),
        post("tokens_per_day beyond i64", "/admin/keys", key_with("tokens_per_day", "9223372036854775808")).bad("tokens_per_day"),
        post("tokens_per_day beyond u64", "/admin/keys", key_with("tokens_per_day", "18446744073709551616")).bad("tokens_per_day"),
        post("max_streams over its maximum", "/admin/keys", key_with("max_streams", "100001")).bad("max_streams"),
        post("message_quota beyond u32", "/admin/keys", key_with("message_quota", "4294967296")).bad("message_quota"),
        post("expires_at not a time", "/admin/keys", key_with("expires_at", r#""tomorrow""#)).bad("expires_at"),
        post("expires_at without an offset", "/admin/keys", key_with("expires_at", r#""2030-01-01T00:00:00""#)).bad("expires_at"),
        post("expires_at in the past", "/admin/keys", key_with("expires_at", r#""2020-01-01T00:00:00Z""#)).bad("expires_at"),
        post("expires_at as a number", "/admin/keys", key_with("expires_at", "1893456000")).bad("expires_at"),
        post("unknown model in the allowlist", "/admin/keys", key_with("model_allowlist", r#"["small", "gpt-9"]"#)).bad("model_allowlist"),
        post("huge model name in the allowlist", "/admin/keys", key_with("model_allowlist", &format!(r#"["{long_name}"]"#))).bad("model_allowlist"),
        post("allowlist entry twice", "/admin/keys", key_with("model_allowlist", r#"["small", "small"]"#)).bad("model_allowlist"),
        post("allowlist not a list", "/admin/keys", key_with("model_allowlist", r#""small""#)).bad("model_allowlist"),
        post("key for an unknown team", "/admin/keys", r#"{"team": "no-such-team"}"#).expect(404, "not_found", Some("team")),
        post("key for an unknown team id", "/admin/keys", r#"{"team": 987654}"#).expect(404, "not_found", Some("team")),
        post("key for a team named with NUL", "/admin/keys", r#"{"team": "de\u0000mo"}"#).bad("team"),
        post("key for a team named by a boolean", "/admin/keys", r#"{"team": true}"#).bad("team"),
        post("key without a team", "/admin/keys", r#"{"rpm": 5}"#).bad("team"),
        post("unknown field in a key", "/admin/keys", key_with("rpn", "5")).bad("rpn"),
        post("rpm given twice", "/admin/keys", r#"{"team": "demo", "rpm": 5, "rpm": 0}"#).bad("rpm"),
        // Credits.
        post("credit of 0", "/admin/credits", r#"{"team": "demo", "amount": 0}"#).bad("amount"),
        post("fractional credit", "/admin/credits", r#"{"team": "demo", "amount": 1.5}"#).bad("amount"),
        post("credit as a string", "/admin/credits", r#"{"team": "demo", "amount": "5"}"#).bad("amount"),
        post("credit over its maximum", "/admin/credits", r#"{"team": "demo", "amount": 1000000000000001}"#).bad("amount"),
        post("debit over its maximum", "/admin/credits", r#"{"team": "demo", "amount": -1000000000000001}"#).bad("amount"),
        post("credit beyond i64", "/admin/credits", r#"{"team": "demo", "amount": 9223372036854775808}"#).bad("amount"),
        post("credit amount given twice", "/admin/credits", r#"{"team": "demo", "amount": 5, "amount": 5000000}"#).bad("amount"),
        post("credit for an unknown team", "/admin/credits", r#"{"team": "no-such-team", "amount": 5}"#).expect(404, "not_found", Some("team")),
        post("credit for a 2,700-character team name", "/admin/credits", format!(r#"{{"team": "{long_name}", "amount": 5}}"#)).bad("team"),
        // Nodes.
        post("node id with a space", "/admin/nodes", r#"{"node_id": "bad id!"}"#).bad("node_id"),
        post("node id of 129 characters", "/admin/nodes", format!(r#"{{"node_id": "{}"}}"#, "n".repeat(129))).bad("node_id"),
        post("NUL in a node id", "/admin/nodes", r#"{"node_id": "gpu\u0000"}"#).bad("node_id"),
        post("empty node id", "/admin/nodes", r#"{"node_id": ""}"#).bad("node_id"),
        post("unknown node location", "/admin/nodes", r#"{"node_id": "gpu-9", "location": "mars"}"#).bad("location"),
        post("node with a live token", "/admin/nodes", r#"{"node_id": "small-1"}"#).bad("node_id"),
        post("node id given twice", "/admin/nodes", r#"{"node_id": "gpu-9", "node_id": "gpu-10"}"#).bad("node_id"),
        case("drain of a malformed node id", Method::POST, "/admin/nodes/bad%20id/drain", Body::Nothing).bad("id"),
        case("token revocation of a malformed node id", Method::DELETE, "/admin/nodes/a%00b/token", Body::Nothing).bad("id"),
        post("load_model name given twice", "/admin/nodes/small-1/load_model", r#"{"name": "small", "name": "large"}"#).bad("name"),
        post("load_model of an unknown model", "/admin/nodes/small-1/load_model", r#"{"name": "gpt-9"}"#).expect(404, "model_not_found", Some("name")),
        // Query strings and path ids.
        get("team given twice in the query", "/admin/keys?team=1&team=2").bad("team"),
        get("keys without a team", "/admin/keys").bad("team"),
        get("keys of a team named with NUL", "/admin/keys?team=de%00mo").bad("team"),
        get("keys of an unknown team", "/admin/keys?team=no-such-team").expect(404, "not_found", Some("team")),
        case("revoke a non-numeric key id", Method::DELETE, "/admin/keys/abc", Body::Nothing).bad("id"),
        case("revoke a fractional key id", Method::DELETE, "/admin/keys/1.5", Body::Nothing).bad("id"),
        case("revoke a key id beyond i64", Method::DELETE, "/admin/keys/9223372036854775808", Body::Nothing).bad("id"),
        case("revoke an unknown key", Method::DELETE, "/admin/keys/987654", Body::Nothing).expect(404, "not_found", Some("id")),
        get("usage bound given twice", "/v1/usage?from=2026-01-01T00:00:00Z&from=2026-02-01T00:00:00Z").auth(Auth::Key).bad("from"),
        get("usage bound not a time", "/v1/usage?to=yesterday").auth(Auth::Key).bad("to"),
        get("usage without a credential, bad query", "/v1/usage?from=a&from=b").auth(Auth::Nothing).expect(401, "unauthorized", None),
        // Request bodies of the OpenAI API: repeated keys at any depth.
        post(
            "chat with model given twice",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "large"}"#,
        )
        .auth(Auth::Key)
        .bad("model"),
        post(
            "chat with a message's content given twice",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi", "content": "bye"}], "max_tokens": 2}"#,
        )
        .auth(Auth::Key)
        .bad("messages[0].content"),
        case("wrong method on a known route", Method::PUT, "/v1/chat/completions", Body::Nothing)
            .auth(Auth::Key)
            .expect(405, "invalid_request", None),
        get("the node socket without a WebSocket handshake", "/v1/nodes/connect")
            .auth(Auth::Nothing)
            .expect(400, "invalid_request", None),
        post(
            "chat with max_tokens of 2^58",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 288230376151711744}"#,
        )
        .auth(Auth::Key)
        .bad("max_tokens"),
        post(
            "chat with max_completion_tokens beyond u64",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 18446744073709551616}"#,
        )
        .auth(Auth::Key)
        .bad("max_completion_tokens"),
        post(
            "chat with max_tokens above the context",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8193}"#,
        )
        .auth(Auth::Key)
        .bad("max_tokens"),
        post(
            "chat with n of 2",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "n": 2}"#,
        )
        .auth(Auth::Key)
        .bad("n"),
        post(
            "chat with no messages",
            "/v1/chat/completions",
            r#"{"model": "small", "messages": []}"#,
        )
        .auth(Auth::Key)
        .bad("messages"),
        post(
            "chat with a prompt that fills the context",
            "/v1/chat/completions",
            format!(
                r#"{{"model": "small", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
                "word ".repeat(9_000)
            ),
        )
        .auth(Auth::Key)
        .expect(400, "context_length_exceeded", Some("messages")),
        post(
            "generation with max_output_tokens given twice",
            "/v1/generations",
            r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 2, "max_output_tokens": 900}"#,
        )
        .auth(Auth::Key)
        .bad("max_output_tokens"),
    ];
    // `Authorization`: exactly `Bearer`, one space, a credential; one header.
    let chat =
        r#"{"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;
    for (what, values) in [
        ("two spaces after Bearer", vec!["Bearer  {key}"]),
        ("a space inside the credential", vec!["Bearer {key} x"]),
        ("lower-case bearer", vec!["bearer {key}"]),
        ("Bearer without a credential", vec!["Bearer "]),
        (
            "two Authorization headers",
            vec!["Bearer {key}", "Bearer {key}"],
        ),
    ] {
        let values: Vec<String> = values.into_iter().map(String::from).collect();
        cases.push(
            get(format!("models, {what}"), "/v1/models")
                .auth(Auth::Raw(values.clone()))
                .expect(401, "unauthorized", None),
        );
        cases.push(
            post(format!("chat, {what}"), "/v1/chat/completions", chat)
                .auth(Auth::Raw(values.clone()))
                .expect(401, "unauthorized", None),
        );
        let admin: Vec<String> = values
            .iter()
            .map(|v| v.replace("{key}", "{admin}"))
            .collect();
        cases.push(
            get(format!("admin, {what}"), "/admin/teams")
                .auth(Auth::Raw(admin))
                .expect(401, "unauthorized", None),
        );
    }
    cases
}

/// Everything a refused request must leave as it was.
async fn snapshot(fleet: &switchyard::demo::Fleet) -> Value {
    let store = &fleet.store;
    let teams = store.teams().await.unwrap();
    let mut keys = Vec::new();
    for team in &teams {
        for k in store.api_keys(team.id).await.unwrap() {
            keys.push(json!([
                k.id,
                k.team_id,
                k.revoked_at,
                k.rpm,
                k.burst_refill_seconds
            ]));
        }
    }
    let nodes: Vec<Value> = store
        .nodes()
        .await
        .unwrap()
        .into_iter()
        .map(|n| json!([n.id, n.location, n.token_hash.is_some(), n.drained_at]))
        .collect();
    let ledger = store.ledger_rows(None).await.unwrap().len();
    json!({"teams": teams, "keys": keys, "nodes": nodes, "ledger_rows": ledger})
}

/// Texts that would betray a store, a parser or Rust types behind the answer.
const INTERNALS: [&str; 12] = [
    "conflict:",
    "invalid:",
    "store unavailable",
    "violates",
    "sqlx",
    "SQLSTATE",
    "index row",
    "Failed to deserialize",
    "Invalid URL",
    "u32",
    "u64",
    "i64",
];

async fn run_cases(fleet: &switchyard::demo::Fleet, backend: &str) {
    let base = fleet.server.base_url();
    let mut failures = Vec::new();
    for c in cases() {
        let before = snapshot(fleet).await;
        let mut req = http().request(c.method.clone(), format!("{base}{}", c.path));
        req = match &c.auth {
            Auth::Admin => req.bearer_auth(&fleet.admin_token),
            Auth::Key => req.bearer_auth(&fleet.api_key),
            Auth::Nothing => req,
            Auth::Raw(values) => {
                for v in values {
                    let v = v
                        .replace("{key}", &fleet.api_key)
                        .replace("{admin}", &fleet.admin_token);
                    req = req.header(reqwest::header::AUTHORIZATION, v);
                }
                req
            }
        };
        req = match &c.body {
            Body::Nothing => req,
            Body::Json(text) => req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(text.clone()),
            Body::Typed(ct, text) => req
                .header(reqwest::header::CONTENT_TYPE, *ct)
                .body(text.clone()),
        };
        if c.path.starts_with("/v1/generations") {
            req = req.header(
                "idempotency-key",
                format!("refusal-{}", rand::random::<u64>()),
            );
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let should_retry = resp
            .headers()
            .get("x-should-retry")
            .map(|v| v.to_str().unwrap_or_default().to_owned());
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let error = &body["error"];
        let message = error["message"].as_str().unwrap_or_default();
        let expected_type = match c.status {
            400 | 405 | 426 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            _ => "",
        };
        let mut wrong = Vec::new();
        if status != c.status {
            wrong.push(format!("status {status}, want {}", c.status));
        }
        if error["code"] != c.code {
            wrong.push(format!("code {}, want {}", error["code"], c.code));
        }
        if error["type"] != expected_type {
            wrong.push(format!("type {}, want {expected_type}", error["type"]));
        }
        if error["param"].as_str() != c.param {
            wrong.push(format!("param {}, want {:?}", error["param"], c.param));
        }
        if error["retryable"] != false || should_retry.as_deref() != Some("false") {
            wrong.push("not marked final".into());
        }
        if message.is_empty() || message.len() > 400 {
            wrong.push(format!("message of {} bytes", message.len()));
        }
        if let Some(p) = c.param
            && !message.contains(p)
            && c.code == "invalid_request"
        {
            wrong.push("the message does not name the field".into());
        }
        if let Some(leak) = INTERNALS.iter().find(|t| message.contains(*t)) {
            wrong.push(format!("the message shows internals ({leak})"));
        }
        let after = snapshot(fleet).await;
        if before != after {
            wrong.push(format!(
                "state changed:\n  before {before}\n  after  {after}"
            ));
        }
        if !wrong.is_empty() {
            failures.push(format!(
                "[{backend}] {} ({} {}): {}\n  body: {}",
                c.what,
                c.method,
                c.path.chars().take(80).collect::<String>(),
                wrong.join("; "),
                text.chars().take(300).collect::<String>()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} refusals are not clean:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_is_refused_cleanly_and_changes_nothing_on_sqlite() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    run_cases(&fleet, "sqlite").await;
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_is_refused_cleanly_and_changes_nothing_on_postgresql() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swtest:{:08x}:", rand::random::<u32>());
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 1)],
        time_scale: 20.0,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    let fleet = switchyard::demo::Fleet::start(config, &db_url)
        .await
        .unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    run_cases(&fleet, "postgresql").await;
    fleet.shutdown(Duration::from_secs(1)).await;
    clean_redis(&prefix).await;
    drop_pg(&db_name).await;
}

/// What a valid admin request still gets: the limits' edges are accepted, a revoked key
/// answers `revoked: true` again, and the store's own words never reach the client.
async fn edges_are_accepted(fleet: &switchyard::demo::Fleet) {
    let base = fleet.server.base_url();
    let admin = |method: Method, path: &str, body: Option<Value>| {
        let mut req = http()
            .request(method, format!("{base}{path}"))
            .bearer_auth(&fleet.admin_token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        async move {
            let r = req.send().await.unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let name = "é".repeat(128);
    let (s, team) = admin(Method::POST, "/admin/teams", Some(json!({"name": name}))).await;
    assert_eq!(
        (s, team["name"].as_str()),
        (201, Some(name.as_str())),
        "{team}"
    );
    let (s, key) = admin(
        Method::POST,
        "/admin/keys",
        Some(
            json!({"team": team["id"], "rpm": 1_000_000, "tokens_per_day": 1_000_000_000_000u64,
                    "max_streams": 0, "message_quota": 0, "burst_capacity": 1,
                    "burst_refill_seconds": 86_400, "expires_at": "2099-12-31T23:59:59+01:00",
                    "model_allowlist": ["small", "llama-3.1-8b-instruct"]}),
        ),
    )
    .await;
    assert_eq!(s, 201, "{key}");
    assert_eq!(key["burst_refill_seconds"], 86_400);
    let (s, credited) = admin(
        Method::POST,
        "/admin/credits",
        Some(json!({"team": name, "amount": -1_000_000_000_000_000i64})),
    )
    .await;
    assert_eq!(s, 200, "{credited}");
    let path = format!("/admin/keys/{}", key["id"]);
    for _ in 0..2 {
        let (s, revoked) = admin(Method::DELETE, &path, None).await;
        assert_eq!(
            (s, &revoked),
            (200, &json!({"id": key["id"], "revoked": true}))
        );
    }
    let (s, node) = admin(
        Method::POST,
        "/admin/nodes",
        Some(json!({"node_id": format!("A.b_c-{}", "9".repeat(122)), "location": "cloud"})),
    )
    .await;
    assert_eq!(s, 201, "{node}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_edges_are_accepted_on_both_backends() {
    let sqlite = fleet(&[("small", 1)], 20.0, |_| {}).await;
    edges_are_accepted(&sqlite).await;
    sqlite.shutdown(Duration::from_secs(1)).await;

    let (db_url, db_name) = fresh_pg().await;
    let mut config = switchyard::demo::FleetConfig {
        nodes: vec![("small".into(), 1)],
        time_scale: 20.0,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    let pg = switchyard::demo::Fleet::start(config, &db_url)
        .await
        .unwrap();
    edges_are_accepted(&pg).await;
    pg.shutdown(Duration::from_secs(1)).await;
    drop_pg(&db_name).await;
}
