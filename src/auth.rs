//! Who is calling. An API key is hashed (SHA-256) and looked up through a short cache, so a
//! revocation takes effect within [`CACHE_TTL`] without a database round trip per request;
//! a JWT is verified against the configured JWKS (pinned algorithms, audience, issuer,
//! expiry) and names its principal (`sub`), team and role in its claims. The team always
//! comes from the verified credential. Keys, hashes and tokens never reach a log.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use switchyard_actors::ports::Clock;
use switchyard_actors::tier::{Allowed, Tier};
use tokio::time::Instant;

use crate::jwt::{JwtError, JwtVerifier, Role};
use crate::store::{ApiKeyRecord, Store, hash_secret};

/// How long a looked-up key is trusted before it is read again.
pub const CACHE_TTL: Duration = Duration::from_secs(5);

/// A verified caller and the limits that apply to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    /// The paying team.
    pub team_id: i64,
    /// The API key used, when the caller used one.
    pub key_id: Option<i64>,
    /// Stable id of the principal for per-principal limits: the key id, or `user:{sub}`.
    pub subject: String,
    /// Models it may use; `None` allows all.
    pub model_allowlist: Option<Vec<String>>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Concurrent generations.
    pub max_streams: Option<u32>,
    /// Tokens per UTC day.
    pub tokens_per_day: Option<u64>,
    /// Messages per quota window (Generations API); `None`: the configured default.
    pub message_quota: Option<u32>,
    /// Burst bucket capacity; `None`: the configured default.
    pub burst_capacity: Option<u32>,
    /// Seconds per burst token; `None`: the configured default.
    pub burst_refill_seconds: Option<u32>,
    /// Whether the credential carries the admin role.
    pub admin: bool,
    /// The service tiers it may use, and its own.
    pub service_tiers: Allowed,
}

impl Principal {
    /// Who is calling, as the access log names it: `key:{id}` or `user:{sub}`, never a
    /// credential.
    pub fn log_name(&self) -> String {
        match self.key_id {
            Some(id) => format!("key:{id}"),
            None => self.subject.clone(),
        }
    }

    fn from_key(key: ApiKeyRecord, defaults: &Defaults) -> Self {
        Self {
            team_id: key.team_id,
            key_id: Some(key.id),
            subject: key.id.to_string(),
            model_allowlist: key.model_allowlist,
            rpm: key.rpm.or(Some(defaults.rpm)),
            max_streams: key.max_streams,
            tokens_per_day: key.tokens_per_day.or(Some(defaults.tokens_per_day)),
            message_quota: key.message_quota,
            burst_capacity: key.burst_capacity,
            burst_refill_seconds: key.burst_refill_seconds,
            admin: false,
            service_tiers: key_tiers(key.service_tiers.as_deref(), key.service_tier, defaults),
        }
    }
}

/// The tiers of a credential that names `tiers` and `default` (either may be absent): what
/// it names, completed by `fallback` — a default it lacks is its best tier, and a default
/// outside the configured tiers widens them by it.
pub fn tiers_of(tiers: Option<&[Tier]>, default: Option<Tier>, fallback: Allowed) -> Allowed {
    match (tiers, default) {
        (None, None) => fallback,
        (None, Some(d)) => {
            let mut all = fallback.tiers();
            all.push(d);
            Allowed::new(&all, d).unwrap_or(fallback)
        }
        (Some(tiers), d) => {
            let d = d
                .filter(|d| tiers.contains(d))
                .or_else(|| tiers.iter().min().copied())
                .unwrap_or(fallback.default_tier());
            Allowed::new(tiers, d).unwrap_or(fallback)
        }
    }
}

fn key_tiers(tiers: Option<&[Tier]>, default: Option<Tier>, defaults: &Defaults) -> Allowed {
    tiers_of(tiers, default, defaults.key_tiers)
}

/// Limits of principals whose credential sets none (configuration), so every answer can
/// carry its `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defaults {
    /// Requests per minute.
    pub rpm: u32,
    /// Tokens per UTC day.
    pub tokens_per_day: u64,
    /// Concurrent generations of a JWT principal.
    pub jwt_max_streams: u32,
    /// The service tiers of a key that names none.
    pub key_tiers: Allowed,
    /// The service tiers of a JWT principal whose token names none.
    pub jwt_tiers: Allowed,
}

