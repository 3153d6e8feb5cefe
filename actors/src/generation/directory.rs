//! The live generations of this replica by request id. A `done` resent after a node
//! reconnects arrives on a new connection that never carried the assignment; the directory
//! lets it find the generation still waiting for it. Passed explicitly, never global.

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
