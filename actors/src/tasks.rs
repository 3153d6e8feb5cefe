//! `switchyard_tasks_alive`: every actor and connection task holds a [`TaskGuard`] for its
//! lifetime, so the gauge returns to its baseline when work ends — the leak detector that
//! catches streams not bound to their request.

use std::sync::atomic::{AtomicI64, Ordering};

use crate::metric_names::TASKS_ALIVE;

static ALIVE: AtomicI64 = AtomicI64::new(0);

/// Counts one live task from creation to drop.
#[derive(Debug)]
pub struct TaskGuard {
    kind: &'static str,
}

impl TaskGuard {
    /// Registers a live task of `kind` (`generation`, `node`, `model_queue`, …).
    pub fn new(kind: &'static str) -> Self {
        let n = ALIVE.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::gauge!(TASKS_ALIVE).set(n as f64);
        metrics::gauge!(TASKS_ALIVE_BY_KIND, "kind" => kind).increment(1.0);
        Self { kind }
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        let n = ALIVE.fetch_sub(1, Ordering::Relaxed) - 1;
        metrics::gauge!(TASKS_ALIVE).set(n as f64);
        metrics::gauge!(TASKS_ALIVE_BY_KIND, "kind" => self.kind).decrement(1.0);
    }
}

const TASKS_ALIVE_BY_KIND: &str = "switchyard_tasks_alive_by_kind";

/// Live tasks in this process right now.
pub fn alive() -> i64 {
    ALIVE.load(Ordering::Relaxed)
}
