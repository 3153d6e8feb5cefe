//! Redis restarted empty under a running generation: its holders record is gone, and a
//! `done` arriving where the generation is not live (its node's socket moved) would find
//! nobody to vouch for it. The replica's epoch watch sees the loss and the generation writes
//! its record again: the node that holds the attempt, and this replica.

use super::*;
use crate::attempts::{Holder, Recorder, lookup};
use crate::cluster::{CHECK_EVERY, Epoch, spawn_epoch_watch, to_replica};
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

#[tokio::test(start_paused = true)]
async fn a_done_no_record_names_yet_goes_to_its_generation_once_the_record_is_back() {
    let mut h = harness(8, 4).await;
    h.coord = Arc::new(MapCoordinator::shared());
    let (node, mut out) = connect(&h, "n1").await;
    let mut relayed = h.coord.subscribe(&to_replica("r2")).await.unwrap();

    // The done of a generation running on r2 arrives here just after Redis came back empty:
    // no record names its attempt, so it is neither settled nor acked.
    node.deliver(done("elsewhere", 1, 10, 3, "stop"));
    settle_a_moment().await;
    assert!(out.try_recv().is_err(), "an unrecorded done was acked");
    assert!(relayed.try_recv().is_err());

    // r2's epoch watch records the attempt again; the done goes there within a second,
    // without the node sending it again (it would, only after 30 s: past the deadline).
    let recorder = Recorder {
        coordinator: h.coord.clone(),
        replica_id: "r2".into(),
    };
    let holders = BTreeMap::from([(1, "n1".to_owned())]);
    recorder
        .record("elsewhere", &holders, Duration::from_secs(60))
        .await
        .unwrap();
    tokio::time::sleep(crate::node::LOOK_AGAIN).await;
    settle_a_moment().await;
    let payload = relayed.try_recv().expect("the done relayed to r2");
    let relay: serde_json::Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(relay["node_id"], "n1");
    assert!(
        payload.windows(9).any(|w| w == b"elsewhere"),
        "the relay carries the done"
    );
}
