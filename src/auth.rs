//! API-key authentication. A bearer key is hashed (SHA-256) and looked up through a short
//! cache, so revocation takes effect within [`CACHE_TTL`] without a database round trip per
//! request. Keys and their hashes never reach a log.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use switchyard_actors::error::ErrorCode;
use switchyard_actors::ports::Clock;
use tokio::time::Instant;

use crate::http::error::ApiError;
use crate::store::{ApiKeyRecord, Store, hash_secret};

/// How long a looked-up key is trusted before it is read again.
pub const CACHE_TTL: Duration = Duration::from_secs(5);

/// Who is calling, from a verified credential.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    /// The paying team.
    pub team_id: i64,
    /// The key used.
    pub key_id: i64,
    /// The key's record (limits, allowlist).
    pub key: ApiKeyRecord,
}

/// Key hash → (when it was read, the record if one exists).
type KeyCache = BTreeMap<String, (Instant, Option<ApiKeyRecord>)>;

/// Verifies bearer keys against the store, with a short cache.
#[derive(Debug, Clone)]
pub struct Authenticator {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    cache: Arc<Mutex<KeyCache>>,
}

impl Authenticator {
    /// An authenticator over `store`.
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            clock,
            cache: Arc::default(),
        }
    }

    /// The principal behind the request's `Authorization: Bearer` key.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let unauthorized = |m: &str| ApiError::new(ErrorCode::Unauthorized, m);
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| unauthorized("Missing bearer credential."))?;
        let hash = hash_secret(token);
        let record = self.lookup(&hash).await?;
        let key = record.ok_or_else(|| unauthorized("Unknown API key."))?;
        if !key.is_usable(self.clock.wall()) {
            return Err(unauthorized("The API key is revoked or expired."));
        }
        Ok(Principal {
            team_id: key.team_id,
            key_id: key.id,
            key,
        })
    }

    async fn lookup(&self, hash: &str) -> Result<Option<ApiKeyRecord>, ApiError> {
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
            ApiError::new(
                ErrorCode::QuotaServiceUnavailable,
                "Credentials cannot be checked right now.",
            )
        })?;
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(hash.to_owned(), (now, record.clone()));
        Ok(record)
    }
}
