//! JWT verification against an identity provider's JWKS URL (SPEC §6). Owns the key cache:
//! keys are fetched once, reused for `cache_ttl`, refreshed when a token names an unknown
//! `kid` (at most once per `refresh_min_interval`), and every refresh is single-flight. A
//! `kid` unknown while the throttle holds is "not fetched yet" (retry), not "unknown" (final).
//! Tokens and key material never reach a log.

mod keys;
mod token;

pub use keys::http_client;

use std::str::FromStr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, AlgorithmFamily, Validation};
use serde_json::{Map, Value};
use switchyard_actors::ports::{Clock, SystemClock};
use switchyard_actors::tier::Tier;

use keys::{KeySet, VerificationKey};

/// Where the keys are and what a token must say to be accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtConfig {
    /// The identity provider's JWKS document.
    pub jwks_url: String,
    /// Required `aud` (a token's `aud` string, or one member of its `aud` array).
    pub audience: String,
    /// Required `iss`.
    pub issuer: String,
    /// Unknown-`kid` refreshes happen at most this often, so a flood of tokens with random
    /// kids cannot hammer the JWKS endpoint. Any fetch, and any failed one, starts the
    /// interval.
    pub refresh_min_interval: Duration,
    /// A fetched JWKS is reused this long before it is fetched again.
    pub cache_ttl: Duration,
    /// The only algorithms accepted. Only the RSA and EC families are honoured: HMAC
    /// (HS*) and anything else are dropped at construction, and `none` cannot be named.
    pub algorithms: Vec<Algorithm>,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    pub leeway_secs: u64,
}

impl JwtConfig {
    /// Default for [`JwtConfig::refresh_min_interval`].
    pub const DEFAULT_REFRESH_MIN_INTERVAL: Duration = Duration::from_secs(30);
    /// Default for [`JwtConfig::cache_ttl`].
    pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(10 * 60);
    /// Default for [`JwtConfig::leeway_secs`].
    pub const DEFAULT_LEEWAY_SECS: u64 = 30;

    /// A configuration with the defaults: refresh at most every 30 s, cache 10 min,
    /// RS256 and ES256 only, 30 s leeway.
    pub fn new(
        jwks_url: impl Into<String>,
        audience: impl Into<String>,
        issuer: impl Into<String>,
    ) -> Self {
        Self {
            jwks_url: jwks_url.into(),
            audience: audience.into(),
            issuer: issuer.into(),
            refresh_min_interval: Self::DEFAULT_REFRESH_MIN_INTERVAL,
            cache_ttl: Self::DEFAULT_CACHE_TTL,
            algorithms: vec![Algorithm::RS256, Algorithm::ES256],
            leeway_secs: Self::DEFAULT_LEEWAY_SECS,
        }
    }
}

/// Who a verified token speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The principal (`sub`).
    pub sub: String,
    /// The team (`team`), an id or a unique name; integer claims arrive as their decimal text.
    pub team: Option<String>,
    /// `role`; a token without one is a plain user.
    pub role: Role,
    /// Expiry, Unix seconds.
    pub exp: i64,
    /// `service_tiers`: the tiers the principal may use (absent: the configured default).
    pub service_tiers: Option<Vec<Tier>>,
    /// `service_tier`: its tier when a request names none (absent: the configured default,
    /// or the best of `service_tiers`).
    pub service_tier: Option<Tier>,
}

/// What a JWT principal may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// May use the admin API.
    Admin,
    /// May use the OpenAI-compatible API only.
    #[default]
    User,
}

/// Why a token was refused. The texts are safe to return to a client: they carry no token
/// contents and no upstream details beyond a short cause.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    /// Not a well-formed JWT, or its claims are missing or of the wrong type.
    #[error("malformed token")]
    Malformed,
    /// The `kid` is in neither the cached nor a freshly fetched JWKS (or is absent).
    #[error("token signed by an unknown key")]
    UnknownKid,
    /// The signature does not verify with the named key.
    #[error("invalid token signature")]
    BadSignature,
    /// Past `exp` (or before `nbf`), beyond the leeway.
    #[error("token expired or not yet valid")]
    Expired,
    /// `aud` missing or not the configured audience.
    #[error("token audience not accepted")]
    WrongAudience,
    /// `iss` missing or not the configured issuer.
    #[error("token issuer not accepted")]
    WrongIssuer,
    /// The header's `alg` is not pinned, or does not fit the key it names.
    #[error("token algorithm not allowed")]
    AlgorithmNotAllowed,
    /// The keys could not be fetched and none usable is cached; the text is a short cause.
    #[error("signing keys unavailable: {0}")]
    JwksUnavailable(String),
    /// The `kid` is not in the JWKS, which was fetched less than `refresh_min_interval` ago
    /// and may not be fetched again yet. The key may have been published since (a rotation
    /// under way), so the token is neither accepted nor finally refused: the caller should
    /// retry after `retry_after`, when a fetch is allowed and decides.
    #[error("token signed by a key not fetched yet")]
    KeyNotFetchedYet {
        /// Until the next fetch is allowed.
        retry_after: Duration,
    },
}