/// Key hash → (when it was read, the record if one exists).
type KeyCache = BTreeMap<String, (Instant, Option<ApiKeyRecord>)>;

/// Verifies bearer credentials.
#[derive(Debug, Clone)]
pub struct Authenticator {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    cache: Arc<Mutex<KeyCache>>,
    jwt: Option<JwtVerifier>,
    defaults: Defaults,
}

/// Why an `Authorization` header was refused before any credential was looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BearerError {
    /// No `Authorization` header.
    #[error("Missing bearer credential.")]
    Missing,
    /// Two or more `Authorization` headers: which one a proxy or a framework reads differs,
    /// so none is trusted.
    #[error("Send one Authorization header, not several.")]
    Repeated,
    /// Anything but `Bearer`, one space, and a credential of visible ASCII characters.
    #[error(
        "The Authorization header must be `Bearer <credential>`: the word Bearer, one space, then the credential (visible ASCII characters, no spaces)."
    )]
    Malformed,
}

/// Why a credential was refused, or could not be checked. The HTTP layer renders each
/// (`src/http/error/domain.rs`); the messages are the public ones and never quote a credential.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No key has this hash.
    #[error("Unknown API key.")]
    UnknownKey,
    /// The key exists but may not be used any more.
    #[error("The API key is revoked or expired.")]
    KeyUnusable,
    /// A JWT was presented and no JWKS is configured.
    #[error("JWTs are not accepted here.")]
    JwtNotAccepted,
    /// The token failed verification (signature, audience, issuer, expiry, algorithm).
    #[error("{0}")]
    Token(JwtError),
    /// The JWKS cannot be fetched: the platform's problem, so retryable (fail closed).
    #[error("Tokens cannot be verified right now.")]
    JwksUnavailable,
    /// The token's key id is not among the keys fetched moments ago; the throttle lets the
    /// JWKS be fetched again after this many whole seconds.
    #[error(
        "The token's signing key is not among the identity provider's keys fetched \
         moments ago; they are fetched again after Retry-After seconds."
    )]
    KeyNotFetchedYet {
        /// Whole seconds, rounded up: retrying earlier gets this answer again.
        retry_after_secs: u64,
    },
    /// A verified token names no team.
    #[error("The token names no team.")]
    NoTeam {
        /// The verified caller (`user:{sub}`), for the access log.
        subject: String,
    },
    /// A verified token names a team that does not exist.
    #[error("The token's team does not exist.")]
    UnknownTeam {
        /// The verified caller (`user:{sub}`), for the access log.
        subject: String,
    },
    /// The store could not be read (the cause is logged where it happened): fail closed.
    #[error("Credentials cannot be checked right now.")]
    StoreUnavailable {
        /// The verified caller, when a token was verified before the store failed.
        subject: Option<String>,
    },
}

impl AuthError {
    /// The caller a refused credential still named (a verified JWT whose team failed), for
    /// the access log.
    pub fn subject(&self) -> Option<&str> {
        match self {
            Self::NoTeam { subject } | Self::UnknownTeam { subject } => Some(subject),
            Self::StoreUnavailable { subject } => subject.as_deref(),
            _ => None,
        }
    }
}

/// A JWT caller checked for the admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtCaller {
    /// `user:{sub}`, for the access log.
    pub subject: String,
    /// Whether the token carries the admin role.
    pub admin: bool,
}

/// The credential of a request's `Authorization` values (every one it sent, in order):
/// exactly one, as docs/api.md states it: the scheme word `Bearer`, one space, and a
/// non-empty credential of visible ASCII (0x21-0x7E) with nothing after it. Shared by the API
/// and the admin API, so both accept and refuse the same headers.
pub fn bearer<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<&'a str, BearerError> {
    let mut values = values.into_iter();
    let value = values.next().ok_or(BearerError::Missing)?;
    if values.next().is_some() {
        return Err(BearerError::Repeated);
    }
    let token = value
        .strip_prefix(b"Bearer ")
        .ok_or(BearerError::Malformed)?;
    if token.is_empty() || !token.iter().all(|b| b.is_ascii_graphic()) {
        return Err(BearerError::Malformed);
    }
    // Visible ASCII is UTF-8, so this cannot fail; the check above is what refuses.
    std::str::from_utf8(token).map_err(|_| BearerError::Malformed)
}

