//! One connection's phase (waiting for a head, reading it, serving, finishing, upgraded) and
//! the socket wrapper that observes it: the phase decides which deadline applies and whether
//! a write is hyper's own refusal, to be rewritten into the error envelope.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::clients::Permit;
use super::refusal::{Reason, Rewrites};
use super::stream::Stream;

/// Where a connection is in its request cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No byte of the next request yet, since the connection opened (`first`) or since its
    /// last response went out.
    Waiting { since: Instant, first: bool },
    /// Part of a request head has arrived; it must be whole by `since` + the header timeout.
    ReadingHead { since: Instant },
    /// Requests handed to the router whose response bodies are still alive: no listener
    /// deadline applies (a stream may last minutes; the body deadline is the body's own).
    Serving { in_flight: u32 },
    /// Every response body has ended and hyper is writing the last bytes. `next_head` is when
    /// the next request's first bytes arrived meanwhile.
    Finishing {
        since: Instant,
        next_head: Option<Instant>,
    },
    /// The connection switched protocols (the node WebSocket): its own heartbeats govern it.
    Upgraded,
}

/// What a passed deadline means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expiry {
    /// A head that never came or came too slowly: a refusal.
    HeaderTimeout,
    /// A kept-alive connection nobody used, or a response nobody read: an ordinary close.
    Idle,
}

/// The state one connection's socket, service and task share.
#[derive(Debug)]
pub(super) struct Connection {
    phase: Mutex<Phase>,
    /// Wakes the connection task when the phase changes, so it re-arms its deadline.
    changed: Notify,
    header_timeout: Duration,
    idle_timeout: Duration,
}

impl Connection {
    pub(super) fn new(header_timeout: Duration, idle_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            phase: Mutex::new(Phase::Waiting {
                since: Instant::now(),
                first: true,
            }),
            changed: Notify::new(),
            header_timeout,
            idle_timeout,
        })
    }

    fn update(&self, step: impl FnOnce(Phase) -> Phase) {
        let mut phase = self.phase.lock().unwrap_or_else(PoisonError::into_inner);
        let next = step(*phase);
        if next != *phase {
            *phase = next;
            self.changed.notify_one();
        }
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes came in from the client.
    fn bytes_read(&self) {
        self.update(|phase| match phase {
            // A new connection's head is due from when it opened, not from its first byte.
            Phase::Waiting { since, first: true } => Phase::ReadingHead { since },
            Phase::Waiting { first: false, .. } => Phase::ReadingHead {
                since: Instant::now(),
            },
            Phase::Finishing {
                since,
                next_head: None,
            } => Phase::Finishing {
                since,
                next_head: Some(Instant::now()),
            },
            other => other,
        });
    }

    /// hyper flushed everything it had to write.
    fn flushed(&self) {
        self.update(|phase| match phase {
            Phase::Finishing { next_head, .. } => match next_head {
                Some(since) => Phase::ReadingHead { since },
                None => Phase::Waiting {
                    since: Instant::now(),
                    first: false,
                },
            },
            other => other,
        });
    }

    /// A request head was parsed and handed to the router.
    pub(super) fn request_started(self: &Arc<Self>) -> RequestGuard {
        self.update(|phase| match phase {
            Phase::Serving { in_flight } => Phase::Serving {
                in_flight: in_flight + 1,
            },
            Phase::Upgraded => Phase::Upgraded,
            _ => Phase::Serving { in_flight: 1 },
        });
        RequestGuard { conn: self.clone() }
    }

    /// The response switched protocols.
    pub(super) fn upgraded(&self) {
        self.update(|_| Phase::Upgraded);
    }

    /// No request is being served: anything hyper writes now is its own refusal of a head.
    fn awaiting_head(&self) -> bool {
        matches!(
            self.phase(),
            Phase::Waiting { .. } | Phase::ReadingHead { .. }
        )
    }

    /// The deadline of the current phase, if it has one.
    pub(super) fn deadline(&self) -> Option<(Instant, Expiry)> {
        match self.phase() {
            Phase::Waiting { since, first: true } | Phase::ReadingHead { since } => {
                Some((since + self.header_timeout, Expiry::HeaderTimeout))
            }
            Phase::Waiting {
                since,
                first: false,
            }
            | Phase::Finishing { since, .. } => Some((since + self.idle_timeout, Expiry::Idle)),
            Phase::Serving { .. } | Phase::Upgraded => None,
        }
    }

    /// Resolves when the phase changed since the last call.
    pub(super) async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// Keeps its request counted as in flight until the response body is dropped (hyper drops it
/// once it has taken the last frame), or until the request is abandoned.
#[derive(Debug)]
pub(super) struct RequestGuard {
    conn: Arc<Connection>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.conn.update(|phase| match phase {
            Phase::Serving { in_flight } if in_flight > 1 => Phase::Serving {
                in_flight: in_flight - 1,
            },
            Phase::Serving { .. } => Phase::Finishing {
                since: Instant::now(),
                next_head: None,
            },
            other => other,
        });
    }
}

