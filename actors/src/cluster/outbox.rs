//! One ordered, batching publisher per (sender, channel).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::ports::Coordinator;
use crate::tasks::TaskGuard;

/// Most items in one published message.
const MAX_BATCH: usize = 256;

/// Publishes what is pushed to one channel, in order: whatever queued while a publish was
/// on the wire goes in the next message together (a busy relay costs one publish per batch,
/// an idle one adds no wait). Messages are numbered 1, 2, … by `encode`. When nobody listens
/// on the channel any more (a publish reached no subscriber; with [`OnFailure::Retry`], for
/// [`UNHEARD_GRACE`]) — or, with [`OnFailure::GiveUp`], the coordinator fails — it calls
/// `on_gone` once and stops: later pushes return false.
#[derive(Debug)]
pub struct Outbox<T> {
    tx: mpsc::UnboundedSender<T>,
}

/// What an outbox makes of a publish the coordinator failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// The listener is taken for gone: the sender falls back at once.
    GiveUp,
    /// The same message is published again, with backoff, until the coordinator answers:
    /// only publishes that reach nobody for [`UNHEARD_GRACE`] say the listener is gone. For what a listener
    /// that is alive must not be taken for dead over (a node's frames: what a replica does
    /// for a generation it thinks gone — settling its usage — is wrong while it lives).
    Retry,
}

/// The first wait before a failed publish is tried again; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// How long, with [`OnFailure::Retry`], a channel may have no listener before its listener
/// counts as gone. A listener whose pub/sub connection dropped (Redis restarted, a blip)
/// subscribes again within 5 s (`cluster::listen`, the node view): a publish that reached
/// nobody meanwhile is not its death, and taken for it, a node's `done` relayed to a
/// generation still alive was settled where the node's socket is — billing an attempt the
/// generation then fenced and retried (the simulation, Redis restarted empty, seed 10).
const UNHEARD_GRACE: Duration = Duration::from_secs(8);

/// Whether publishes have reached nobody for [`UNHEARD_GRACE`] (counted from the first).
fn unheard_too_long(since: &mut Option<tokio::time::Instant>) -> bool {
    let now = tokio::time::Instant::now();
    now.saturating_duration_since(*since.get_or_insert(now)) >= UNHEARD_GRACE
}

impl<T: Send + 'static> Outbox<T> {
    /// Starts the publishing task.
    pub fn spawn(
        coordinator: Arc<dyn Coordinator>,
        channel: String,
        on_failure: OnFailure,
        encode: impl Fn(u64, Vec<T>) -> Option<Vec<u8>> + Send + 'static,
        on_gone: impl FnOnce() + Send + 'static,
    ) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<T>();
        tokio::spawn(async move {
            let _guard = TaskGuard::new("relay_outbox");
            let mut seq = 0u64;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
                let Some(payload) = encode(seq + 1, batch) else {
                    continue;
                };
                seq += 1;
                let mut pause = FIRST_PAUSE;
                let mut unheard_since = None;
                loop {
                    match coordinator.publish(&channel, payload.clone()).await {
                        Ok(0)
                            if on_failure == OnFailure::Retry
                                && !unheard_too_long(&mut unheard_since) =>
                        {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(MAX_PAUSE);
                        }
                        Ok(0) => {
                            tracing::info!(%channel, "nobody listens on a relay channel any more");
                            on_gone();
                            return;
                        }
                        Ok(_) => break,
                        Err(e) if on_failure == OnFailure::GiveUp => {
                            tracing::warn!(%channel, error = %e, "could not relay; giving the channel up");
                            on_gone();
                            return;
                        }
                        Err(e) => {
                            // Nobody will push again: the sender is gone, and so is the point.
                            if rx.is_closed() {
                                return;
                            }
                            if pause == FIRST_PAUSE {
                                tracing::warn!(%channel, error = %e, "could not relay; trying again");
                            }
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(MAX_PAUSE);
                        }
                    }
                }
            }
        });
        Self { tx }
    }

    /// Queues `item`; false once the outbox gave up.
    pub fn push(&self, item: T) -> bool {
        self.tx.send(item).is_ok()
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::ports::memory::MapCoordinator;

    /// An outbox of byte messages on `channel` whose `on_gone` sets the returned flag.
    fn outbox(
        coordinator: &Arc<MapCoordinator>,
        on_failure: OnFailure,
    ) -> (Outbox<u8>, Arc<AtomicBool>) {
        let gone = Arc::new(AtomicBool::new(false));
        let flag = gone.clone();
        let outbox = Outbox::spawn(
            coordinator.clone(),
            "ch".into(),
            on_failure,
            |_, items| Some(items),
            move || flag.store(true, Ordering::SeqCst),
        );
        (outbox, gone)
    }

    #[tokio::test(start_paused = true)]
    async fn a_listener_that_subscribes_again_within_the_grace_gets_the_message() {
        let coordinator = Arc::new(MapCoordinator::with_pubsub());
        let (outbox, gone) = outbox(&coordinator, OnFailure::Retry);
        // Nobody listens for a while (a pub/sub connection dropped), then the listener is back.
        assert!(outbox.push(7));
        tokio::time::sleep(UNHEARD_GRACE / 2).await;
        let mut rx = coordinator.subscribe("ch").await.unwrap();
        let heard = tokio::time::timeout(UNHEARD_GRACE, rx.recv())
            .await
            .unwrap();
        assert_eq!(heard, Some(vec![7]));
        assert!(!gone.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_listener_absent_past_the_grace_is_gone_and_without_grace_at_once() {
        let coordinator = Arc::new(MapCoordinator::with_pubsub());
        let (retrying, retrying_gone) = outbox(&coordinator, OnFailure::Retry);
        let (giving_up, giving_up_gone) = outbox(&coordinator, OnFailure::GiveUp);
        assert!(retrying.push(1) && giving_up.push(1));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(giving_up_gone.load(Ordering::SeqCst));
        assert!(!retrying_gone.load(Ordering::SeqCst));
        tokio::time::sleep(UNHEARD_GRACE + MAX_PAUSE).await;
        assert!(retrying_gone.load(Ordering::SeqCst));
        assert!(
            !retrying.push(2),
            "an outbox that gave up takes nothing more"
        );
    }
}
