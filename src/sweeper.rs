//! The reservation sweeper: a ledger row still `reserved` after the longest a request may
//! take (total timeout, plus the wait for a node's usage report, plus margin) belongs to a
//! generation that can no longer settle it — its replica died and its node never reported.
//! The sweeper cancels such rows so their reserved credit returns to the team. Every
//! replica runs it, and the one holding the `sweeper` lease in the coordinator sweeps: one
//! replica at a time, another within a period after it dies (the cancel is conditional
//! besides, so even two sweeps would never conflict).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use switchyard_actors::ports::{Clock, Coordinator, SettleOutcome};
use tokio_util::sync::CancellationToken;

use crate::store::{Store, StoreError};

/// Rows handled per pass.
const BATCH: i64 = 500;

/// Cancels the rows still reserved that were created before `before`; returns how many it
/// cancelled.
pub async fn sweep(store: &dyn Store, before: DateTime<Utc>) -> Result<usize, StoreError> {
    let mut cancelled = 0;
    for request_id in store.stale_reservations(before, BATCH).await? {
        match store.cancel(&request_id).await {
            Ok(SettleOutcome::Applied) => {
                cancelled += 1;
                tracing::warn!(%request_id, "swept a reservation that outlived every deadline");
            }
            Ok(_) => {}
            Err(e) => return Err(StoreError::Unavailable(e.to_string())),
        }
    }
    Ok(cancelled)
}

/// The lease naming the replica that sweeps.
pub const SWEEPER_LEASE: &str = "sweeper";

/// Runs [`sweep`] every `every` for rows older than `max_age`, and expires generation records
/// past their slot's bound (dropping results older than `retention_ms`), until `stop` — on
/// the periods this replica holds the [`SWEEPER_LEASE`] (three periods long, renewed each
/// period).
#[allow(clippy::too_many_arguments)]
pub async fn run(
    store: Arc<dyn Store>,
    coordinator: Arc<dyn Coordinator>,
    replica_id: String,
    clock: Arc<dyn Clock>,
    every: Duration,
    max_age: Duration,
    retention_ms: i64,
    stop: CancellationToken,
) {
    let _guard = switchyard_actors::tasks::TaskGuard::new("sweeper");
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        match coordinator
            .acquire_lease(SWEEPER_LEASE, &replica_id, every * 3)
            .await
        {
            Ok(Some(_)) => {}
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "cannot take the sweeper lease; not sweeping this period");
                continue;
            }
        }
        let Ok(age) = chrono::Duration::from_std(max_age) else {
            continue;
        };
        if let Err(e) = sweep(store.as_ref(), clock.wall() - age).await {
            tracing::warn!(error = %e, "reservation sweep failed; retrying next period");
        }
        let now_ms = clock.wall().timestamp_millis();
        match store.sweep_generations(now_ms, retention_ms).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(expired = n, "expired generations that outlived their slot"),
            Err(e) => tracing::warn!(error = %e, "generation sweep failed; retrying next period"),
        }
    }
}
