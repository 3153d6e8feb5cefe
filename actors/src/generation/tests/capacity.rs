//! Where a node's socket is, its actor holds the node to its capacity of each model whatever
//! the queues believe. They can believe too little: an `assign` relayed just before its
//! owner's link to Redis stalled arrives after the other replicas dropped the node, forgot
//! what they had counted on it and filled it again (the simulation, seeds 1195, 1675, 2195:
//! five assignments on a node of four). Here the queue believes a node carries four while its
//! socket's actor knows it carries one.

use super::*;
use crate::cluster::{NODES_CHANNEL, NodeNews};
use crate::protocol::PROTOCOL_VERSION;

#[tokio::test(start_paused = true)]
async fn a_nodes_socket_refuses_an_assign_past_its_capacity_and_the_generation_goes_elsewhere() {
    let h = harness(8, 4).await;
    let one = [(MODEL.to_string(), 1)].into();
    let (full, mut full_out) = connect_with(&h, "n1", PROTOCOL_VERSION, one).await;
    let mut first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut full_out).await, ("r1".into(), 1));

    // The queue counts one of four on n1 and, with n2 as loaded, may choose n1 again: its
    // socket refuses (`not_sent`, proven never started) and the generation goes to n2.
    let (_other, mut other_out) = connect(&h, "n2").await;
    let mut streams = Vec::new();
    for n in 2..=4 {
        let id = format!("r{n}");
        streams.push(start(&h, &id).await.unwrap());
        assert_eq!(expect_assign(&mut other_out).await.0, id);
        settle_a_moment().await;
        assert!(full_out.try_recv().is_err(), "n1 got a second assignment");
    }

    // The first ends: n1 has room again.
    full.deliver(done("r1", 1, 3, 0, "stop"));
    assert!(matches!(first.next().await, Some(GenEvent::Finished(_))));
    assert!(matches!(
        full_out.recv().await,
        Some(ServerFrame::Ack { .. })
    ));
    streams.push(start(&h, "r5").await.unwrap());
    let (id, _) = tokio::select! {
        a = expect_assign(&mut full_out) => a,
        b = expect_assign(&mut other_out) => b,
    };
    assert_eq!(id, "r5");
}

#[tokio::test(start_paused = true)]
async fn an_assign_the_socket_refuses_gives_its_queue_slot_back_at_once() {
    let h = harness(8, 4).await;
    let one = [(MODEL.to_string(), 1)].into();
    let (_full, mut full_out) = connect_with(&h, "n1", PROTOCOL_VERSION, one).await;
    let _first = start(&h, "r1").await.unwrap();
    assert_eq!(expect_assign(&mut full_out).await, ("r1".into(), 1));

    // The queue believes n1 has three more places: the second goes there and is refused.
    let mut news = h.coord.subscribe(NODES_CHANNEL).await.unwrap();
    let _second = start(&h, "r2").await.unwrap();
    settle_a_moment().await;
    assert!(full_out.try_recv().is_err(), "n1 got a second assignment");

    // Every other replica's queue hears at once what n1 carries, to be squared both ways:
    // the owner's above all, which counts every replica's work on it.
    let exact = std::iter::from_fn(|| news.try_recv().ok())
        .filter_map(|payload| serde_json::from_slice::<NodeNews>(&payload).ok())
        .find_map(|n| match n {
            NodeNews::Node(a) if a.exact => Some(a),
            _ => None,
        })
        .expect("an exact announcement of n1");
    assert_eq!(exact.node_id, "n1");
    let own: BTreeMap<String, u32> = [("r1".to_owned(), 1)].into();
    assert_eq!(exact.carried, BTreeMap::from([(MODEL.to_owned(), own)]));

    // The refused dispatch's slot is back: the queue counts only what n1 runs (before, it
    // counted the refused one too until the node's socket said what it carries).
    let stats = h.queue.stats().await.unwrap();
    let counted: Vec<(String, u32)> = stats.nodes.into_iter().map(|(id, n, _)| (id, n)).collect();
    assert_eq!(counted, vec![("n1".to_owned(), 1)]);
}
