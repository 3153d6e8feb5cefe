//! The public listener, in place of `axum::serve`: hyper's HTTP/1 per connection, with header,
//! body and idle timeouts, a cap on connections per client address, and the error envelope on
//! refusals made below the router, and TLS when configured. `clients.rs` the cap;
//! `connection.rs` phases, deadlines and the socket that rewrites hyper's refusals;
//! `service.rs` head limits and the body deadline; `stream.rs` plain TCP or TLS.

mod clients;
mod connection;
mod refusal;
mod service;
mod stream;

pub use stream::{Acceptor, acceptor};

use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::ListenerSettings;
use clients::{Clients, Permit};
use connection::{ConnIo, Connection, record_expiry};
use refusal::Rewrites;
use service::{ConnService, HeadLimits};
use stream::Stream;

/// What every connection of one listener shares.
#[derive(Debug)]
struct Shared {
    app: Router,
    http: http1::Builder,
    rewrites: Arc<Rewrites>,
    limits: HeadLimits,
    header_timeout: Duration,
    idle_timeout: Duration,
    /// `SO_SNDBUF` of each client socket; `0` leaves the kernel's default.
    send_buffer_bytes: usize,
    /// Terminates TLS on every connection when set (see [`acceptor`]).
    tls: Option<Acceptor>,
}

/// Serves `app` on `listener` until `stop` is cancelled; then stops accepting, lets every
/// connection finish its in-flight requests (streams included) and returns when they have.
/// Connections still open when the caller aborts this future (after its grace) are closed
/// with it; upgraded WebSockets are not connections of this loop any more and are left to
/// their owners. With `tls`, every connection is TLS (no plain HTTP on the same port).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    settings: ListenerSettings,
    send_buffer_bytes: usize,
    tls: Option<Acceptor>,
    stop: CancellationToken,
) {
    let mut http = http1::Builder::new();
    http.keep_alive(true)
        // Our own head limits answer first with the envelope; hyper's buffer is larger, and
        // what it still refuses the socket wrapper rewrites.
        .max_buf_size(hyper_buffer(settings.max_header_bytes))
        .max_headers(refusal::MAX_HEADERS)
        // hyper's header timer also runs while a kept-alive connection waits for its next
        // request (hyper 1.x `proto/h1/conn.rs`, `State::idle`), which would close it after
        // the header timeout rather than the idle one: our connection task keeps both.
        .header_read_timeout(None);
    let shared = Arc::new(Shared {
        app,
        http,
        rewrites: Arc::new(Rewrites::new(&settings)),
        limits: HeadLimits {
            max_uri_bytes: settings.max_uri_bytes,
            max_header_bytes: settings.max_header_bytes,
            body_timeout: Duration::from_secs(settings.body_timeout_secs),
        },
        header_timeout: Duration::from_secs(settings.header_timeout_secs),
        idle_timeout: Duration::from_secs(settings.idle_timeout_secs),
        send_buffer_bytes,
        tls,
    });
    let clients = Clients::new(settings.max_connections_per_client);
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            Some(ended) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = ended
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "a connection task panicked");
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    // Refused: the socket is dropped unread, which closes it.
                    if let Some(permit) = clients.admit(peer.ip()) {
                        connections.spawn(serve_connection(
                            tcp,
                            peer,
                            permit,
                            shared.clone(),
                            stop.clone(),
                        ));
                    }
                }
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    // Out of file descriptors, most likely: give connections time to close
                    // instead of spinning on accept.
                    tracing::error!(error = %e, "accept failed; pausing 1 s");
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            },
        }
    }
    // New connections are refused from here on.
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// hyper's read buffer: twice our head limit (at least hyper's minimum of 8 KiB), so a head
/// over our limit but within this reaches our check and its envelope.
fn hyper_buffer(max_header_bytes: usize) -> usize {
    max_header_bytes.saturating_mul(2).max(8192)
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

fn configure(tcp: &TcpStream, send_buffer_bytes: usize) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::warn!(error = %e, "could not set TCP_NODELAY");
    }
    // A small send buffer makes a slow reader's backpressure reach its stream quickly.
    if send_buffer_bytes > 0
        && let Err(e) = socket2::SockRef::from(tcp).set_send_buffer_size(send_buffer_bytes)
    {
        tracing::warn!(error = %e, "could not bound the socket's send buffer");
    }
}

/// The server side of the TLS handshake, within the connection's header deadline. `None`:
/// the connection is over (timed out, failed, or the server is stopping).
async fn handshake(
    acceptor: &Acceptor,
    tcp: TcpStream,
    conn: &Connection,
    peer: SocketAddr,
    stop: &CancellationToken,
) -> Option<Stream> {
    let Some((deadline, expiry)) = conn.deadline() else {
        return None; // a fresh connection always has its head deadline
    };
    tokio::select! {
        done = tokio::time::timeout_at(deadline, acceptor.0.accept(tcp)) => match done {
            Ok(Ok(tls)) => Some(Stream::Tls(Box::new(tls))),
            Ok(Err(e)) => {
                // Scanners and clients that distrust our certificate end here: not an error
                // of ours.
                tracing::debug!(client = %peer, error = %e, "TLS handshake failed");
                None
            }
            Err(_) => {
                record_expiry(expiry, peer);
                None
            }
        },
        () = stop.cancelled() => None,
    }
}

/// One connection: hyper drives the protocol; this task enforces the deadline of the
/// connection's current phase and passes on a graceful stop.
async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    permit: Permit,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    configure(&tcp, shared.send_buffer_bytes);
    // The head clock starts now, so the TLS handshake spends from the same header timeout.
    let conn = Connection::new(shared.header_timeout, shared.idle_timeout);
    let stream = match &shared.tls {
        None => Stream::Plain(tcp),
        Some(acceptor) => match handshake(acceptor, tcp, &conn, peer, &stop).await {
            Some(tls) => tls,
            None => return,
        },
    };
    let io = ConnIo::new(stream, conn.clone(), shared.rewrites.clone(), peer, permit);
    let service = ConnService {
        app: shared.app.clone(),
        conn: conn.clone(),
        limits: shared.limits,
        peer,
    };
    let mut http = pin!(
        shared
            .http
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades()
    );
    let mut draining = false;
    loop {
        let deadline = conn.deadline();
        tokio::select! {
            ended = http.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(client = %peer, error = %e, "connection ended with an error");
                }
                return;
            }
            () = stop.cancelled(), if !draining => {
                draining = true;
                // Idle connections close now; one serving a request closes after it.
                http.as_mut().graceful_shutdown();
            }
            () = conn.changed() => {}
            () = async {
                match deadline {
                    Some((at, _)) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                // Re-read: the phase may have moved on since the deadline was armed.
                if let Some((at, expiry)) = conn.deadline()
                    && at <= tokio::time::Instant::now()
                {
                    record_expiry(expiry, peer);
                    return;
                }
            }
        }
    }
}
