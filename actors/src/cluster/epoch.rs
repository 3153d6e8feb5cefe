//! Noticing that the coordinator lost its data. Redis restarted without persistence, an
//! ElastiCache node replaced, a Redis pod rescheduled: the store answers again, empty. Most
//! of what it held heals by itself — leases are taken again with tokens that never go back
//! (`NEXT_FENCE`), a node's owner writes its hash again with the next heartbeat — but a
//! generation writes its holders record (`attempts:{id}`, see [`crate::attempts`]) only at
//! admission and at each dispatch. Without it a `done` arriving where the generation is not
//! live (its node's socket moved to another replica) cannot find the generation, and waits
//! to be settled unverified. So every replica keeps an eye on one key, `epoch`, written once
//! by whoever finds it missing and never expiring in practice: when it changes or vanishes
//! the data was lost, and every live generation on the replica records itself again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::generation::{Directory, GenerationMsg};
use crate::metric_names::COORDINATOR_DATA_LOST_TOTAL;
use crate::ports::{Clock, CoordError, Coordinator};
use crate::tasks::TaskGuard;

/// The key every replica watches.
const EPOCH_KEY: &str = "epoch";
/// Its one field: who wrote it, and when.
const ID: &str = "id";
/// How often a replica looks: well inside a lease, so the records are back before the
/// nodes' resent `done`s need them.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);
/// The key's lifetime: only a loss ends it.
const EPOCH_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// One replica's memory of the epoch.
#[derive(Debug)]
pub struct Epoch {
    coordinator: Arc<dyn Coordinator>,
    /// What this replica writes when the key is missing: its id and its start (wall time in
    /// milliseconds), then how many times it wrote it.
    writer: String,
    writes: u64,
    /// The epoch seen last (`None` before the first look).
    known: Option<String>,
}

impl Epoch {
    /// A replica that has not looked yet.
    pub fn new(coordinator: Arc<dyn Coordinator>, replica_id: &str, clock: &dyn Clock) -> Self {
        Self {
            coordinator,
            writer: format!("{replica_id}:{}", clock.wall().timestamp_millis()),
            writes: 0,
            known: None,
        }
    }

    /// Looks at the key (writing a new epoch when it is missing); true when it vanished or
    /// changed since the last look: the data was lost in between. Two replicas finding it
    /// missing at once may both write it; the one overwritten sees a change at its next look,
    /// which costs one more round of records and nothing else.
    pub async fn lost_since_last_look(&mut self) -> Result<bool, CoordError> {
        let current = self
            .coordinator
            .get_hash(EPOCH_KEY)
            .await?
            .and_then(|mut fields| fields.remove(ID));
        let (current, lost) = match current {
            Some(id) => {
                let lost = self.known.as_ref().is_some_and(|known| *known != id);
                (id, lost)
            }
            None => (self.write().await?, self.known.is_some()),
        };
        self.known = Some(current);
        Ok(lost)
    }

    /// Writes a new epoch, never one written before.
    async fn write(&mut self) -> Result<String, CoordError> {
        self.writes += 1;
        let id = format!("{}:{}", self.writer, self.writes);
        let fields = BTreeMap::from([(ID.to_owned(), id.clone())]);
        self.coordinator
            .put_hash(EPOCH_KEY, &fields, EPOCH_TTL)
            .await?;
        Ok(id)
    }
}

/// Watches the epoch every [`CHECK_EVERY`] until `stop`; after a loss every generation live
/// in `directory` records its holders again ([`GenerationMsg::RecordAgain`]).
pub fn spawn_epoch_watch(mut epoch: Epoch, directory: Directory, stop: CancellationToken) {
    tokio::spawn(async move {
        let _guard = TaskGuard::new("coordinator_epoch");
        loop {
            match epoch.lost_since_last_look().await {
                Ok(true) => {
                    metrics::counter!(COORDINATOR_DATA_LOST_TOTAL).increment(1);
                    let told = directory.broadcast(|| GenerationMsg::RecordAgain);
                    tracing::warn!(
                        generations = told,
                        "the coordinator came back without its data; live generations record their attempts again"
                    );
                }
                Ok(false) => {}
                // Unreachable now: looked at again once it answers.
                Err(e) => tracing::debug!(error = %e, "cannot read the coordinator's epoch"),
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(CHECK_EVERY) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used)]

    use super::*;
    use crate::ports::SystemClock;
    use crate::ports::memory::MapCoordinator;

    #[tokio::test]
    async fn a_loss_is_seen_once_and_only_after_a_first_look() {
        let coordinator = Arc::new(MapCoordinator::default());
        let mut a = Epoch::new(coordinator.clone(), "a", &SystemClock);
        let mut b = Epoch::new(coordinator.clone(), "b", &SystemClock);
        assert!(!a.lost_since_last_look().await.unwrap(), "a first look");
        assert!(
            !b.lost_since_last_look().await.unwrap(),
            "b finds a's epoch"
        );
        assert!(!a.lost_since_last_look().await.unwrap(), "nothing lost");
        coordinator.lose_everything();
        assert!(
            b.lost_since_last_look().await.unwrap(),
            "b finds it missing"
        );
        assert!(
            a.lost_since_last_look().await.unwrap(),
            "a finds b's new one"
        );
        assert!(!a.lost_since_last_look().await.unwrap(), "seen once");
        assert!(!b.lost_since_last_look().await.unwrap(), "seen once");
    }
}
