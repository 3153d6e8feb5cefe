//! Where a node's socket is, its count of the node's work is squared with the node's own
//! heartbeat (`node::squared`): an assignment the node no longer lists (its `done` lost on
//! the way) gives its slot back and ends as on a lost node, while one whose `assign` crossed
//! the heartbeat on the wire keeps its slot. Here the node has room for one.

use super::*;
use crate::protocol::{Held, PROTOCOL_VERSION};

/// A heartbeat listing the assignments the node holds.
fn listing(held: &[(&str, u64)]) -> NodeFrame {
    NodeFrame::Heartbeat {
        queue_depth: 0,
        running: held.len() as u64,
        kv_cache_usage: 0.0,
        gpu_util: 0.0,
        models: vec![MODEL.into()],
        engine_counters: None,
        assignments: Some(
            held.iter()
                .map(|&(request_id, attempt)| Held {
                    request_id: request_id.into(),
                    attempt,
                })
                .collect(),
        ),
    }
}

fn accepted(id: &str, attempt: u64) -> NodeFrame {
    NodeFrame::Accepted {
        request_id: id.into(),
        attempt,
    }
}

async fn node_of_one(h: &Harness) -> (NodeHandle, mpsc::Receiver<ServerFrame>) {
    let one = [(MODEL.to_string(), 1)].into();
    connect_with(h, "n1", PROTOCOL_VERSION, one).await
}

#[tokio::test(start_paused = true)]
async fn a_slot_the_heartbeat_no_longer_lists_comes_back_and_a_fresh_assign_keeps_its_own() {
    let h = harness(8, 4).await;
    let (node, mut out) = node_of_one(&h).await;
    let mut first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    node.deliver(accepted("r1", 1));
    node.deliver(chunk("r1", 1, 0, "partial"));
    assert_eq!(first.next().await, Some(GenEvent::Delta("partial".into())));

    // Listed while it runs; then its `done` is lost and the next heartbeat leaves it out.
    node.deliver(listing(&[("r1", 1)]));
    node.deliver(listing(&[]));
    settle_a_moment().await;
    assert_eq!(
        out.try_recv().ok(),
        Some(ServerFrame::Cancel {
            request_id: "r1".into(),
            attempt: 1
        })
    );
    let Some(GenEvent::Failed(f)) = first.next().await else {
        panic!("the generation hears its node lost it")
    };
    assert_eq!(f.code, ErrorCode::ModelBackendError);

    // The slot is back: the next request runs on the node instead of being refused.
    let mut second = start(&h, "r2").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r2".into(), 1));
    // A heartbeat built before the node read that `assign`, and one built before its
    // `accepted` was sent, take nothing from it.
    node.deliver(listing(&[]));
    node.deliver(accepted("r2", 1));
    node.deliver(listing(&[]));
    settle_a_moment().await;
    assert!(out.try_recv().is_err(), "nothing cancelled on the node");
    node.deliver(listing(&[("r2", 1)]));
    node.deliver(chunk("r2", 1, 0, "whole"));
    node.deliver(done("r2", 1, 3, 1, "stop"));
    assert_eq!(second.next().await, Some(GenEvent::Delta("whole".into())));
    assert!(matches!(second.next().await, Some(GenEvent::Finished(_))));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
}

#[tokio::test(start_paused = true)]
async fn an_assign_the_node_never_took_is_given_back_after_the_heartbeat_timeout() {
    let h = harness(8, 4).await;
    let (node, mut out) = node_of_one(&h).await;
    let _stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    // The node never read it: every heartbeat leaves it out, and until the heartbeat
    // timeout it may still be on its way.
    for wait in [5, 5, 4] {
        tokio::time::sleep(Duration::from_secs(wait)).await;
        node.deliver(listing(&[]));
    }
    settle_a_moment().await;
    assert!(out.try_recv().is_err(), "kept while it may be on its way");
    tokio::time::sleep(Duration::from_secs(1)).await;
    node.deliver(listing(&[]));
    settle_a_moment().await;
    assert_eq!(
        out.try_recv().ok(),
        Some(ServerFrame::Cancel {
            request_id: "r1".into(),
            attempt: 1
        })
    );
    // The generation waits out the attempt's lease, then runs it again on the freed slot.
    let beating = node.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            beating.deliver(listing(&[("r1", 2)]));
        }
    });
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 2));
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_without_a_listing_squares_nothing() {
    let h = harness(8, 4).await;
    let (node, mut out) = node_of_one(&h).await;
    let _stream = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("r1".into(), 1));
    node.deliver(accepted("r1", 1));
    let mut older = listing(&[]);
    if let NodeFrame::Heartbeat { assignments, .. } = &mut older {
        *assignments = None;
    }
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        node.deliver(older.clone());
    }
    settle_a_moment().await;
    assert!(
        out.try_recv().is_err(),
        "an older agent's work is never reclaimed"
    );
}