/// A JWT is three base64url parts; an API key has no dots.
fn looks_like_jwt(token: &str) -> bool {
    token.split('.').count() == 3
}

impl Authenticator {
    /// An authenticator over `store`; JWTs are accepted when `jwt` is given.
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        jwt: Option<JwtVerifier>,
        defaults: Defaults,
    ) -> Self {
        Self {
            store,
            clock,
            cache: Arc::default(),
            jwt,
            defaults,
        }
    }

    /// The principal behind a bearer credential (see [`bearer`]).
    pub async fn authenticate(&self, token: &str) -> Result<Principal, AuthError> {
        if looks_like_jwt(token) {
            return self.verify_jwt(token).await;
        }
        let key = self
            .lookup(&hash_secret(token))
            .await?
            .ok_or(AuthError::UnknownKey)?;
        if !key.is_usable(self.clock.wall()) {
            return Err(AuthError::KeyUnusable);
        }
        Ok(Principal::from_key(key, &self.defaults))
    }

    /// The caller of a bearer credential that is a JWT, and whether it has the admin role
    /// (for the admin API); `None` when it is no JWT or JWTs are not accepted.
    pub async fn admin_jwt(&self, token: &str) -> Option<Result<JwtCaller, AuthError>> {
        if !looks_like_jwt(token) {
            return None;
        }
        let verifier = self.jwt.as_ref()?;
        Some(
            verifier
                .verify(token)
                .await
                .map_err(jwt_error)
                .map(|c| JwtCaller {
                    subject: format!("user:{}", c.sub),
                    admin: c.role == Role::Admin,
                }),
        )
    }

    async fn verify_jwt(&self, token: &str) -> Result<Principal, AuthError> {
        let verifier = self.jwt.as_ref().ok_or(AuthError::JwtNotAccepted)?;
        let claims = verifier.verify(token).await.map_err(jwt_error)?;
        let subject = format!("user:{}", claims.sub);
        let Some(team) = claims.team.as_deref() else {
            return Err(AuthError::NoTeam { subject });
        };
        let found = match team.parse::<i64>() {
            Ok(id) => self.store.team(id).await,
            Err(_) => self.store.team_by_name(team).await,
        };
        let team = match found {
            Ok(Some(team)) => team,
            Ok(None) => return Err(AuthError::UnknownTeam { subject }),
            Err(e) => {
                tracing::error!(error = %e, "team lookup for a JWT failed");
                let subject = Some(subject);
                return Err(AuthError::StoreUnavailable { subject });
            }
        };
        Ok(Principal {
            team_id: team.id,
            key_id: None,
            subject,
            model_allowlist: None,
            rpm: Some(self.defaults.rpm),
            max_streams: Some(self.defaults.jwt_max_streams),
            tokens_per_day: Some(self.defaults.tokens_per_day),
            message_quota: None,
            burst_capacity: None,
            burst_refill_seconds: None,
            admin: claims.role == Role::Admin,
            service_tiers: tiers_of(
                claims.service_tiers.as_deref(),
                claims.service_tier,
                self.defaults.jwt_tiers,
            ),
        })
    }

    async fn lookup(&self, hash: &str) -> Result<Option<ApiKeyRecord>, AuthError> {
        let now = self.clock.now();
        if let Some((at, record)) = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(hash)
            && now.saturating_duration_since(*at) < CACHE_TTL
        {
            return Ok(record.clone());
        }
        let record = self.store.api_key_by_hash(hash).await.map_err(|e| {
            tracing::error!(error = %e, "key lookup failed");
            AuthError::StoreUnavailable { subject: None }
        })?;
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(hash.to_owned(), (now, record.clone()));
        Ok(record)
    }
}

