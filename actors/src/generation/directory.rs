//! The live generations of this replica by request id. A `done` resent after a node
//! reconnects arrives on a new connection that never carried the assignment; the directory
//! lets it find the generation still waiting for it; the supervisors broadcast through it
//! when a queue restarts or a node actor crashes. Passed explicitly, never global.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use ractor::ActorRef;

use super::GenerationMsg;

/// Shared map of live generations.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    inner: Arc<Mutex<BTreeMap<String, ActorRef<GenerationMsg>>>>,
}

impl Directory {
    /// The live generation of `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Option<ActorRef<GenerationMsg>> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(request_id)
            .cloned()
    }

    pub(crate) fn insert(&self, request_id: &str, actor: ActorRef<GenerationMsg>) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(request_id.to_owned(), actor);
    }

    /// Removes `request_id` if it still names `actor`: a generation admitted again under
    /// the same id may already have taken the entry.
    pub(crate) fn remove(&self, request_id: &str, actor: ractor::ActorId) {
        let mut map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(request_id).is_some_and(|a| a.get_id() == actor) {
            map.remove(request_id);
        }
    }

    /// Every live generation (a snapshot: the lock is not held while they are messaged).
    pub fn live(&self) -> Vec<ActorRef<GenerationMsg>> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Casts `make()` to every live generation; returns how many took it. Each decides for
    /// itself whether the news concerns it (its model, its node), so nothing is missed while
    /// the directory changes.
    pub(crate) fn broadcast(&self, make: impl Fn() -> GenerationMsg) -> usize {
        self.live()
            .into_iter()
            .filter(|g| g.cast(make()).is_ok())
            .count()
    }

    /// Number of live generations.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no generation is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
