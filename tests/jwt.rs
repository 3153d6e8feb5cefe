//! Integration tests of JWT verification (`switchyard::jwt`) against a JWKS served by the
//! test itself on 127.0.0.1:0, whose document the test swaps (key rotation, outages) and
//! whose hits it counts (caching, throttling, single-flight). Signing keys are fixtures in
//! `tests/fixtures/jwt/` (see the README there), so everything runs offline.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use switchyard::jwt::{Claims, JwtConfig, JwtError, JwtVerifier, Role};

const AUD: &str = "switchyard-api";
const ISS: &str = "https://idp.example.test/";

// ---------------------------------------------------------------------------------------
// The JWKS endpoint
// ---------------------------------------------------------------------------------------

/// What the fake identity provider does when asked for its JWKS.
#[derive(Debug, Clone)]
enum Mode {
    /// Answer 200 with this document.
    Serve(String),
    /// Answer 503.
    Down,
    /// Never answer (well, not within any timeout under test).
    Hang,
    /// Answer 200 with a chunked body of this many bytes and no Content-Length.
    StreamBytes(usize),
}

#[derive(Debug)]
struct JwksState {
    mode: Mutex<Mode>,
    hits: AtomicUsize,
    /// Added to every answer, to widen the window in which fetches overlap.
    delay: Mutex<Duration>,
}

#[derive(Debug, Clone)]
struct JwksServer {
    state: Arc<JwksState>,
    url: String,
}

impl JwksServer {
    async fn start(mode: Mode) -> Self {
        let state = Arc::new(JwksState {
            mode: Mutex::new(mode),
            hits: AtomicUsize::new(0),
            delay: Mutex::new(Duration::ZERO),
        });
        let app = Router::new()
            .route("/.well-known/jwks.json", get(serve_jwks))
            .with_state(Arc::clone(&state));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            state,
            url: format!("http://{addr}/.well-known/jwks.json"),
        }
    }

    async fn serving(kids: &[&str]) -> Self {
        Self::start(Mode::Serve(jwks(kids))).await
    }

    fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
    }

    fn set_delay(&self, delay: Duration) {
        *self.state.delay.lock().unwrap() = delay;
    }

    fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    fn config(&self) -> JwtConfig {
        JwtConfig::new(self.url.clone(), AUD, ISS)
    }
}

async fn serve_jwks(State(state): State<Arc<JwksState>>) -> Response {
    state.hits.fetch_add(1, Ordering::SeqCst);
    let delay = *state.delay.lock().unwrap();
    let mode = state.mode.lock().unwrap().clone();
    tokio::time::sleep(delay).await;
    match mode {
        Mode::Serve(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Mode::Down => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Mode::Hang => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            StatusCode::GATEWAY_TIMEOUT.into_response()
        }
        Mode::StreamBytes(n) => {
            let chunk = bytes::Bytes::from(vec![b' '; 64 * 1024]);
            let chunks =
                (0..n.div_ceil(chunk.len())).map(move |_| Ok::<_, Infallible>(chunk.clone()));
            Body::from_stream(futures::stream::iter(chunks)).into_response()
        }
    }
}

// ---------------------------------------------------------------------------------------
// Keys and tokens
// ---------------------------------------------------------------------------------------

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/jwt/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A JWKS document holding the public JWKs of the named fixture keys.
fn jwks(kids: &[&str]) -> String {
    let keys: Vec<Value> = kids
        .iter()
        .map(|kid| serde_json::from_str(&fixture(&format!("{kid}.jwk.json"))).unwrap())
        .collect();
    json!({ "keys": keys }).to_string()
}

/// The DER inside a PEM fixture: PKCS#1 for the RSA keys, PKCS#8 for the EC key, which is
/// what jsonwebtoken's `from_rsa_der`/`from_ec_der` expect without its `use_pem` feature.
fn pem_der(name: &str) -> Vec<u8> {
    let pem = fixture(&format!("{name}.pem"));
    let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    b64_decode(&b64)
}

fn rsa_key(name: &str) -> EncodingKey {
    EncodingKey::from_rsa_der(&pem_der(name))
}

