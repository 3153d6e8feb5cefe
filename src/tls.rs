//! TLS shared by every edge (agent → server, server → Redis and JWKS, `serve`'s own listener):
//! the process's one rustls crypto provider, PEM loading, and the client and server
//! configurations. PostgreSQL's TLS is sqlx's own (`sslmode`/`sslrootcert` in the URL).
//!
//! Trust: Mozilla's roots compiled in (`webpki-roots`), the same in every image (a distroless
//! container has no system store), plus an optional extra CA file for on-premises installs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The only application protocol the listener and the agent speak (hyper serves HTTP/1 only,
/// and the node WebSocket is an HTTP/1.1 upgrade).
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Why TLS material could not be loaded. Messages name the file and the problem, never
/// the file's contents (a key file is a secret).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file holds no usable PEM certificate.
    #[error("{path}: no PEM certificate (-----BEGIN CERTIFICATE-----) found")]
    NoCertificates {
        /// The file.
        path: PathBuf,
    },
    /// A certificate in the file is malformed or not a usable trust anchor.
    #[error("{path}: bad certificate: {reason}")]
    BadCertificate {
        /// The file.
        path: PathBuf,
        /// What is wrong (no file contents).
        reason: String,
    },
    /// The file holds no usable private key.
    #[error("{path}: no PEM private key (PKCS#8, PKCS#1 or SEC1) found")]
    NoKey {
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the combination (e.g. a key that does not match the certificate).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// Installs the process's rustls crypto provider (aws-lc-rs) unless one is installed already;
/// idempotent and safe to race. `main` calls it first thing; library entry points that make
/// TLS connections call it too, so tests and embedders need not remember. Without it, a build
/// where two providers are compiled in would panic at the first handshake of a crate that
/// asks rustls for "the" default (the redis crate does).
pub fn install_provider() {
    let _ = provider();
}

/// The process default provider, installing ours first if there is none.
fn provider() -> Arc<CryptoProvider> {
    if let Some(installed) = CryptoProvider::get_default() {
        return installed.clone();
    }
    // Losing a race to another installer is fine: either way there is one default now.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in a PEM file, in order (a chain: leaf first).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadCertificate {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificates {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The first private key in a PEM file. Parse errors are not passed on: they could quote
/// a line of the file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsError::NoKey {
        path: path.to_owned(),
    })
}

/// Mozilla's roots, plus every certificate of `extra_ca` when given.
pub fn root_store(extra_ca: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        for cert in load_certs(path)? {
            roots.add(cert).map_err(|e| TlsError::BadCertificate {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        }
    }
    Ok(roots)
}

/// A client configuration that verifies servers against [`root_store`] (host name included),
/// with no client certificate.
pub fn client_config(extra_ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let roots = root_store(extra_ca)?;
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The listener's configuration: the certificate chain and key from PEM files, no client
/// certificates, ALPN `http/1.1`.
pub fn server_config(cert: &Path, key: &Path) -> Result<ServerConfig, TlsError> {
    let chain = load_certs(cert)?;
    let key = load_key(key)?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(format!("certificate and key: {e}")))?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(config)
}

/// Whether an I/O error from a TLS handshake is the peer's certificate being refused (unknown
/// issuer, wrong name, expired), as opposed to the network failing.
pub fn is_certificate_error(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn missing_and_empty_files_are_named_errors() {
        install_provider();
        install_provider();
        let dir = std::env::temp_dir().join(format!("switchyard-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, b"not pem\n").unwrap();
        assert!(matches!(
            root_store(Some(&dir.join("absent.pem"))),
            Err(TlsError::Read { .. })
        ));
        assert!(matches!(
            root_store(Some(&empty)),
            Err(TlsError::NoCertificates { .. })
        ));
        assert!(matches!(load_key(&empty), Err(TlsError::NoKey { .. })));
        assert!(root_store(None).unwrap().len() > 100, "Mozilla's roots");
        assert!(client_config(None).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
