//! The node's memory of finished work: every `done` is kept until the server acks it and is
//! sent again after a reconnect (SPEC section 7), so a crashed server replica loses no usage,
//! and again while connected once it has waited [`RESEND_AFTER`] for its ack (a replica that
//! could not record it — its database away — answered the client and forgot it; the resent
//! `done` is settled by whichever generation or node actor then takes it).
//! It also remembers recently acked attempts, so a replayed `assign` is not run twice.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::time::Instant;

use switchyard_actors::protocol::NodeFrame;

use super::stats::AgentStats;

/// One attempt of one generation: `(request_id, attempt)`.
pub(crate) type Key = (String, u64);

/// Unacked dones beyond this are dropped oldest first (a server that never acks must not
/// exhaust the node's memory; each entry is ~200 bytes).
const MAX_UNACKED: usize = 65_536;
/// A `done` unacked this long after it was (re)sent goes again on the same connection.
pub(crate) const RESEND_AFTER: std::time::Duration = std::time::Duration::from_secs(30);
/// Acked attempts remembered to ignore replays.
const MAX_RECENT_ACKED: usize = 4_096;

/// Final usage of one attempt, as the `done` frame carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Done {
    pub request_id: String,
    pub attempt: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub finish_reason: String,
    /// Prompt tokens the engine served from its cache (protocol 2).
    pub cached_tokens: Option<u64>,
    /// `chunk`s the attempt sent (protocol 2).
    pub chunks: Option<u64>,
}

impl Done {
    pub(crate) fn key(&self) -> Key {
        (self.request_id.clone(), self.attempt)
    }

    pub(crate) fn frame(&self) -> NodeFrame {
        NodeFrame::Done {
            request_id: self.request_id.clone(),
            attempt: self.attempt,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            finish_reason: self.finish_reason.clone(),
            cached_tokens: self.cached_tokens,
            chunks: self.chunks,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Unacked dones with their completion order (resent in that order) and when each was
    /// last sent.
    unacked: BTreeMap<Key, (u64, Done, Instant)>,
    next_order: u64,
    recent_acked: BTreeSet<Key>,
    recent_order: VecDeque<Key>,
}

/// Shared by the session loop and the assignment tasks; critical sections are a map update.
#[derive(Debug)]
pub(crate) struct Ledger {
    inner: Mutex<Inner>,
    stats: Arc<AgentStats>,
}

impl Ledger {
    pub(crate) fn new(stats: Arc<AgentStats>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            stats,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps a `done` until it is acked; called before the frame is sent.
    pub(crate) fn record(&self, done: Done) {
        let mut inner = self.lock();
        let order = inner.next_order;
        inner.next_order += 1;
        inner
            .unacked
            .insert(done.key(), (order, done, Instant::now()));
        if inner.unacked.len() > MAX_UNACKED {
            let oldest = inner
                .unacked
                .iter()
                .min_by_key(|(_, (o, _, _))| *o)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                inner.unacked.remove(&k);
                tracing::error!(
                    request_id = %k.0,
                    attempt = k.1,
                    "unacked done dropped: the server has not acked {MAX_UNACKED} dones"
                );
            }
        }
        self.stats.set_unacked_dones(inner.unacked.len());
    }

    /// Forgets an acked `done`; true when it was kept.
    pub(crate) fn ack(&self, key: &Key) -> bool {
        let mut inner = self.lock();
        let known = inner.unacked.remove(key).is_some();
        if inner.recent_acked.insert(key.clone()) {
            inner.recent_order.push_back(key.clone());
            if inner.recent_order.len() > MAX_RECENT_ACKED
                && let Some(old) = inner.recent_order.pop_front()
            {
                inner.recent_acked.remove(&old);
            }
        }
        self.stats.set_unacked_dones(inner.unacked.len());
        known
    }

    /// Whether this attempt already finished here (unacked or recently acked).
    pub(crate) fn knows(&self, key: &Key) -> bool {
        let inner = self.lock();
        inner.unacked.contains_key(key) || inner.recent_acked.contains(key)
    }

    /// Every unacked `done`, oldest first, for resending after a reconnect.
    pub(crate) fn unacked(&self) -> Vec<Done> {
        self.resend(|_| true)
    }

    /// The unacked `done`s last sent [`RESEND_AFTER`] ago or earlier, oldest first, to send
    /// again now.
    pub(crate) fn due(&self) -> Vec<Done> {
        let now = Instant::now();
        self.resend(|sent| now.saturating_duration_since(sent) >= RESEND_AFTER)
    }

    fn resend(&self, pick: impl Fn(Instant) -> bool) -> Vec<Done> {
        let now = Instant::now();
        let mut inner = self.lock();
        let mut all: Vec<&mut (u64, Done, Instant)> = inner
            .unacked
            .values_mut()
            .filter(|(_, _, sent)| pick(*sent))
            .collect();
        all.sort_by_key(|(o, _, _)| *o);
        all.into_iter()
            .map(|(_, d, sent)| {
                *sent = now;
                d.clone()
            })
            .collect()
    }

    pub(crate) fn unacked_len(&self) -> usize {
        self.lock().unacked.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: &str, attempt: u64) -> Done {
        Done {
            request_id: id.into(),
            attempt,
            prompt_tokens: 3,
            completion_tokens: 4,
            finish_reason: "stop".into(),
            cached_tokens: None,
            chunks: None,
        }
    }

    #[test]
    fn dones_are_kept_in_completion_order_until_acked() {
        let stats = Arc::new(AgentStats::default());
        let l = Ledger::new(stats.clone());
        l.record(done("b", 1));
        l.record(done("a", 1));
        l.record(done("a", 2));
        assert_eq!(stats.unacked_dones(), 3);
        let ids: Vec<Key> = l.unacked().iter().map(Done::key).collect();
        assert_eq!(
            ids,
            [("b".into(), 1), ("a".into(), 1), ("a".into(), 2)] as [Key; 3]
        );
        assert!(l.ack(&("a".into(), 1)));
        assert!(!l.ack(&("a".into(), 1)), "a second ack is a no-op");
        assert!(
            l.knows(&("a".into(), 1)),
            "recently acked attempts are remembered"
        );
        assert!(l.knows(&("b".into(), 1)));
        assert!(!l.knows(&("c".into(), 1)));
        assert_eq!(l.unacked_len(), 2);
        assert_eq!(stats.unacked_dones(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unacked_done_is_due_again_after_the_resend_interval() {
        let l = Ledger::new(Arc::new(AgentStats::default()));
        l.record(done("a", 1));
        assert!(l.due().is_empty(), "just sent");
        tokio::time::advance(RESEND_AFTER / 2).await;
        l.record(done("b", 1));
        tokio::time::advance(RESEND_AFTER / 2).await;
        let due: Vec<Key> = l.due().iter().map(Done::key).collect();
        assert_eq!(due, [("a".into(), 1)] as [Key; 1]);
        assert!(l.due().is_empty(), "resent now: not due again at once");
        tokio::time::advance(RESEND_AFTER).await;
        assert_eq!(l.due().len(), 2);
        l.ack(&("a".into(), 1));
        tokio::time::advance(RESEND_AFTER).await;
        assert_eq!(l.due().len(), 1, "an acked done is never resent");
    }
}