fn ec_key(name: &str) -> EncodingKey {
    EncodingKey::from_ec_der(&pem_der(name))
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

/// Valid claims for `sub = alice`, with `changes` applied (a `null` removes the claim).
fn claims(changes: Value) -> Value {
    let mut c = json!({ "sub": "alice", "aud": AUD, "iss": ISS, "exp": now() + 600 });
    for (k, v) in changes.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    c
}

fn sign(alg: Algorithm, kid: &str, key: &EncodingKey, claims: &Value) -> String {
    let mut header = Header::new(alg);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(&header, claims, key).unwrap()
}

fn rsa_token(kid: &str, key_name: &str, changes: Value) -> String {
    sign(Algorithm::RS256, kid, &rsa_key(key_name), &claims(changes))
}

/// A token whose header is exactly `header` (any `alg`, including ones the library cannot
/// produce) over valid claims, with the given signature segment.
fn raw_token(header: &Value, signature: &str) -> String {
    format!(
        "{}.{}.{signature}",
        b64url(header.to_string().as_bytes()),
        b64url(claims(json!({})).to_string().as_bytes())
    )
}

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn b64_decode(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

fn verifier(cfg: JwtConfig) -> JwtVerifier {
    JwtVerifier::new(cfg, reqwest::Client::new())
}

// ---------------------------------------------------------------------------------------
// Valid tokens
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn jwt_valid_admin_token_verifies_and_keys_are_cached() {
    let idp = JwksServer::serving(&["rsa-a", "ec-a"]).await;
    let v = verifier(idp.config());
    let exp = now() + 600;
    let token = rsa_token(
        "rsa-a",
        "rsa-a",
        json!({ "role": "admin", "team": "ml-platform", "exp": exp }),
    );
    let got = v.verify(&token).await.unwrap();
    assert_eq!(
        got,
        Claims {
            sub: "alice".into(),
            team: Some("ml-platform".into()),
            role: Role::Admin,
            exp,
            service_tiers: None,
            service_tier: None,
        }
    );
    assert_eq!(idp.hits(), 1);

    // A clone shares the cache; an `aud` array naming us is accepted too.
    let clone = v.clone();
    let token = rsa_token("rsa-a", "rsa-a", json!({ "aud": ["other", AUD] }));
    assert_eq!(clone.verify(&token).await.unwrap().role, Role::User);
    assert_eq!(idp.hits(), 1, "cached keys must be reused");
}

#[tokio::test]
async fn jwt_valid_user_token_with_integer_team_verifies() {
    let idp = JwksServer::serving(&["rsa-a", "ec-a"]).await;
    let v = verifier(idp.config());
    let key = ec_key("ec-a");
    let token = sign(
        Algorithm::ES256,
        "ec-a",
        &key,
        &claims(json!({ "sub": "bob", "role": "user", "team": 42 })),
    );
    let got = v.verify(&token).await.unwrap();
    assert_eq!(got.sub, "bob");
    assert_eq!(got.team.as_deref(), Some("42"));
    assert_eq!(got.role, Role::User);

    // No role and no team: a plain user of no team.
    let token = sign(Algorithm::ES256, "ec-a", &key, &claims(json!({})));
    let got = v.verify(&token).await.unwrap();
    assert_eq!((got.role, got.team), (Role::User, None));
}

// ---------------------------------------------------------------------------------------
// Claims that must be refused
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn jwt_expired_and_not_yet_valid_tokens_are_refused_beyond_the_leeway() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    let v = verifier(idp.config());
    let key = rsa_key("rsa-a");
    let t = |changes| sign(Algorithm::RS256, "rsa-a", &key, &claims(changes));

    let expired = t(json!({ "exp": now() - 3600 }));
    assert_eq!(v.verify(&expired).await, Err(JwtError::Expired));
    // Within the 30 s leeway.
    assert!(v.verify(&t(json!({ "exp": now() - 10 }))).await.is_ok());
    let future = t(json!({ "nbf": now() + 3600 }));
    assert_eq!(v.verify(&future).await, Err(JwtError::Expired));
    let no_exp = t(json!({ "exp": null }));
    assert_eq!(v.verify(&no_exp).await, Err(JwtError::Malformed));
    let no_sub = t(json!({ "sub": null }));
    assert_eq!(v.verify(&no_sub).await, Err(JwtError::Malformed));
}

#[tokio::test]
async fn jwt_wrong_audience_and_wrong_issuer_are_refused() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    let v = verifier(idp.config());
    let key = rsa_key("rsa-a");
    let t = |changes| sign(Algorithm::RS256, "rsa-a", &key, &claims(changes));

    let cases = [
        (json!({ "aud": "someone-else" }), JwtError::WrongAudience),
        (json!({ "aud": ["a", "b"] }), JwtError::WrongAudience),
        (json!({ "aud": null }), JwtError::WrongAudience),
        (
            json!({ "iss": "https://evil.example.test/" }),
            JwtError::WrongIssuer,
        ),
        (json!({ "iss": null }), JwtError::WrongIssuer),
    ];
    for (changes, want) in cases {
        assert_eq!(v.verify(&t(changes.clone())).await, Err(want), "{changes}");
    }
}

