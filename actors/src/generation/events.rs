//! The channel from a generation to its HTTP response, bounded by what the reader has not
//! read: bytes and the age of the oldest unread event. The generation never waits on it (a
//! slow socket cannot slow the node or the other streams); instead, a reader that falls
//! further behind than the bound is reported so the generation can cancel it.
//!
//! A resumable generation's sender also feeds its [`Journal`]: every event, numbered from 0,
//! goes there before it is delivered — after the reader left or fell behind too — and a
//! task per generation writes what accumulated to the [`Coordinator`] in batches, so that
//! `GET /v1/generations/{id}/events` can replay it on any replica ([`read_journal`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::msg::{GenEvent, Usage};
use crate::error::{ErrorCode, Failure};
use crate::output::{Piece, RawJson, ToolCallDelta};
use crate::ports::{CoordError, Coordinator};
use crate::tasks::TaskGuard;

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
    /// The number of the next event, whether or not the reader gets it: the journal's
    /// numbering has no holes where the live reader missed events.
    next: u64,
    /// The reader fell behind once: it gets no more deltas, only the end (it would otherwise
    /// see a stream with a hole in it).
    overflowed: bool,
    /// Where a resumable generation's events are journaled; `None` for one nobody can come
    /// back to.
    journal: Option<Journal>,
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
            overflowed: false,
            journal: None,
        },
        EventReceiver { rx, read },
    )
}

impl EventSender {
    /// Journals every event from now on (a resumable generation's sender).
    pub fn journaled(mut self, journal: Journal) -> Self {
        self.journal = Some(journal);
        self
    }

    /// Journals `event`, then sends it unless the reader left or fell behind the bound
    /// (checked before sending, so a terminal event still goes to a reader that is merely
    /// slow). Once behind, the reader gets no more deltas, only the terminal event.
    pub fn send(&mut self, event: GenEvent, now: Instant) -> Result<(), SendError> {
        let seq = self.next;
        self.next += 1;
        let terminal = !matches!(event, GenEvent::Delta(_));
        if let Some(journal) = &mut self.journal {
            journal.record(seq, &event, terminal);
        }
        let read = self.read.load(Ordering::Acquire);
        while let Some(&(unread, _, bytes)) = self.unread.front() {
            if unread >= read {
                break;
            }
            self.unread.pop_front();
            self.unread_bytes -= bytes;
        }
        if !terminal {
            let behind = self.overflowed
                || self.unread_bytes > self.bound.max_bytes
                || self.unread.front().is_some_and(|&(_, at, _)| {
                    now.saturating_duration_since(at) > self.bound.max_age
                });
            if behind {
                self.overflowed = true;
                return Err(SendError::Overflow);
            }
        }
        let bytes = EVENT_OVERHEAD
            + match &event {
                GenEvent::Delta(piece) => piece.size(),
                _ => 0,
            };
        self.tx.send((seq, event)).map_err(|_| SendError::Closed)?;
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

/// The coordinator key of generation `id`'s journal.
pub fn journal_key(id: &str) -> String {
    format!("journal:{id}")
}

/// Most events one append carries (a reader far behind the writer catches up in pages).
const MAX_BATCH: usize = 256;

/// How long the writer gathers events after the first of a batch before appending them: at
/// token rates (tens per second per stream) draining only what already waits would append
/// each token alone; this makes it one append per stream per 50 ms at most, at the price
/// of a resuming reader trailing the live one by as much. A terminal event is appended at
/// once.
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// Waits before a failed append is tried again (an append is idempotent by number).
const APPEND_RETRIES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// How one generation's journal is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalSpec {
    /// Its coordinator key ([`journal_key`]).
    pub key: String,
    /// Expiry after each append while the generation runs: longer than it may run, so a
    /// slow generation's early events are still there at its end.
    pub running_ttl: Duration,
    /// Expiry after the terminal event: how long a finished generation can be resumed.
    pub retention: Duration,
    /// Encoded bytes journaled per generation at most. Deltas past it are not journaled (a
    /// reader resuming past that point is told the rest is unavailable); the terminal event
    /// always is.
    pub max_bytes: usize,
}

/// One event on its way to the journal.
#[derive(Debug)]
struct Entry {
    seq: u64,
    bytes: Vec<u8>,
    terminal: bool,
}

/// The generation's side of its journal: encodes each event and hands it to the writer task,
/// never waiting on the coordinator.
#[derive(Debug)]
pub struct Journal {
    /// To the writer task.
    tx: mpsc::UnboundedSender<Entry>,
    /// Encoded bytes handed over so far, against `max_bytes`.
    bytes: usize,
    /// [`JournalSpec::max_bytes`].
    max_bytes: usize,
    /// A delta was left out for the byte bound: later ones are left out too, so the journal
    /// is a prefix of the stream and its end, never a stream with holes in the middle.
    truncated: bool,
}

impl Journal {
    /// Starts the writer task of one generation's journal. It appends what accumulated over
    /// [`FLUSH_EVERY`] in one call (a round trip per batch, not per token), and ends once
    /// the generation's sender is dropped and everything is written.
    pub fn spawn(coordinator: Arc<dyn Coordinator>, spec: JournalSpec) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let max_bytes = spec.max_bytes;
        tokio::spawn(write_journal(coordinator, spec, rx));
        Self {
            tx,
            bytes: 0,
            max_bytes,
            truncated: false,
        }
    }