/// Verifies bearer JWTs. Cheap to clone; clones share one key cache.
#[derive(Clone)]
pub struct JwtVerifier {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: JwtConfig,
    http: reqwest::Client,
    clock: Arc<dyn Clock>,
    /// Read on every verification; written only by the holder of `fetch_gate`.
    shared: RwLock<Shared>,
    /// Single-flight: whoever holds it is the only one fetching the JWKS.
    fetch_gate: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Shared {
    /// The last JWKS fetched successfully.
    keys: Option<Arc<KeySet>>,
    /// Completed fetch attempts; a waiter that sees it move knows someone fetched for it.
    attempts: u64,
    /// When the last attempt completed (monotonic); starts the throttle interval.
    last_attempt: Option<tokio::time::Instant>,
    /// Why the last attempt failed; `None` after a success.
    last_error: Option<String>,
}

/// An answer from what is already known, instead of a fetch.
struct Settled {
    /// The newest key set, or why there is none usable.
    outcome: Result<Arc<KeySet>, JwtError>,
    /// Set when no fetch completed since the caller looked and only the throttle stands in
    /// the way: how long until the next fetch is allowed. A `kid` missing from `outcome`
    /// is then not known to be bad, only not fetched yet.
    throttled_for: Option<Duration>,
}

/// What one read of [`Shared`] saw.
struct Snapshot {
    keys: Option<Arc<KeySet>>,
    attempts: u64,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

impl JwtVerifier {
    /// A verifier on the system clock. Nothing is fetched until the first token arrives.
    pub fn new(cfg: JwtConfig, http: reqwest::Client) -> Self {
        Self::with_clock(cfg, http, Arc::new(SystemClock))
    }

