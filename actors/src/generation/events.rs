//! The channel from a generation to its HTTP response, bounded by what the reader has not
//! read: bytes and the age of the oldest unread event. The generation never waits on it (a
//! slow socket cannot slow the node or the other streams); instead, a reader that falls
//! further behind than the bound is reported so the generation can cancel it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::msg::GenEvent;

/// Bytes counted per event on top of its text (the SSE framing and JSON around it).
const EVENT_OVERHEAD: usize = 64;

/// How far behind a reader may fall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamBound {
    /// Unread bytes (text plus a fixed overhead per event).
    pub max_bytes: usize,
    /// Age of the oldest unread event.
    pub max_age: Duration,
}

impl Default for StreamBound {
    fn default() -> Self {
        Self {
            max_bytes: 256 * 1024,
            max_age: Duration::from_secs(10),
        }
    }
}

/// Why an event was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// The reader is gone.
    Closed,
    /// The reader is further behind than the bound.
    Overflow,
}

/// The generation's end.
#[derive(Debug)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<(u64, GenEvent)>,
    read: Arc<AtomicU64>,
    bound: StreamBound,
    /// Sent and not yet read: (sequence, when, bytes).
    unread: VecDeque<(u64, Instant, usize)>,
    unread_bytes: usize,
    next: u64,
}

/// The response's end.
#[derive(Debug)]
pub struct EventReceiver {
    rx: mpsc::UnboundedReceiver<(u64, GenEvent)>,
    read: Arc<AtomicU64>,
}

/// A bounded event channel.
pub fn channel(bound: StreamBound) -> (EventSender, EventReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let read = Arc::new(AtomicU64::new(0));
    (
        EventSender {
            tx,
            read: read.clone(),
            bound,
            unread: VecDeque::new(),
            unread_bytes: 0,
            next: 0,
        },
        EventReceiver { rx, read },
    )
}

impl EventSender {
    /// Sends `event` unless the reader left or fell behind the bound (checked before
    /// sending, so a terminal event still goes to a reader that is merely slow).
    pub fn send(&mut self, event: GenEvent, now: Instant) -> Result<(), SendError> {
        let read = self.read.load(Ordering::Acquire);
        while let Some(&(seq, _, bytes)) = self.unread.front() {
            if seq >= read {
                break;
            }
            self.unread.pop_front();
            self.unread_bytes -= bytes;
        }
        let terminal = !matches!(event, GenEvent::Delta(_));
        let behind = self.unread_bytes > self.bound.max_bytes
            || self
                .unread
                .front()
                .is_some_and(|&(_, at, _)| now.saturating_duration_since(at) > self.bound.max_age);
        if behind && !terminal {
            return Err(SendError::Overflow);
        }
        let bytes = EVENT_OVERHEAD
            + match &event {
                GenEvent::Delta(piece) => piece.size(),
                _ => 0,
            };
        let seq = self.next;
        self.tx.send((seq, event)).map_err(|_| SendError::Closed)?;
        self.next += 1;
        self.unread.push_back((seq, now, bytes));
        self.unread_bytes += bytes;
        Ok(())
    }

    /// A plain sender for the supervisor's last word after a crash.
    pub fn crash_sender(&self) -> CrashSender {
        CrashSender(self.tx.clone())
    }
}

/// Sends one final event, unbounded (used once, after a crash).
#[derive(Debug, Clone)]
pub struct CrashSender(mpsc::UnboundedSender<(u64, GenEvent)>);

impl CrashSender {
    /// Sends `event`; a gone reader is ignored.
    pub fn send(&self, event: GenEvent) {
        let _ = self.0.send((u64::MAX, event));
    }
}

impl EventReceiver {
    /// The next event; `None` once every sender is gone.
    pub async fn recv(&mut self) -> Option<GenEvent> {
        let (seq, event) = self.rx.recv().await?;
        if seq != u64::MAX {
            self.read.store(seq + 1, Ordering::Release);
        }
        Some(event)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reader_behind_the_byte_bound_overflows_and_catching_up_clears_it() {
        let bound = StreamBound {
            max_bytes: 1000,
            max_age: Duration::from_secs(60),
        };
        let (mut tx, mut rx) = channel(bound);
        let now = Instant::now();
        let mut sent = 0;
        while tx
            .send(GenEvent::Delta("x".repeat(100).into()), now)
            .is_ok()
        {
            sent += 1;
        }
        // 164 bytes each: the seventh pushes past 1000, the eighth is refused.
        assert_eq!(sent, 7);
        // A terminal event still goes out.
        assert!(
            tx.send(
                GenEvent::Failed(crate::error::Failure::new(
                    crate::error::ErrorCode::ModelBackendError,
                    "x"
                )),
                now
            )
            .is_ok()
        );
        for _ in 0..8 {
            rx.recv().await.unwrap();
        }
        assert!(tx.send(GenEvent::Delta("y".into()), now).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_behind_the_age_bound_overflows() {
        let bound = StreamBound {
            max_bytes: usize::MAX,
            max_age: Duration::from_secs(1),
        };
        let (mut tx, mut rx) = channel(bound);
        let t0 = Instant::now();
        tx.send(GenEvent::Delta("a".into()), t0).unwrap();
        tx.send(GenEvent::Delta("b".into()), t0 + Duration::from_millis(900))
            .unwrap();
        assert_eq!(
            tx.send(
                GenEvent::Delta("c".into()),
                t0 + Duration::from_millis(1100)
            ),
            Err(SendError::Overflow)
        );
        rx.recv().await.unwrap();
        // The oldest unread is now 200 ms old.
        tx.send(
            GenEvent::Delta("c".into()),
            t0 + Duration::from_millis(1100),
        )
        .unwrap();
        drop(rx);
        assert_eq!(
            tx.send(
                GenEvent::Delta("d".into()),
                t0 + Duration::from_millis(1100)
            ),
            Err(SendError::Closed)
        );
    }
}