    fn record(&mut self, seq: u64, event: &GenEvent, terminal: bool) {
        if !terminal && self.truncated {
            return;
        }
        let bytes = encode(event);
        if !terminal && self.bytes + bytes.len() > self.max_bytes {
            self.truncated = true;
            return;
        }
        self.bytes += bytes.len();
        // The writer only ends after this sender is dropped.
        let _ = self.tx.send(Entry {
            seq,
            bytes,
            terminal,
        });
    }
}

async fn write_journal(
    coordinator: Arc<dyn Coordinator>,
    spec: JournalSpec,
    mut rx: mpsc::UnboundedReceiver<Entry>,
) {
    let _guard = TaskGuard::new("journal");
    let mut ended = false;
    while let Some(first) = rx.recv().await {
        let flush_at = Instant::now() + FLUSH_EVERY;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH && !batch.iter().any(|e| e.terminal) {
            match tokio::time::timeout_at(flush_at, rx.recv()).await {
                Ok(Some(entry)) => batch.push(entry),
                // The sender is gone or the time is up: write what there is.
                Ok(None) | Err(_) => break,
            }
        }
        ended |= batch.iter().any(|e| e.terminal);
        let ttl = if ended {
            spec.retention
        } else {
            spec.running_ttl
        };
        // Numbers run on without a gap except where deltas were left out for the bound.
        let mut rest = batch.into_iter().peekable();
        while let Some(head) = rest.next() {
            let first_seq = head.seq;
            let mut events = vec![head.bytes];
            while let Some(next) = rest.next_if(|e| e.seq == first_seq + events.len() as u64) {
                events.push(next.bytes);
            }
            append(coordinator.as_ref(), &spec.key, first_seq, events, ttl).await;
        }
    }
}

/// One append, tried again a few times: a lost batch is a hole a resuming reader is told
/// about, so it is worth a second or two.
async fn append(
    coordinator: &dyn Coordinator,
    key: &str,
    first_seq: u64,
    events: Vec<Vec<u8>>,
    ttl: Duration,
) {
    let mut waits = APPEND_RETRIES.iter();
    loop {
        match coordinator
            .append_events(key, first_seq, events.clone(), ttl)
            .await
        {
            Ok(()) => return,
            Err(e) => match waits.next() {
                Some(wait) => tokio::time::sleep(*wait).await,
                None => {
                    tracing::warn!(journal = key, first_seq, events = events.len(), error = %e, "could not journal events; a resume past them is refused");
                    return;
                }
            },
        }
    }
}

/// Up to `max` events of the journal at `key` after `after` (`None`: from the first),
/// decoded, waiting up to `block` for one (see [`Coordinator::read_events`]).
pub async fn read_journal(
    coordinator: &dyn Coordinator,
    key: &str,
    after: Option<u64>,
    max: usize,
    block: Duration,
) -> Result<Vec<(u64, GenEvent)>, CoordError> {
    let raw = coordinator.read_events(key, after, max, block).await?;
    raw.into_iter()
        .map(|(seq, bytes)| {
            decode(&bytes).map(|e| (seq, e)).ok_or_else(|| {
                CoordError::Unavailable(format!("journal {key}: event {seq} is not readable"))
            })
        })
        .collect()
}

