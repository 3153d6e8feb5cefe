//! Cache-aware routing across replicas: a follower sends a long prompt's blocks with its
//! enqueue, and the queue's owner — the one replica that sees where every prompt went —
//! places it by prefix.

use switchyard_actors::model_queue::RoutingStrategy;

use super::cluster;
use crate::common::routing::{
    ask_at, assert_each_turn_hit_its_previous_prompt, in_flight, load_node, next_turn, only_on,
    opening, system_prompt, tweak,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_entering_a_follower_is_placed_by_prefix_on_the_owner() {
    let c = cluster(2, 2, 20.0, |config| {
        tweak(config, RoutingStrategy::CacheAware)
    })
    .await;
    let owner = c.wait_queue_owner().await;
    let replicas = c.fleet.replicas();
    let owner_at = (0..2)
        .find(|i| replicas[*i].state().replica_id == owner)
        .unwrap();
    let follower = 1 - owner_at;
    let base = format!("{}/v1", replicas[follower].base_url());

    let mut messages = opening("Harbour", "Which track for the first train?");
    let first = ask_at(&c.fleet, &base, &messages, 24, None).await;
    // Held streams, sent through the follower too, make the conversation's node the busier
    // one in the owner's eyes: by load alone the next turns would go to the other node.
    let held = load_node(
        &c.fleet,
        &base,
        first.node,
        &system_prompt("Harbour"),
        4,
        owner_at,
    )
    .await;
    let mut turns = vec![first.clone()];
    for turn in 2..=3 {
        next_turn(&mut messages, turns.last().unwrap(), turn);
        turns.push(ask_at(&c.fleet, &base, &messages, 24, None).await);
    }
    assert!(
        turns.iter().all(|t| t.node == first.node),
        "every turn on the node holding the conversation: {turns:#?}"
    );
    assert_each_turn_hit_its_previous_prompt(&turns);
    assert_eq!(
        in_flight(&c.fleet, owner_at).await,
        only_on(&c.fleet, first.node, 4)
    );
    // The owner placed them all: the follower started none on its capacity grants.
    let model = &c.fleet.nodes[0].model;
    let stats = replicas[follower].state().queues[model]
        .stats()
        .await
        .unwrap();
    assert_eq!(stats.on_grant, 0);
    drop(held);
    c.stop().await;
}
