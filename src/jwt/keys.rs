//! The JWKS document: fetched with a timeout and a size cap, parsed key by key into the
//! verification keys the verifier caches. Only RSA and EC signing keys are kept.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyOperations, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};
use serde_json::Value;
use tokio::time::Instant;

/// A JWKS fetch gives up after this long (connect, headers and body together).
pub(super) const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// A JWKS larger than this is refused: real ones are a few KiB.
pub(super) const MAX_JWKS_BYTES: usize = 1024 * 1024;

/// One public key from the JWKS, ready to verify with.
#[derive(Debug)]
pub(super) struct VerificationKey {
    key: DecodingKey,
    family: AlgorithmFamily,
    /// The JWK's `alg`, when it names one: the token's `alg` must then be exactly this.
    alg: Option<Algorithm>,
    /// For EC keys, which curve; it fixes the algorithm (P-256 ↔ ES256, P-384 ↔ ES384).
    curve: Option<EllipticCurve>,
}

impl VerificationKey {
    /// Builds a key from a JWK, or says why it is unusable for verifying signatures.
    fn from_jwk(jwk: &Jwk) -> Result<Self, &'static str> {
        match &jwk.common.public_key_use {
            None | Some(PublicKeyUse::Signature) => {}
            Some(_) => return Err("not a signing key"),
        }
        if let Some(ops) = &jwk.common.key_operations
            && !ops.iter().any(|op| matches!(op, KeyOperations::Verify))
        {
            return Err("key_ops excludes verify");
        }
        let alg = match jwk.common.key_algorithm {
            None => None,
            // KeyAlgorithm displays as its JWA name; encryption algorithms do not parse.
            Some(a) => {
                Some(Algorithm::from_str(&a.to_string()).map_err(|_| "not a signature algorithm")?)
            }
        };
        let (family, curve) = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => (AlgorithmFamily::Rsa, None),
            AlgorithmParameters::EllipticCurve(p) => match p.curve {
                EllipticCurve::P256 | EllipticCurve::P384 => {
                    (AlgorithmFamily::Ec, Some(p.curve.clone()))
                }
                _ => return Err("unsupported curve"),
            },
            // Symmetric (`oct`) keys would turn a public document into an HMAC secret.
            _ => return Err("unsupported key type"),
        };
        if alg.is_some_and(|a| a.family() != family) {
            return Err("alg does not match the key type");
        }
        let key = DecodingKey::from_jwk(jwk).map_err(|_| "invalid key material")?;
        Ok(Self {
            key,
            family,
            alg,
            curve,
        })
    }

    /// Whether a token whose header says `alg` may be checked with this key. Refusing a
    /// mismatch here closes algorithm-confusion tricks regardless of the crypto backend.
    pub(super) fn accepts(&self, alg: Algorithm) -> bool {
        alg.family() == self.family
            && self.alg.is_none_or(|a| a == alg)
            && match &self.curve {
                None => true,
                Some(EllipticCurve::P256) => alg == Algorithm::ES256,
                Some(EllipticCurve::P384) => alg == Algorithm::ES384,
                Some(_) => false,
            }
    }

    pub(super) fn decoding_key(&self) -> &DecodingKey {
        &self.key
    }
}

/// The usable keys of one JWKS document, by `kid`.
#[derive(Debug)]
pub(super) struct KeySet {
    keys: BTreeMap<String, Arc<VerificationKey>>,
    /// Kids the previous document had and this one dropped: a rotation revoked them, so a
    /// token naming one is refused outright rather than told to retry.
    retired: BTreeSet<String>,
    /// When the document was fetched (monotonic), for the cache TTL.
    pub(super) fetched_at: Instant,
}

impl KeySet {
    pub(super) fn get(&self, kid: &str) -> Option<Arc<VerificationKey>> {
        self.keys.get(kid).cloned()
    }

    /// Whether the last rotation dropped `kid`.
    pub(super) fn retired(&self, kid: &str) -> bool {
        self.retired.contains(kid)
    }

