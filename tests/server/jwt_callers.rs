//! JWT callers: a token verified against a JWKS served here names its principal, team and
//! role; the admin role opens the admin API; bad tokens are 401 and never reach an engine.

use std::time::Duration;

use axum::routing::get;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::common::{fleet, http};

const AUD: &str = "switchyard-api";
const ISS: &str = "https://idp.example.test/";

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/tests/fixtures/jwt/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

/// Standard base64, for the DER inside the PEM fixture.
fn b64(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

fn token(claims: Value) -> String {
    let pem = fixture("rsa-a.pem");
    let der = b64(&pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<String>());
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some("rsa-a".into());
    jsonwebtoken::encode(&header, &claims, &EncodingKey::from_rsa_der(&der)).unwrap()
}

fn claims(extra: Value) -> Value {
    let mut c = json!({"sub": "alice", "aud": AUD, "iss": ISS, "exp": chrono::Utc::now().timestamp() + 600});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_callers_use_the_api_and_admins_the_admin_api() {
    let jwks =
        json!({"keys": [serde_json::from_str::<Value>(&fixture("rsa-a.jwk.json")).unwrap()]})
            .to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let jwks_url = format!("http://{}/jwks", listener.local_addr().unwrap());
    let app = axum::Router::new().route("/jwks", get(move || async move { jwks }));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let fleet = fleet(&[("small", 1)], 20.0, |c| {
        c.server.jwks_url = Some(jwks_url.clone());
        c.server.jwt_audience = Some(AUD.into());
        c.server.jwt_issuer = Some(ISS.into());
    })
    .await;
    let chat = |bearer: String| {
        let url = format!("{}/chat/completions", fleet.openai_base_url());
        async move {
            let r = http()
                .post(url)
                .bearer_auth(bearer)
                .json(&json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let user = token(claims(json!({"team": "demo", "role": "user"})));
    let (s, body) = chat(user.clone()).await;
    assert_eq!(s, 200, "{body}");
    let row = &fleet.store.ledger_rows(Some(fleet.team_id)).await.unwrap()[0];
    assert_eq!(row.key_id, None, "billed to the token's team, no key");

    for (bad, why) in [
        (
            token(claims(
                json!({"team": "demo", "exp": chrono::Utc::now().timestamp() - 3600}),
            )),
            "expired",
        ),
        (
            token(claims(json!({"team": "demo", "aud": "someone-else"}))),
            "wrong audience",
        ),
        (
            token(claims(json!({"team": "demo", "iss": "https://evil.test/"}))),
            "wrong issuer",
        ),
        (token(claims(json!({}))), "no team"),
        (
            token(claims(json!({"team": "no-such-team"}))),
            "unknown team",
        ),
    ] {
        let (s, body) = chat(bad).await;
        assert_eq!(s, 401, "{why}: {body}");
        assert_eq!(body["error"]["code"], "unauthorized");
    }

    let admin_url = format!("{}/admin/teams", fleet.server.base_url());
    let as_user = http()
        .get(&admin_url)
        .bearer_auth(&user)
        .send()
        .await
        .unwrap();
    assert_eq!(as_user.status(), 403);
    let admin = token(claims(json!({"team": "demo", "role": "admin"})));
    let as_admin = http()
        .get(&admin_url)
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(as_admin.status(), 200);
    assert_eq!(
        fleet.nodes[0].sim.stats().generation_tokens,
        2,
        "only the valid request reached the engine"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// A JWKS whose document the test can change (a key rotation at the identity provider).
async fn rotating_jwks(kids: &[&str]) -> (String, std::sync::Arc<std::sync::Mutex<String>>) {
    let doc = |kids: &[&str]| {
        let keys: Vec<Value> = kids
            .iter()
            .map(|k| serde_json::from_str(&fixture(&format!("{k}.jwk.json"))).unwrap())
            .collect();
        json!({ "keys": keys }).to_string()
    };
    let served = std::sync::Arc::new(std::sync::Mutex::new(doc(kids)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jwks", listener.local_addr().unwrap());
    let state = served.clone();
    let app = axum::Router::new().route(
        "/jwks",
        get(move || {
            let state = state.clone();
            async move { state.lock().unwrap().clone() }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, served)
}

fn token_by(key: &str, claims: Value) -> String {
    let pem = fixture(&format!("{key}.pem"));
    let der = b64(&pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<String>());
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(key.into());
    jsonwebtoken::encode(&header, &claims, &EncodingKey::from_rsa_der(&der)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_published_just_after_the_last_fetch_gets_a_retryable_503_with_retry_after() {
    let (jwks_url, served) = rotating_jwks(&["rsa-a"]).await;
    let fleet = fleet(&[("small", 1)], 20.0, |c| {
        c.server.jwks_url = Some(jwks_url.clone());
        c.server.jwt_audience = Some(AUD.into());
        c.server.jwt_issuer = Some(ISS.into());
    })
    .await;
    let models = |bearer: String| {
        let url = format!("{}/models", fleet.openai_base_url());
        async move { http().get(url).bearer_auth(bearer).send().await.unwrap() }
    };
    let first = models(token_by("rsa-a", claims(json!({"team": "demo"})))).await;
    assert_eq!(first.status(), 200, "the first token fetches the keys");

    // The identity provider rotates and signs with the new key at once, well inside the
    // 30 s during which the gateway does not fetch its keys again.
    let keys: Vec<Value> = ["rsa-a", "rsa-b"]
        .iter()
        .map(|k| serde_json::from_str(&fixture(&format!("{k}.jwk.json"))).unwrap())
        .collect();
    *served.lock().unwrap() = json!({ "keys": keys }).to_string();
    let rotated = models(token_by("rsa-b", claims(json!({"team": "demo"})))).await;
    assert_eq!(rotated.status(), 503, "retryable, not a final 401");
    let retry_after: u64 = rotated.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    assert!(rotated.headers().get("x-should-retry").is_none());
    let body: Value = rotated.json().await.unwrap();
    assert_eq!(body["error"]["code"], "quota_service_unavailable");
    assert_eq!(body["error"]["retryable"], true);
    assert_eq!(body["error"]["type"], "service_unavailable_error");

    // The same on the admin API, which verifies JWTs the same way.
    let admin = http()
        .get(format!("{}/admin/teams", fleet.server.base_url()))
        .bearer_auth(token_by("rsa-b", claims(json!({"role": "admin"}))))
        .send()
        .await
        .unwrap();
    assert_eq!(admin.status(), 503);
    assert!(admin.headers().get("retry-after").is_some());
    fleet.shutdown(Duration::from_secs(1)).await;
}
