//! A node that leaves a queue's view while its work goes on (a relayed node whose
//! heartbeats stalled behind its replica's Redis link) returns with that work counted.

use super::*;
use crate::node::NodeLoad;

#[tokio::test(start_paused = true)]
async fn a_node_back_in_view_still_counts_what_runs_there() {
    let h = harness(8, 1).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut first = start(&h, "a").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("a".into(), 1));
    node.deliver(NodeFrame::Accepted {
        request_id: "a".into(),
        attempt: 1,
    });
    // The queue loses sight of the node and sees it again; "a" runs on through it all.
    h.queue.node_down(&node);
    settle_a_moment().await;
    h.queue.node_up(node.clone(), NodeLoad::default());
    settle_a_moment().await;
    let mut second = start(&h, "b").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        out.try_recv().is_err(),
        "the node's one slot is still a's: b must wait"
    );
    node.deliver(done("a", 1, 10, 0, "stop"));
    assert!(matches!(first.next().await, Some(GenEvent::Finished(_))));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    assert_eq!(expect_assign(&mut out).await, ("b".into(), 1));
    node.deliver(done("b", 1, 10, 0, "stop"));
    assert!(matches!(second.next().await, Some(GenEvent::Finished(_))));
}

#[tokio::test(start_paused = true)]
async fn work_that_ends_while_its_node_is_away_frees_the_slot_for_its_return() {
    let h = harness(8, 1).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut first = start(&h, "a").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("a".into(), 1));
    h.queue.node_down(&node);
    settle_a_moment().await;
    node.deliver(done("a", 1, 10, 0, "stop"));
    assert!(matches!(first.next().await, Some(GenEvent::Finished(_))));
    assert!(matches!(out.recv().await, Some(ServerFrame::Ack { .. })));
    settle_a_moment().await;
    h.queue.node_up(node.clone(), NodeLoad::default());
    let _second = start(&h, "b").await.unwrap();
    assert_eq!(expect_assign(&mut out).await, ("b".into(), 1));
}
