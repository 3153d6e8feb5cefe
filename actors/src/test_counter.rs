//! A counter cell for the tests' own metrics recorders: the value a test reads back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::CounterFn;

#[derive(Debug)]
pub(crate) struct CounterCell(pub(crate) Arc<AtomicU64>);

impl CounterFn for CounterCell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}