/// The client socket as hyper sees it (after TLS, when the listener terminates it). It tells the phase what it observes (bytes in, a
/// completed flush) and, while no request is being served, rewrites hyper's own bodiless
/// refusal into the enveloped one. It owns the connection's permit, so an upgraded
/// WebSocket keeps its place under the per-client cap for as long as it lives.
#[derive(Debug)]
pub(super) struct ConnIo {
    tcp: Stream,
    conn: Arc<Connection>,
    rewrites: Arc<Rewrites>,
    peer: SocketAddr,
    /// A rewritten refusal still being written, ahead of anything else.
    rewritten: Option<Bytes>,
    _permit: Permit,
}

impl ConnIo {
    pub(super) fn new(
        tcp: Stream,
        conn: Arc<Connection>,
        rewrites: Arc<Rewrites>,
        peer: SocketAddr,
        permit: Permit,
    ) -> Self {
        Self {
            tcp,
            conn,
            rewrites,
            peer,
            rewritten: None,
            _permit: permit,
        }
    }

    fn poll_write_rewritten(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(bytes) = &mut self.rewritten {
            if bytes.is_empty() {
                self.rewritten = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, bytes))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            bytes.advance(n);
        }
        Poll::Ready(Ok(()))
    }

    /// `Some(len)` when `buf` was hyper's refusal and has been replaced.
    fn rewrite(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Option<io::Result<usize>> {
        // Cheap test first: every write of a response body, an SSE event included, skips
        // the lock.
        if !buf.starts_with(b"HTTP/1.") || !self.conn.awaiting_head() {
            return None;
        }
        let (reason, bytes) = self.rewrites.rewrite(buf)?;
        reason.record(self.peer);
        self.rewritten = Some(bytes);
        // hyper believes its bytes written; ours go out now or at the flush that follows.
        match self.poll_write_rewritten(cx) {
            Poll::Ready(Err(e)) => Some(Err(e)),
            _ => Some(Ok(buf.len())),
        }
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.tcp).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.conn.bytes_read();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_write_rewritten(cx))?;
        if let Some(result) = this.rewrite(cx, buf) {
            return Poll::Ready(result);
        }
        Pin::new(&mut this.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_write_rewritten(cx))?;
        // hyper hands over a response head in one slice; a refusal is nothing else.
        if let Some(first) = bufs.iter().find(|b| !b.is_empty())
            && let Some(result) = this.rewrite(cx, first)
        {
            return Poll::Ready(result);
        }
        Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_rewritten(cx))?;
        ready!(Pin::new(&mut this.tcp).poll_flush(cx))?;
        // hyper flushes the socket only once its own buffer is empty: a finished response is
        // now wholly out, and the connection waits for its next request.
        this.conn.flushed();
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_rewritten(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

/// Records a passed deadline (a refusal for a head timeout, nothing for an idle close).
pub(super) fn record_expiry(expiry: Expiry, peer: SocketAddr) {
    match expiry {
        Expiry::HeaderTimeout => Reason::HeaderTimeout.record(peer),
        Expiry::Idle => tracing::debug!(client = %peer, "idle connection closed"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    const HEADER: Duration = Duration::from_secs(10);
    const IDLE: Duration = Duration::from_secs(75);

    #[tokio::test(start_paused = true)]
    async fn each_phase_has_its_deadline_and_a_stream_has_none() {
        let conn = Connection::new(HEADER, IDLE);
        let opened = Instant::now();
        assert_eq!(
            conn.deadline(),
            Some((opened + HEADER, Expiry::HeaderTimeout))
        );
        tokio::time::advance(Duration::from_secs(3)).await;
        conn.bytes_read();
        // A fresh connection's head is due from the open, not from its first byte.
        assert_eq!(
            conn.deadline(),
            Some((opened + HEADER, Expiry::HeaderTimeout))
        );
        let guard = conn.request_started();
        assert_eq!(conn.deadline(), None);
        tokio::time::advance(Duration::from_secs(600)).await;
        conn.flushed();
        assert_eq!(conn.deadline(), None, "a flush mid-stream changes nothing");
        assert!(!conn.awaiting_head());
        drop(guard);
        let finished = Instant::now();
        assert_eq!(conn.deadline(), Some((finished + IDLE, Expiry::Idle)));
        assert!(
            !conn.awaiting_head(),
            "the response's last bytes are not yet out"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        conn.flushed();
        let idle = Instant::now();
        assert_eq!(conn.deadline(), Some((idle + IDLE, Expiry::Idle)));
        assert!(conn.awaiting_head());
        tokio::time::advance(Duration::from_secs(30)).await;
        conn.bytes_read();
        assert_eq!(
            conn.deadline(),
            Some((Instant::now() + HEADER, Expiry::HeaderTimeout)),
            "a kept-alive connection's next head is due from its first byte"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_upgrade_ends_every_deadline() {
        let conn = Connection::new(HEADER, IDLE);
        let guard = conn.request_started();
        conn.upgraded();
        drop(guard);
        conn.flushed();
        conn.bytes_read();
        assert_eq!(conn.deadline(), None);
        assert!(!conn.awaiting_head());
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_of_the_next_request_during_the_last_flush_start_its_head_clock() {
        let conn = Connection::new(HEADER, IDLE);
        drop(conn.request_started());
        tokio::time::advance(Duration::from_secs(2)).await;
        conn.bytes_read();
        let arrived = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        conn.flushed();
        assert_eq!(
            conn.deadline(),
            Some((arrived + HEADER, Expiry::HeaderTimeout))
        );
    }
}