    /// A verifier on `clock`: monotonic time drives the cache and throttle, wall time
    /// drives `exp`/`nbf`, so simulated runs control both.
    pub fn with_clock(mut cfg: JwtConfig, http: reqwest::Client, clock: Arc<dyn Clock>) -> Self {
        let requested = cfg.algorithms.len();
        let mut kept: Vec<Algorithm> = Vec::with_capacity(requested);
        for alg in cfg.algorithms.drain(..) {
            if matches!(alg.family(), AlgorithmFamily::Rsa | AlgorithmFamily::Ec)
                && !kept.contains(&alg)
            {
                kept.push(alg);
            }
        }
        cfg.algorithms = kept;
        if cfg.algorithms.len() != requested {
            tracing::warn!(
                kept = ?cfg.algorithms,
                "JWT algorithms outside the RSA and EC families (or repeated) were dropped"
            );
        }
        Self {
            inner: Arc::new(Inner {
                cfg,
                http,
                clock,
                shared: RwLock::new(Shared::default()),
                fetch_gate: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Verifies `token` (the bare JWT, without `Bearer `) and returns its claims.
    pub async fn verify(&self, token: &str) -> Result<Claims, JwtError> {
        let result = self.verify_inner(token).await;
        if let Err(error) = &result {
            // The error names the cause only; the token itself is never recorded.
            tracing::debug!(%error, "JWT refused");
        }
        result
    }

    async fn verify_inner(&self, token: &str) -> Result<Claims, JwtError> {
        let cfg = &self.inner.cfg;
        let header = token::parse_header(token)?;
        // Decided from the header alone, before any key is looked up or fetched.
        let alg = Algorithm::from_str(&header.alg).map_err(|_| JwtError::AlgorithmNotAllowed)?;
        if !cfg.algorithms.contains(&alg) {
            return Err(JwtError::AlgorithmNotAllowed);
        }
        let kid = header
            .kid
            .filter(|k| !k.is_empty())
            .ok_or(JwtError::UnknownKid)?;
        let key = self.key_for(&kid).await?;
        if !key.accepts(alg) {
            return Err(JwtError::AlgorithmNotAllowed);
        }

        let mut validation = Validation::new(alg);
        validation.leeway = cfg.leeway_secs;
        // exp/nbf are checked against our clock in `claims_from`, not the system's.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.set_required_spec_claims(&["aud", "iss"]);
        validation.set_audience(&[&cfg.audience]);
        validation.set_issuer(&[&cfg.issuer]);
        let data =
            jsonwebtoken::decode::<Map<String, Value>>(token, key.decoding_key(), &validation)
                .map_err(|e| map_decode_error(&e))?;
        let now = self.inner.clock.wall().timestamp();
        token::claims_from(&data.claims, now, cfg.leeway_secs)
    }

    /// The key named `kid`, from the cache or, when needed and allowed, a fresh JWKS.
    async fn key_for(&self, kid: &str) -> Result<Arc<VerificationKey>, JwtError> {
        let snap = self.snapshot();
        let now = self.inner.clock.now();
        if let Some(set) = &snap.keys {
            let fresh = now.saturating_duration_since(set.fetched_at) < self.inner.cfg.cache_ttl;
            match (set.get(kid), fresh) {
                (Some(key), true) => return Ok(key),
                (Some(stale_key), false) => {
                    // Stale but known: one caller revalidates, the rest go on with the
                    // stale key instead of queueing behind the fetch.
                    let Ok(gate) = self.inner.fetch_gate.try_lock() else {
                        return Ok(stale_key);
                    };
                    return match self.refresh(snap.attempts, gate).await.outcome {
                        // A rotation that dropped the key revokes it.
                        Ok(set) => set.get(kid).ok_or(JwtError::UnknownKid),
                        // The provider being down must not lock everyone out.
                        Err(_) => Ok(stale_key),
                    };
                }
                (None, _) => {}
            }
        }
        // Throttled (or just refreshed by someone else): answer without queueing on the
        // gate, so a flood of unknown kids costs a read lock each, not a turn at a mutex.
        let settled = match self.settled(snap.attempts) {
            Some(settled) => settled,
            None => {
                let gate = self.inner.fetch_gate.lock().await;
                self.refresh(snap.attempts, gate).await
            }
        };
        let set = settled.outcome?;
        if let Some(key) = set.get(kid) {
            return Ok(key);
        }
        match settled.throttled_for {
            // Unknown to a fetch made before this token arrived, and none allowed yet: an
            // IdP that just published the key (and signs with it at once) must not get its
            // users a final 401 for up to `refresh_min_interval`. A key the last rotation
            // dropped is known to be bad.
            Some(retry_after) if !set.retired(kid) => {
                Err(JwtError::KeyNotFetchedYet { retry_after })
            }
            // A fetch completed since this token arrived and does not have the key.
            _ => Err(JwtError::UnknownKid),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let shared = self
            .inner
            .shared
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        Snapshot {
            keys: shared.keys.clone(),
            attempts: shared.attempts,
        }
    }

    /// The outcome to use instead of fetching, if there is one: an attempt completed since
    /// `seen_attempts` was read (a concurrent caller fetched: share its outcome), or the
    /// last attempt is younger than `refresh_min_interval` (throttled: answer from what is
    /// known, saying how long the throttle lasts).
    fn settled(&self, seen_attempts: u64) -> Option<Settled> {
        let inner = &*self.inner;
        let shared = inner.shared.read().unwrap_or_else(PoisonError::into_inner);
        if shared.attempts != seen_attempts {
            return Some(Settled {
                outcome: outcome(&shared),
                throttled_for: None,
            });
        }
        let now = inner.clock.now();
        let wait = shared
            .last_attempt
            .and_then(|at| {
                inner
                    .cfg
                    .refresh_min_interval
                    .checked_sub(now.saturating_duration_since(at))
            })
            .filter(|wait| !wait.is_zero())?;
        Some(Settled {
            outcome: outcome(&shared),
            throttled_for: Some(wait),
        })
    }

    /// Fetches the JWKS unless [`Self::settled`] has the answer. Holding `_gate` makes this
    /// the only fetch in flight. Returns the newest key set, or why there is none usable.
    async fn refresh(&self, seen_attempts: u64, _gate: tokio::sync::MutexGuard<'_, ()>) -> Settled {
        if let Some(settled) = self.settled(seen_attempts) {
            return settled;
        }
        let inner = &*self.inner;
        let result = keys::fetch(&inner.http, &inner.cfg.jwks_url)
            .await
            .and_then(|body| KeySet::parse(&body, inner.clock.now()));
        let mut shared = inner.shared.write().unwrap_or_else(PoisonError::into_inner);
        shared.attempts += 1;
        shared.last_attempt = Some(inner.clock.now());
        match result {
            Ok(set) => {
                let set = set.replacing(shared.keys.as_deref());
                tracing::info!(keys = set.len(), "JWKS fetched");
                shared.keys = Some(Arc::new(set));
                shared.last_error = None;
            }
            Err(error) => {
                tracing::warn!(%error, "JWKS fetch failed");
                shared.last_error = Some(error);
            }
        }
        // This caller's own fetch: its answer is final, not throttled.
        Settled {
            outcome: outcome(&shared),
            throttled_for: None,
        }
    }
}

/// The answer the latest attempt supports: its error if it failed, else the keys.
fn outcome(shared: &Shared) -> Result<Arc<KeySet>, JwtError> {
    if let Some(error) = &shared.last_error {
        return Err(JwtError::JwksUnavailable(error.clone()));
    }
    shared
        .keys
        .clone()
        .ok_or_else(|| JwtError::JwksUnavailable("JWKS not loaded".to_owned()))
}

/// Classifies the decoder's failures (signature, `aud`, `iss`, shape) into ours.
fn map_decode_error(e: &jsonwebtoken::errors::Error) -> JwtError {
    match e.kind() {
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidEddsaKey
        | ErrorKind::InvalidKeyFormat => JwtError::BadSignature,
        ErrorKind::InvalidAudience => JwtError::WrongAudience,
        ErrorKind::InvalidIssuer => JwtError::WrongIssuer,
        ErrorKind::MissingRequiredClaim(c) | ErrorKind::InvalidClaimFormat(c) if c == "aud" => {
            JwtError::WrongAudience
        }
        ErrorKind::MissingRequiredClaim(c) | ErrorKind::InvalidClaimFormat(c) if c == "iss" => {
            JwtError::WrongIssuer
        }
        ErrorKind::ExpiredSignature | ErrorKind::ImmatureSignature => JwtError::Expired,
        ErrorKind::InvalidAlgorithm
        | ErrorKind::UnsupportedAlgorithm
        | ErrorKind::MissingAlgorithm
        | ErrorKind::InvalidAlgorithmName => JwtError::AlgorithmNotAllowed,
        _ => JwtError::Malformed,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use jsonwebtoken::errors::Error;

    use super::*;

    #[test]
    fn jwt_config_pins_only_asymmetric_algorithms() {
        let mut cfg = JwtConfig::new("http://127.0.0.1:9/jwks", "aud", "iss");
        assert_eq!(cfg.algorithms, [Algorithm::RS256, Algorithm::ES256]);
        cfg.algorithms = vec![
            Algorithm::HS256,
            Algorithm::RS256,
            Algorithm::EdDSA,
            Algorithm::RS256,
            Algorithm::ES384,
        ];
        let v = JwtVerifier::new(cfg, reqwest::Client::new());
        assert_eq!(v.inner.cfg.algorithms, [Algorithm::RS256, Algorithm::ES384]);
    }

    #[test]
    fn jwt_decoder_errors_map_to_client_safe_kinds() {
        let e = |k: ErrorKind| map_decode_error(&Error::from(k));
        assert_eq!(e(ErrorKind::InvalidSignature), JwtError::BadSignature);
        assert_eq!(e(ErrorKind::InvalidAudience), JwtError::WrongAudience);
        assert_eq!(
            e(ErrorKind::MissingRequiredClaim("aud".into())),
            JwtError::WrongAudience
        );
        assert_eq!(
            e(ErrorKind::MissingRequiredClaim("iss".into())),
            JwtError::WrongIssuer
        );
        assert_eq!(e(ErrorKind::InvalidIssuer), JwtError::WrongIssuer);
        assert_eq!(
            e(ErrorKind::InvalidAlgorithm),
            JwtError::AlgorithmNotAllowed
        );
        assert_eq!(e(ErrorKind::InvalidToken), JwtError::Malformed);
    }

    #[test]
    fn jwt_error_texts_are_fixed() {
        assert_eq!(
            JwtError::Expired.to_string(),
            "token expired or not yet valid"
        );
        assert_eq!(
            JwtError::JwksUnavailable("JWKS endpoint answered 503".into()).to_string(),
            "signing keys unavailable: JWKS endpoint answered 503"
        );
    }
}
