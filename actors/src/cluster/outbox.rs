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
/// on the channel any more (a publish reached no subscriber) — or, with
/// [`OnFailure::GiveUp`], the coordinator fails — it calls `on_gone` once and stops: later
/// pushes return false.
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
    /// only a publish that reaches nobody says the listener is gone. For what a listener
    /// that is alive must not be taken for dead over (a node's frames: what a replica does
    /// for a generation it thinks gone — settling its usage — is wrong while it lives).
    Retry,
}

/// The first wait before a failed publish is tried again; it doubles up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(2);

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
                loop {
                    match coordinator.publish(&channel, payload.clone()).await {
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
