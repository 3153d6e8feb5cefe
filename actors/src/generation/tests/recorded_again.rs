//! Redis restarted empty under a running generation: its holders record is gone, and a
//! `done` arriving where the generation is not live (its node's socket moved) would find
//! nobody to vouch for it. The replica's epoch watch sees the loss and the generation writes
//! its record again: the node that holds the attempt, and this replica.

use super::*;
use crate::attempts::{Holder, lookup};
use crate::cluster::{CHECK_EVERY, Epoch, spawn_epoch_watch};
use tokio_util::sync::CancellationToken;

#[tokio::test(start_paused = true)]
async fn a_running_generation_records_its_attempt_again_after_the_coordinator_lost_it() {
    let h = harness(8, 4).await;
    let stop = CancellationToken::new();
    let epoch = Epoch::new(h.coord.clone(), "r1", &SystemClock);
    spawn_epoch_watch(epoch, h.gens.directory().clone(), stop.clone());
    let (node, mut out) = connect(&h, "n1").await;
    let mut stream = start(&h, "req-1").await.unwrap();
    let (id, attempt) = expect_assign(&mut out).await;
    node.deliver(chunk(&id, attempt, 0, "Hel"));
    assert!(matches!(stream.next().await, Some(GenEvent::Delta(_))));

    h.coord.lose_everything();
    let lost = lookup(h.coord.as_ref(), &id, attempt).await.unwrap();
    assert_eq!(lost.holder, Holder::Unrecorded);
    // The watch looks once a `CHECK_EVERY` (it wrote the epoch at its first look).
    tokio::time::sleep(CHECK_EVERY * 2).await;

    let found = lookup(h.coord.as_ref(), &id, attempt).await.unwrap();
    assert_eq!(found.holder, Holder::Node("n1".into()));
    assert_eq!(found.replica.as_deref(), Some("r1"));

    // Finished, it records nothing more: a second loss leaves no record behind.
    node.deliver(done(&id, attempt, 10, 1, "stop"));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    settle_a_moment().await;
    h.coord.lose_everything();
    tokio::time::sleep(CHECK_EVERY * 2).await;
    let gone = lookup(h.coord.as_ref(), &id, attempt).await.unwrap();
    assert_eq!(gone.holder, Holder::Unrecorded);
    stop.cancel();
}