/// A [`GenEvent`] as the journal stores it.
#[derive(Serialize, Deserialize)]
enum Wire {
    Delta {
        #[serde(default, skip_serializing_if = "String::is_empty")]
        text: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reasoning: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCallDelta>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        embeddings: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raw: Option<RawJson>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<RawJson>,
    },
    Finished(WireUsage),
    Cancelled(WireUsage),
    Failed {
        code: ErrorCode,
        message: String,
    },
}

#[derive(Serialize, Deserialize)]
struct WireUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
    finish_reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<u64>,
}

impl From<&Usage> for WireUsage {
    fn from(u: &Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            finish_reason: u.finish_reason.clone(),
            cached_tokens: u.cached_tokens,
        }
    }
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            finish_reason: u.finish_reason,
            cached_tokens: u.cached_tokens,
        }
    }
}

/// The journal's bytes of `event`.
pub fn encode(event: &GenEvent) -> Vec<u8> {
    let wire = match event {
        GenEvent::Delta(p) => Wire::Delta {
            text: p.text.clone(),
            reasoning: p.reasoning.clone(),
            tool_calls: p.tool_calls.clone(),
            embeddings: p.embeddings,
            raw: p.raw.clone(),
            logprobs: p.logprobs.clone(),
        },
        GenEvent::Finished(u) => Wire::Finished(u.into()),
        GenEvent::Cancelled(u) => Wire::Cancelled(u.into()),
        // The retry hint is about the moment it happened, not a later replay.
        GenEvent::Failed(f) => Wire::Failed {
            code: f.code,
            message: f.message.clone(),
        },
    };
    // Plain data with string keys: encoding cannot fail.
    serde_json::to_vec(&wire).unwrap_or_default()
}

/// The event `bytes` hold, if they are one [`encode`] wrote.
pub fn decode(bytes: &[u8]) -> Option<GenEvent> {
    Some(match serde_json::from_slice::<Wire>(bytes).ok()? {
        Wire::Delta {
            text,
            reasoning,
            tool_calls,
            embeddings,
            raw,
            logprobs,
        } => GenEvent::Delta(Piece {
            text,
            reasoning,
            tool_calls,
            embeddings,
            raw,
            logprobs,
        }),
        Wire::Finished(u) => GenEvent::Finished(u.into()),
        Wire::Cancelled(u) => GenEvent::Cancelled(u.into()),
        Wire::Failed { code, message } => GenEvent::Failed(Failure::new(code, message)),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reader_behind_the_byte_bound_overflows_and_gets_only_the_end() {
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
        // Caught up, it still gets no more deltas: its stream would have a hole.
        assert_eq!(
            tx.send(GenEvent::Delta("y".into()), now),
            Err(SendError::Overflow)
        );
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
        tx.send(
            GenEvent::Cancelled(Usage {
                prompt_tokens: 1,
                completion_tokens: 2,
                finish_reason: "abort".into(),
                cached_tokens: None,
            }),
            t0 + Duration::from_millis(1100),
        )
        .unwrap();
        drop(rx);
        assert_eq!(
            tx.send(
                GenEvent::Finished(Usage {
                    prompt_tokens: 1,
                    completion_tokens: 2,
                    finish_reason: "stop".into(),
                    cached_tokens: None,
                }),
                t0 + Duration::from_millis(1100)
            ),
            Err(SendError::Closed)
        );
    }

    #[test]
    fn every_kind_of_event_survives_the_journal_encoding() {
        let piece = Piece::from_wire(
            crate::output::WireDelta::Object(
                RawJson::parse(r#"{"content":"hé\n","reasoning_content":"r","tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{"}}]}"#)
                    .unwrap(),
            ),
            RawJson::parse(r#"{"content":[]}"#),
        )
        .unwrap();
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
            finish_reason: "length".into(),
            cached_tokens: Some(2),
        };
        for event in [
            GenEvent::Delta(piece),
            GenEvent::Delta("plain".into()),
            GenEvent::Finished(usage.clone()),
            GenEvent::Cancelled(Usage {
                cached_tokens: None,
                ..usage
            }),
            GenEvent::Failed(Failure::new(ErrorCode::GenerationTimeout, "late")),
        ] {
            assert_eq!(decode(&encode(&event)), Some(event));
        }
        assert_eq!(decode(b"not json"), None);
    }
}
