//! The client's byte stream under [`super::connection::ConnIo`]: plain TCP, or TLS terminated
//! here when the listener has a certificate. The handshake is bounded by the header timeout
//! (a client that connects and says nothing holds its socket no longer than one that sends
//! half a request head) and counts against the per-client cap like any connection.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::config::ListenerSettings;
use crate::tls::TlsError;

/// The listener's TLS: its certificate and key, loaded.
#[derive(Clone)]
pub struct Acceptor(pub(super) TlsAcceptor);

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Nothing of the key, ever.
        f.write_str("Acceptor(..)")
    }
}

/// The acceptor for `settings`, or `None` when it terminates no TLS. Loads the certificate
/// and key now, so a bad file stops the server before it binds.
pub fn acceptor(settings: &ListenerSettings) -> Result<Option<Acceptor>, TlsError> {
    match (&settings.tls_cert, &settings.tls_key) {
        (Some(cert), Some(key)) => {
            let config = crate::tls::server_config(cert, key)?;
            Ok(Some(Acceptor(TlsAcceptor::from(Arc::new(config)))))
        }
        (None, None) => Ok(None),
        _ => Err(TlsError::Config(
            "listener.tls_cert and listener.tls_key must be set together".into(),
        )),
    }
}

/// One accepted connection's transport.
#[derive(Debug)]
pub(super) enum Stream {
    Plain(TcpStream),
    /// Boxed: a rustls connection is a few KiB, a TCP stream a few words.
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
