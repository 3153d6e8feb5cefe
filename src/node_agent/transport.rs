//! The transport seam under the node protocol (STYLE 18): a [`Dialer`] yields any byte stream
//! (`tokio::net` in production, an in-memory pipe or a simulated network elsewhere) and the
//! WebSocket framing runs on top of whatever it returns.

use std::io;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;

use super::config::{Endpoint, Scheme};

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

/// Production dialer: TCP with `TCP_NODELAY` (each frame is small and latency-bound).
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpDialer;

impl Dialer for TcpDialer {
    fn dial<'a>(&'a self, endpoint: &'a Endpoint) -> BoxFuture<'a, io::Result<BoxIo>> {
        Box::pin(async move {
            let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await?;
            tcp.set_nodelay(true)?;
            match endpoint.scheme {
                Scheme::Ws => Ok(Box::new(tcp) as BoxIo),
                // With a TLS feature this wraps `tcp` in a TLS client stream (server name =
                // `endpoint.host`); nothing above this line or below the handshake changes.
                Scheme::Wss => Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "wss:// needs TLS support, which this build lacks",
                )),
            }
        })
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