#[tokio::test]
async fn jwt_none_and_hmac_algorithms_are_refused_before_any_key_is_fetched() {
    let idp = JwksServer::serving(&["rsa-a", "ec-a"]).await;
    // Even a configuration that asks for HS256 does not get it.
    let mut cfg = idp.config();
    cfg.algorithms.push(Algorithm::HS256);
    for v in [verifier(idp.config()), verifier(cfg)] {
        for alg in [
            "none", "None", "NONE", "HS256", "HS512", "RS512", "PS256", "EdDSA", "",
        ] {
            let token = raw_token(&json!({ "alg": alg, "kid": "rsa-a" }), "");
            assert_eq!(
                v.verify(&token).await,
                Err(JwtError::AlgorithmNotAllowed),
                "{alg}"
            );
        }
        // A real HS256 token keyed with the RSA public key: the classic confusion attack.
        let n = serde_json::from_str::<Value>(&fixture("rsa-a.jwk.json")).unwrap()["n"]
            .as_str()
            .unwrap()
            .to_owned();
        let hmac = EncodingKey::from_secret(n.as_bytes()).unwrap();
        let token = sign(Algorithm::HS256, "rsa-a", &hmac, &claims(json!({})));
        assert_eq!(v.verify(&token).await, Err(JwtError::AlgorithmNotAllowed));
    }
    assert_eq!(idp.hits(), 0, "refused from the header alone");

    // An allowed algorithm that does not fit the named key is refused too.
    let v = verifier(idp.config());
    let token = sign(
        Algorithm::ES256,
        "rsa-a",
        &ec_key("ec-a"),
        &claims(json!({})),
    );
    assert_eq!(v.verify(&token).await, Err(JwtError::AlgorithmNotAllowed));
}

#[tokio::test]
async fn jwt_bad_signatures_and_malformed_tokens_are_refused() {
    let idp = JwksServer::serving(&["rsa-a", "rsa-b"]).await;
    let v = verifier(idp.config());

    // Signed by rsa-b but claiming to be rsa-a.
    let forged = rsa_token("rsa-a", "rsa-b", json!({}));
    assert_eq!(v.verify(&forged).await, Err(JwtError::BadSignature));

    // A genuine token whose claims were edited (role escalation).
    let genuine = rsa_token("rsa-a", "rsa-a", json!({ "role": "user" }));
    let mut parts: Vec<&str> = genuine.split('.').collect();
    let escalated = b64url(claims(json!({ "role": "admin" })).to_string().as_bytes());
    parts[1] = &escalated;
    assert_eq!(
        v.verify(&parts.join(".")).await,
        Err(JwtError::BadSignature)
    );

    for junk in ["", "garbage", "a.b", "a.b.c.d", "e30.e30.e30", "!!.e30.sig"] {
        assert_eq!(v.verify(junk).await, Err(JwtError::Malformed), "{junk:?}");
    }
    // No kid at all: there is no key to pick.
    let no_kid = raw_token(&json!({ "alg": "RS256" }), "c2ln");
    assert_eq!(v.verify(&no_kid).await, Err(JwtError::UnknownKid));
}