/// A JWKS outage, or a key the throttle does not let us fetch yet, is the platform's problem
/// (retryable, fail closed); anything else is the token's.
fn jwt_error(e: JwtError) -> AuthError {
    match e {
        JwtError::JwksUnavailable(_) => AuthError::JwksUnavailable,
        JwtError::KeyNotFetchedYet { retry_after } => AuthError::KeyNotFetchedYet {
            // Whole seconds, rounded up: retrying before the throttle ends gets this again.
            retry_after_secs: u64::try_from(retry_after.as_millis().div_ceil(1000))
                .unwrap_or(u64::MAX)
                .max(1),
        },
        other => AuthError::Token(other),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::time::Duration;

    use axum::http::header::AUTHORIZATION;
    use axum::http::{HeaderMap, HeaderValue};

    use super::*;

    /// The values as a request carries them, read back as the HTTP layer reads them.
    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_bytes(v).unwrap());
        }
        h
    }

    fn bearer(h: &HeaderMap) -> Result<&str, BearerError> {
        super::bearer(h.get_all(AUTHORIZATION).iter().map(HeaderValue::as_bytes))
    }

    #[test]
    fn a_credential_names_its_tiers_or_takes_the_configured_ones() {
        use Tier::{Default, Flex, Priority};
        let configured = Allowed::new(&[Default, Flex], Default).unwrap();
        // Nothing named: the configuration's.
        assert_eq!(tiers_of(None, None, configured), configured);
        // Only its own tier: the configured ones widened by it.
        let own = tiers_of(None, Some(Priority), configured);
        assert_eq!(
            (own.tiers(), own.default_tier()),
            (vec![Priority, Default, Flex], Priority)
        );
        // Tiers without a default: its best; a default outside them: its best too.
        let named = tiers_of(Some(&[Flex, Default]), None, configured);
        assert_eq!(
            (named.tiers(), named.default_tier()),
            (vec![Default, Flex], Default)
        );
        let named = tiers_of(Some(&[Flex]), Some(Priority), configured);
        assert_eq!((named.tiers(), named.default_tier()), (vec![Flex], Flex));
    }

    #[test]
    fn bearer_is_the_word_one_space_and_visible_ascii() {
        assert_eq!(bearer(&headers(&[b"Bearer sk-sy-abc"])), Ok("sk-sy-abc"));
        assert_eq!(bearer(&headers(&[b"Bearer a.b.c"])), Ok("a.b.c"));
        assert_eq!(bearer(&headers(&[])), Err(BearerError::Missing));
        for bad in [
            &b"Bearer  sk-sy-abc"[..],
            b"Bearer sk-sy-abc ",
            b"Bearer sk-sy-abc\t",
            b"Bearer sk-sy abc",
            b"Bearer ",
            b"Bearer",
            b"bearer sk-sy-abc",
            b"Basic dXNlcjpwYXNz",
            b"Bearer\tsk-sy-abc",
            b"Bearer sk-sy-\xc3\xa9",
        ] {
            assert_eq!(
                bearer(&headers(&[bad])),
                Err(BearerError::Malformed),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            bearer(&headers(&[b"Bearer one", b"Bearer two"])),
            Err(BearerError::Repeated)
        );
    }

    #[test]
    fn a_key_not_fetched_yet_carries_its_wait_and_a_bad_token_is_the_tokens_fault() {
        let e = jwt_error(JwtError::KeyNotFetchedYet {
            retry_after: Duration::from_millis(12_300),
        });
        assert!(matches!(
            e,
            AuthError::KeyNotFetchedYet {
                retry_after_secs: 13
            }
        ));
        let e = jwt_error(JwtError::KeyNotFetchedYet {
            retry_after: Duration::from_millis(1),
        });
        assert!(matches!(
            e,
            AuthError::KeyNotFetchedYet {
                retry_after_secs: 1
            }
        ));
        assert!(matches!(
            jwt_error(JwtError::UnknownKid),
            AuthError::Token(JwtError::UnknownKid)
        ));
    }
}
