//! The transport seam under the node protocol (STYLE 18): a [`Dialer`] yields any byte stream
//! (`tokio::net` in production, an in-memory pipe or a simulated network elsewhere) and the
//! WebSocket framing runs on top of whatever it returns.

use std::io;
use std::path::Path;
use std::sync::Arc;

use futures::future::BoxFuture;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;

use super::config::{Endpoint, Scheme};
use crate::tls::TlsError;

/// A byte stream the WebSocket can run over.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// A boxed [`Io`].
pub type BoxIo = Box<dyn Io>;

/// The control-plane socket.
pub(crate) type Ws = WebSocketStream<BoxIo>;

/// Opens the byte stream to the server; TLS, when there is any, happens here.
pub trait Dialer: Send + Sync + std::fmt::Debug + 'static {
    /// Connects to `endpoint`.
    fn dial<'a>(&'a self, endpoint: &'a Endpoint) -> BoxFuture<'a, io::Result<BoxIo>>;

    /// Whether `wss://` endpoints can be dialed (checked once at start).
    fn supports_tls(&self) -> bool {
        false
    }
}

/// Production dialer: TCP with `TCP_NODELAY` (each frame is small and latency-bound), and for
/// `wss://` TLS verified against Mozilla's roots plus the agent's `--ca-file`.
#[derive(Clone)]
pub struct TcpDialer {
    /// `None`: plain `ws://` only (see [`Dialer::supports_tls`]).
    tls: Option<tokio_rustls::TlsConnector>,
}

impl TcpDialer {
    /// A dialer for `ws://` and `wss://`; `extra_ca` is a PEM file of CAs trusted besides
    /// the web PKI roots (an on-premises server's own CA).
    pub fn new(extra_ca: Option<&Path>) -> Result<Self, TlsError> {
        let mut config = crate::tls::client_config(extra_ca)?;
        // The control plane is an HTTP/1.1 upgrade; a proxy must not pick h2.
        config.alpn_protocols = vec![crate::tls::ALPN_HTTP11.to_vec()];
        Ok(Self {
            tls: Some(tokio_rustls::TlsConnector::from(Arc::new(config))),
        })
    }

    /// A dialer for `ws://` only.
    pub fn plain() -> Self {
        Self { tls: None }
    }
}

impl std::fmt::Debug for TcpDialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpDialer")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Dialer for TcpDialer {
    fn dial<'a>(&'a self, endpoint: &'a Endpoint) -> BoxFuture<'a, io::Result<BoxIo>> {
        Box::pin(async move {
            let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await?;
            tcp.set_nodelay(true)?;
            match (endpoint.scheme, &self.tls) {
                (Scheme::Ws, _) => Ok(Box::new(tcp) as BoxIo),
                (Scheme::Wss, Some(connector)) => {
                    let name = ServerName::try_from(endpoint.host.clone()).map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!("{:?} is not a valid TLS server name", endpoint.host),
                        )
                    })?;
                    let tls = connector.connect(name, tcp).await.map_err(|e| {
                        let hint = if crate::tls::is_certificate_error(&e) {
                            " (server certificate refused: its CA is neither a web PKI root nor in --ca-file, or it does not name this host)"
                        } else {
                            ""
                        };
                        io::Error::new(
                            e.kind(),
                            format!(
                                "TLS handshake with {}:{} failed: {e}{hint}",
                                endpoint.host, endpoint.port
                            ),
                        )
                    })?;
                    Ok(Box::new(tls) as BoxIo)
                }
                (Scheme::Wss, None) => Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "wss:// needs a dialer with TLS",
                )),
            }
        })
    }

    fn supports_tls(&self) -> bool {
        self.tls.is_some()
    }
}

/// Dials and runs the client handshake for `endpoint.url`.
pub(crate) async fn open(
    dialer: &dyn Dialer,
    endpoint: &Endpoint,
) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    let io = dialer.dial(endpoint).await?;
    let (ws, _response) = tokio_tungstenite::client_async(endpoint.url.as_str(), io).await?;
    Ok(ws)
}
