//! The row commits beside the dispatch (issue 12, item 5): the work reaches the node while
//! the reservation is still in flight, nothing reaches the client before it has committed,
//! and a reservation refused after the dispatch stops the node and bills nothing — its
//! `done` is acked as stale wherever it lands.

use async_trait::async_trait;
use tokio::sync::Semaphore;

use super::*;
use crate::ports::{Ledger, LedgerEntry, LedgerError, SettleOutcome, Settlement};

/// A ledger whose reservations wait for a permit, then go to the memory ledger (or are
/// refused for the balance).
#[derive(Debug)]
pub(super) struct GatedLedger {
    inner: Arc<MemoryLedger>,
    pub(super) gate: Semaphore,
    refuse: bool,
}

#[async_trait]
impl Ledger for GatedLedger {
    async fn reserve(&self, reservation: &Reservation) -> Result<(), LedgerError> {
        self.gate.acquire().await.unwrap().forget();
        if self.refuse {
            return Err(LedgerError::InsufficientBalance);
        }
        self.inner.reserve(reservation).await
    }
    async fn settle(&self, settlement: &Settlement) -> Result<SettleOutcome, LedgerError> {
        self.inner.settle(settlement).await
    }
    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        self.inner.cancel(request_id).await
    }
    async fn entry(&self, request_id: &str) -> Result<Option<LedgerEntry>, LedgerError> {
        self.inner.entry(request_id).await
    }
}

/// Starts `id` through `ledger` in the background (its admission answers only once the row
/// has committed).
pub(super) fn start_gated(
    h: &Harness,
    id: &str,
    ledger: Arc<GatedLedger>,
) -> tokio::task::JoinHandle<Result<GenerationStream, crate::error::Failure>> {
    let (args, rx) = generation_args(h, id, ledger, None, crate::ports::UsageBounds::UNBOUNDED);
    let gens = h.gens.clone();
    tokio::spawn(async move { gens.start_generation(args, rx).await })
}

pub(super) fn gated(h: &Harness, refuse: bool) -> Arc<GatedLedger> {
    Arc::new(GatedLedger {
        inner: h.ledger.clone(),
        gate: Semaphore::new(0),
        refuse,
    })
}

#[tokio::test(start_paused = true)]
async fn the_node_starts_while_the_row_commits_and_the_client_sees_nothing_before() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let ledger = gated(&h, false);
    let started = start_gated(&h, "r1", ledger.clone());
    // The work is sent with the reservation still in flight.
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    assert!(h.ledger.row("r1").is_none(), "no row yet");
    node.deliver(chunk("r1", 1, 0, "Hel"));
    node.deliver(chunk("r1", 1, 1, "lo"));
    settle_a_moment().await;
    assert!(!started.is_finished(), "admitted before its row committed");
    ledger.gate.add_permits(1);
    let mut stream = started.await.unwrap().unwrap();
    assert_eq!(stream.next().await, Some(GenEvent::Delta("Hel".into())));
    assert_eq!(stream.next().await, Some(GenEvent::Delta("lo".into())));
    node.deliver(done("r1", 1, 12, 2, "stop"));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    let row = h.ledger.row("r1").unwrap();
    assert_eq!(
        (row.status, row.completion_tokens, row.transitions),
        (RowStatus::Settled, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_row_refused_after_the_dispatch_cancels_the_node_and_bills_nothing() {
    let h = harness(8, 4).await;
    let (node, mut out) = connect(&h, "n1").await;
    let ledger = gated(&h, true);
    let started = start_gated(&h, "r1", ledger.clone());
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    node.deliver(chunk("r1", 1, 0, "Hel"));
    settle_a_moment().await;
    ledger.gate.add_permits(1);
    let err = started.await.unwrap().unwrap_err();
    assert_eq!(err.code, ErrorCode::InsufficientBalance);
    assert!(matches!(
        out.recv().await,
        Some(ServerFrame::Cancel { attempt: 1, .. })
    ));
    // The node's `done` lands with no generation: no row, nothing billed, acked.
    node.deliver(done("r1", 1, 12, 1, "abort"));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    assert!(
        h.ledger.row("r1").is_none(),
        "a refused request bills nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn a_replica_gone_before_the_row_committed_bills_only_what_the_row_allows() {
    // Crash point: the work was sent, the generation is gone (the replica stopped) before
    // the reservation answered. If the row never commits, the node's resent `done` bills
    // nothing; if it commits, the `done` settles it — once.
    for commits in [false, true] {
        let h = harness(8, 4).await;
        let (node, mut out) = connect(&h, "n1").await;
        let ledger = gated(&h, false);
        let started = start_gated(&h, "r1", ledger.clone());
        assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
        h.gens.stop();
        settle_a_moment().await;
        assert!(started.await.unwrap().is_err());
        if commits {
            ledger.gate.add_permits(1);
            settle_a_moment().await;
            assert_eq!(h.ledger.row("r1").unwrap().status, RowStatus::Reserved);
        }
        node.deliver(done("r1", 1, 12, 3, "stop"));
        assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
        match h.ledger.row("r1") {
            None => assert!(!commits),
            Some(row) => {
                assert!(commits);
                assert_eq!(
                    (row.status, row.completion_tokens, row.transitions),
                    (RowStatus::Settled, 3, 1)
                );
            }
        }
    }
}