// ---------------------------------------------------------------------------------------
// Key rotation, throttling, single-flight
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn jwt_rotated_key_is_picked_up_by_a_single_refresh() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    let interval = Duration::from_millis(600);
    let mut cfg = idp.config();
    cfg.refresh_min_interval = interval;
    let v = verifier(cfg);
    let old = rsa_token("rsa-a", "rsa-a", json!({}));
    let new = rsa_token("rsa-b", "rsa-b", json!({ "sub": "carol" }));

    v.verify(&old).await.unwrap();
    assert_eq!(idp.hits(), 1);

    // Right after a fetch, an unknown kid does not trigger another one: it is not fetched
    // yet, and the caller is told when it may be.
    match v.verify(&new).await {
        Err(JwtError::KeyNotFetchedYet { retry_after }) => assert!(
            !retry_after.is_zero() && retry_after <= interval,
            "{retry_after:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(idp.hits(), 1, "throttled");

    // The provider rotates: the new key is published next to the old one.
    idp.set_mode(Mode::Serve(jwks(&["rsa-a", "rsa-b"])));
    tokio::time::sleep(interval + Duration::from_millis(50)).await;
    assert_eq!(v.verify(&new).await.unwrap().sub, "carol");
    assert_eq!(idp.hits(), 2, "one refresh");
    // Both keys now verify from the cache.
    v.verify(&new).await.unwrap();
    v.verify(&old).await.unwrap();
    assert_eq!(idp.hits(), 2);
}

#[tokio::test]
async fn jwt_a_key_published_just_after_a_fetch_is_retryable_until_the_next_fetch() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    let interval = Duration::from_millis(800);
    let mut cfg = idp.config();
    cfg.refresh_min_interval = interval;
    let v = verifier(cfg);
    v.verify(&rsa_token("rsa-a", "rsa-a", json!({})))
        .await
        .unwrap();
    assert_eq!(idp.hits(), 1);

    // The IdP rotates moments after our fetch and signs with the new key at once.
    idp.set_mode(Mode::Serve(jwks(&["rsa-a", "rsa-b"])));
    let new = rsa_token("rsa-b", "rsa-b", json!({ "sub": "carol" }));
    let started = Instant::now();
    let retry_after = match v.verify(&new).await {
        Err(JwtError::KeyNotFetchedYet { retry_after }) => retry_after,
        other => panic!("a final answer while the throttle holds: {other:?}"),
    };
    assert!(
        retry_after <= interval && retry_after + started.elapsed() >= interval / 2,
        "{retry_after:?}"
    );
    assert_eq!(idp.hits(), 1, "the throttle holds");

    // A client that waits as told gets through, with one more fetch.
    tokio::time::sleep(retry_after + Duration::from_millis(20)).await;
    assert_eq!(v.verify(&new).await.unwrap().sub, "carol");
    assert_eq!(idp.hits(), 2);

    // A kid the IdP never publishes: "retry" while throttled, then final once a fresh
    // fetch (made for this token) does not have it.
    let stranger = rsa_token("rsa-x", "rsa-b", json!({}));
    let retry_after = match v.verify(&stranger).await {
        Err(JwtError::KeyNotFetchedYet { retry_after }) => retry_after,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(retry_after + Duration::from_millis(20)).await;
    assert_eq!(v.verify(&stranger).await, Err(JwtError::UnknownKid));
    assert_eq!(idp.hits(), 3);
    // A token without any kid names no key that could appear: final at once.
    let no_kid = raw_token(&json!({ "alg": "RS256" }), "c2ln");
    assert_eq!(v.verify(&no_kid).await, Err(JwtError::UnknownKid));

    // A key the last rotation dropped is revoked at once, not "retry later".
    tokio::time::sleep(interval + Duration::from_millis(20)).await;
    idp.set_mode(Mode::Serve(jwks(&["rsa-b"])));
    assert_eq!(v.verify(&stranger).await, Err(JwtError::UnknownKid));
    assert_eq!(idp.hits(), 4);
    let old = rsa_token("rsa-a", "rsa-a", json!({}));
    assert_eq!(v.verify(&old).await, Err(JwtError::UnknownKid));
    assert_eq!(idp.hits(), 4);
}

/// A token naming a random kid; its signature is never looked at (the kid is unknown).
fn random_kid_token() -> String {
    let kid = format!("attacker-{:016x}", rand::random::<u64>());
    raw_token(&json!({ "alg": "RS256", "kid": kid }), "c2lnbmF0dXJl")
}

async fn flood(v: &JwtVerifier, n: usize) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let v = v.clone();
            let token = random_kid_token();
            tokio::spawn(async move { v.verify(&token).await })
        })
        .collect();
    for t in tasks {
        // Refused: finally after a fetch this flood waited for, or "retry later" when the
        // throttle kept it from fetching; never accepted.
        let got = t.await.unwrap();
        assert!(
            matches!(
                got,
                Err(JwtError::UnknownKid | JwtError::KeyNotFetchedYet { .. })
            ),
            "{got:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_a_flood_of_unknown_kids_fetches_at_most_once_per_interval() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    // Slow answers keep every fetch in flight while the flood arrives.
    idp.set_delay(Duration::from_millis(100));
    let interval = Duration::from_millis(800);
    let mut cfg = idp.config();
    cfg.refresh_min_interval = interval;
    let v = verifier(cfg);

    // Cold cache: 100 concurrent tokens share one fetch.
    flood(&v, 100).await;
    assert_eq!(idp.hits(), 1);
    // Warm cache, inside the interval: no fetch at all.
    flood(&v, 100).await;
    assert_eq!(idp.hits(), 1);
    // Past the interval: the whole flood is worth exactly one refresh.
    tokio::time::sleep(interval + Duration::from_millis(50)).await;
    flood(&v, 100).await;
    assert_eq!(idp.hits(), 2);
    flood(&v, 100).await;
    assert_eq!(idp.hits(), 2);

    // Legitimate traffic is unaffected.
    v.verify(&rsa_token("rsa-a", "rsa-a", json!({})))
        .await
        .unwrap();
    assert_eq!(idp.hits(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_concurrent_first_verifications_share_one_fetch() {
    let idp = JwksServer::serving(&["rsa-a"]).await;
    idp.set_delay(Duration::from_millis(200));
    let v = verifier(idp.config());
    let token = rsa_token("rsa-a", "rsa-a", json!({}));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (v, token) = (v.clone(), token.clone());
            tokio::spawn(async move { v.verify(&token).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(idp.hits(), 1);
}

// ---------------------------------------------------------------------------------------
// The JWKS endpoint failing
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn jwt_jwks_down_is_unavailable_but_cached_keys_still_verify() {
    let token = rsa_token("rsa-a", "rsa-a", json!({}));

    // Nothing listening at all.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let cfg = JwtConfig::new(format!("http://{closed}/jwks"), AUD, ISS);
    match verifier(cfg).verify(&token).await {
        Err(JwtError::JwksUnavailable(why)) => assert!(why.contains("unreachable"), "{why}"),
        other => panic!("{other:?}"),
    }
    // An https:// URL fails cleanly too (this build's reqwest may have no TLS at all).
    let cfg = JwtConfig::new(format!("https://{closed}/jwks"), AUD, ISS);
    let got = verifier(cfg).verify(&token).await;
    assert!(matches!(got, Err(JwtError::JwksUnavailable(_))), "{got:?}");

    // Answering 503 before any key was cached.
    let idp = JwksServer::start(Mode::Down).await;
    let v = verifier(idp.config());
    match v.verify(&token).await {
        Err(JwtError::JwksUnavailable(why)) => assert!(why.contains("503"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(idp.hits(), 1);
    // Failures are throttled too: the next verification does not retry at once.
    assert!(matches!(
        v.verify(&token).await,
        Err(JwtError::JwksUnavailable(_))
    ));
    assert_eq!(idp.hits(), 1);

    // With keys cached, an outage does not lock anyone out, even past the cache TTL.
    let idp = JwksServer::serving(&["rsa-a"]).await;
    let mut cfg = idp.config();
    cfg.cache_ttl = Duration::from_millis(400);
    cfg.refresh_min_interval = Duration::from_millis(200);
    let v = verifier(cfg);
    v.verify(&token).await.unwrap();
    idp.set_mode(Mode::Down);
    v.verify(&token).await.unwrap();
    assert_eq!(idp.hits(), 1, "fresh cache, no fetch");
    tokio::time::sleep(Duration::from_millis(450)).await;
    v.verify(&token).await.unwrap();
    assert_eq!(
        idp.hits(),
        2,
        "stale cache revalidated, failed, stale key served"
    );
    // An unknown kid cannot be checked while the provider is down.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let rotated = rsa_token("rsa-b", "rsa-b", json!({}));
    assert!(matches!(
        v.verify(&rotated).await,
        Err(JwtError::JwksUnavailable(_))
    ));
    assert_eq!(idp.hits(), 3);

    // Back up with a rotation: the new key verifies; the dropped one is revoked.
    idp.set_mode(Mode::Serve(jwks(&["rsa-b"])));
    tokio::time::sleep(Duration::from_millis(250)).await;
    v.verify(&rotated).await.unwrap();
    assert_eq!(v.verify(&token).await, Err(JwtError::UnknownKid));
}

#[tokio::test]
async fn jwt_slow_or_oversized_jwks_is_refused() {
    let token = rsa_token("rsa-a", "rsa-a", json!({}));

    let hanging = JwksServer::start(Mode::Hang).await;
    let started = Instant::now();
    match verifier(hanging.config()).verify(&token).await {
        Err(JwtError::JwksUnavailable(why)) => assert!(why.contains("timed out"), "{why}"),
        other => panic!("{other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(2900) && took < Duration::from_secs(5),
        "{took:?}"
    );

    // Declared too large, and streamed too large without a length.
    let mut doc = jwks(&["rsa-a"]);
    doc.insert_str(1, &format!("\"pad\": \"{}\", ", "x".repeat(1024 * 1024)));
    for mode in [Mode::Serve(doc), Mode::StreamBytes(2 * 1024 * 1024)] {
        let idp = JwksServer::start(mode).await;
        match verifier(idp.config()).verify(&token).await {
            Err(JwtError::JwksUnavailable(why)) => assert!(why.contains("larger"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    // Just under the cap is fine.
    let mut doc = jwks(&["rsa-a"]);
    doc.insert_str(1, &format!("\"pad\": \"{}\", ", "x".repeat(1000 * 1000)));
    let idp = JwksServer::start(Mode::Serve(doc)).await;
    verifier(idp.config()).verify(&token).await.unwrap();
}