    /// This set as the successor of `previous`: it remembers which kids were dropped.
    pub(super) fn replacing(mut self, previous: Option<&KeySet>) -> Self {
        if let Some(previous) = previous {
            self.retired = previous
                .keys
                .keys()
                .filter(|kid| !self.keys.contains_key(*kid))
                .cloned()
                .collect();
        }
        self
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Parses a JWKS document. Keys are taken one by one so a single exotic or broken
    /// entry (an encryption key, an unsupported curve) does not hide the others.
    pub(super) fn parse(body: &[u8], fetched_at: Instant) -> Result<Self, String> {
        let doc: Value =
            serde_json::from_slice(body).map_err(|_| "JWKS is not valid JSON".to_owned())?;
        let entries = doc
            .get("keys")
            .and_then(Value::as_array)
            .ok_or_else(|| "JWKS has no \"keys\" array".to_owned())?;
        let mut keys = BTreeMap::new();
        for entry in entries {
            let kid = entry.get("kid").and_then(Value::as_str).unwrap_or_default();
            if kid.is_empty() {
                tracing::debug!("skipping a JWK without kid");
                continue;
            }
            let parsed = serde_json::from_value::<Jwk>(entry.clone())
                .map_err(|_| "unparseable JWK")
                .and_then(|jwk| VerificationKey::from_jwk(&jwk));
            match parsed {
                Ok(key) => {
                    if keys.contains_key(kid) {
                        tracing::warn!(kid, "JWKS lists a kid twice; keeping the first");
                        continue;
                    }
                    keys.insert(kid.to_owned(), Arc::new(key));
                }
                Err(reason) => tracing::debug!(kid, reason, "skipping JWK"),
            }
        }
        if keys.is_empty() {
            tracing::warn!("JWKS holds no usable signing keys");
        }
        Ok(Self {
            keys,
            retired: BTreeSet::new(),
            fetched_at,
        })
    }
}

/// The HTTP client for JWKS fetches: `https://` verified against the web PKI roots, the same
/// trust as every other edge (not the host's store, which a container may not have).
pub fn http_client() -> Result<reqwest::Client, crate::tls::TlsError> {
    reqwest::Client::builder()
        .tls_backend_preconfigured(crate::tls::client_config(None)?)
        .build()
        .map_err(|e| crate::tls::TlsError::Config(format!("JWKS HTTP client: {e}")))
}

/// Fetches the JWKS body. The error is a short description safe to show a client: no URL
/// (it may carry credentials in its query) and no upstream body.
pub(super) async fn fetch(http: &reqwest::Client, url: &str) -> Result<Vec<u8>, String> {
    let request = async {
        let mut resp = http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .timeout(FETCH_TIMEOUT)
            .send()
            .await
            .map_err(|e| describe(&e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(format!("JWKS endpoint answered {}", status.as_u16()));
        }
        let too_large = || format!("JWKS larger than {MAX_JWKS_BYTES} bytes");
        if resp
            .content_length()
            .is_some_and(|n| n > MAX_JWKS_BYTES as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| describe(&e))? {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    // Belt and braces: the client-level timeout may be unset or longer on a shared client.
    tokio::time::timeout(FETCH_TIMEOUT, request)
        .await
        .map_err(|_| "JWKS fetch timed out".to_owned())?
}

fn describe(e: &reqwest::Error) -> String {
    // A refused certificate or an unknown scheme is not "unreachable": say which, so an
    // operator does not chase the network.
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.to_string().contains("scheme is not http") {
            return "JWKS URL scheme not supported by this build".to_owned();
        }
        if cause
            .downcast_ref::<rustls::Error>()
            .is_some_and(|c| matches!(c, rustls::Error::InvalidCertificate(_)))
        {
            return "JWKS endpoint's TLS certificate not trusted".to_owned();
        }
        source = cause.source();
    }
    if e.is_timeout() {
        "JWKS fetch timed out".to_owned()
    } else if e.is_connect() {
        "JWKS endpoint unreachable".to_owned()
    } else {
        "JWKS fetch failed".to_owned()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fixture(name: &str) -> Value {
        let path = format!(
            "{}/tests/fixtures/jwt/{name}.jwk.json",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn jwt_jwks_keeps_only_usable_signing_keys() {
        let mut enc = fixture("rsa-b");
        enc["use"] = json!("enc");
        enc["kid"] = json!("enc");
        let mut no_kid = fixture("rsa-b");
        no_kid.as_object_mut().unwrap().remove("kid");
        let doc = json!({"keys": [
            fixture("rsa-a"),
            fixture("ec-a"),
            enc,
            no_kid,
            {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
            {"kty": "OKP", "kid": "ed", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty": "RSA", "kid": "broken", "n": "!!", "e": "AQAB"},
            {"kty": "EC", "kid": "wrong-alg", "alg": "RS256", "crv": "P-256", "x": "AA", "y": "AA"},
            "not an object",
        ]});
        let set = KeySet::parse(doc.to_string().as_bytes(), Instant::now()).unwrap();
        let kids: Vec<_> = set.keys.keys().cloned().collect();
        assert_eq!(kids, ["ec-a", "rsa-a"]);
    }

    #[test]
    fn jwt_jwks_rejects_non_documents() {
        assert!(KeySet::parse(b"<html>", Instant::now()).is_err());
        assert!(KeySet::parse(b"{\"kids\": []}", Instant::now()).is_err());
        let empty = KeySet::parse(b"{\"keys\": []}", Instant::now()).unwrap();
        assert_eq!(empty.len(), 0);
    }

    #[test]
    fn jwt_keys_accept_only_their_own_algorithm() {
        let doc = json!({"keys": [fixture("rsa-a"), fixture("ec-a")]});
        let set = KeySet::parse(doc.to_string().as_bytes(), Instant::now()).unwrap();
        let rsa = set.get("rsa-a").unwrap();
        assert!(rsa.accepts(Algorithm::RS256));
        assert!(!rsa.accepts(Algorithm::RS512), "JWK pins alg RS256");
        assert!(!rsa.accepts(Algorithm::ES256));
        assert!(!rsa.accepts(Algorithm::HS256));
        let ec = set.get("ec-a").unwrap();
        assert!(ec.accepts(Algorithm::ES256));
        assert!(!ec.accepts(Algorithm::ES384));
        assert!(!ec.accepts(Algorithm::RS256));
    }
}
