//! [`StoreAccounting`]: the [`NodeAccounting`] port over the store. Node actors hand it each
//! heartbeat's interval and go on; one task writes them to `node_days` in order. A full
//! queue or a failed write drops the interval with a warning (the report loses a few
//! seconds), never the node actor's time.

use std::sync::Arc;

use switchyard_actors::ports::{NodeAccounting, NodeDayUsage};
use tokio::sync::mpsc;

use super::Store;

/// Intervals waiting to be written: a minute of heartbeats from 1,000 nodes at the 5 s
/// interval is 12,000; a database slower than that for longer loses intervals, not memory.
pub const ACCOUNTING_QUEUE: usize = 16_384;

/// See the module documentation. Cloning shares the queue.
#[derive(Debug, Clone)]
pub struct StoreAccounting {
    queue: mpsc::Sender<NodeDayUsage>,
}

impl StoreAccounting {
    /// Starts the writer task over `store`; it ends when every clone of the handle is gone.
    pub fn spawn(store: Arc<dyn Store>) -> Self {
        let (queue, mut rx) = mpsc::channel::<NodeDayUsage>(ACCOUNTING_QUEUE);
        tokio::spawn(async move {
            while let Some(usage) = rx.recv().await {
                if let Err(e) = store.add_node_day(&usage).await {
                    tracing::warn!(node_id = %usage.node_id, error = %e, "could not record a node's uptime; interval dropped");
                }
            }
        });
        Self { queue }
    }
}

impl NodeAccounting for StoreAccounting {
    fn record(&self, usage: NodeDayUsage) {
        if let Err(mpsc::error::TrySendError::Full(usage)) = self.queue.try_send(usage) {
            tracing::warn!(node_id = %usage.node_id, "node uptime queue full; interval dropped");
        }
    }
}
