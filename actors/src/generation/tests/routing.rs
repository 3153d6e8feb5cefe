//! `cache_aware` routing through a real queue: a prompt goes back to the node that holds its
//! blocks even when that node is busier, and a node that disconnects, or is replaced by a new
//! connection, comes back without that credit — the next request with the same prompt goes
//! by load.

use super::*;
use crate::model_queue::RouteKey;

/// A prompt of 1,000 tokens whose 62 full blocks are named `first..first + 62`.
fn route(first: u64) -> Arc<RouteKey> {
    Arc::new(RouteKey {
        blocks: (first..first + 62).collect(),
        block_size: 16,
        prompt_tokens: 1000,
        session: None,
    })
}

/// Starts generation `id` with `route` (`None`: nothing known of its prompt).
async fn start_routed(h: &Harness, id: &str, route: Option<Arc<RouteKey>>) -> GenerationStream {
    let (args, rx) = generation_args(
        h,
        id,
        h.ledger.clone(),
        None,
        crate::ports::UsageBounds::UNBOUNDED,
    );
    h.gens
        .start_generation(GenerationArgs { route, ..args }, rx)
        .await
        .unwrap()
}

/// Which of `outs` received the assignment of `id` (other frames are skipped).
async fn assigned(outs: &mut [&mut mpsc::Receiver<ServerFrame>], id: &str) -> usize {
    for _ in 0..200 {
        settle_a_moment().await;
        for (i, out) in outs.iter_mut().enumerate() {
            while let Ok(frame) = out.try_recv() {
                if let ServerFrame::Assign { request_id, .. } = frame
                    && request_id == id
                {
                    return i;
                }
            }
        }
    }
    panic!("{id} was never assigned");
}

/// Ends `id` on `node` and waits for its stream to finish (its slot is free again).
async fn finish(node: &NodeHandle, id: &str, stream: &mut GenerationStream) {
    node.deliver(done(id, 1, 1000, 1, "stop"));
    assert!(matches!(stream.next().await, Some(GenEvent::Finished(_))));
    settle_a_moment().await;
}

/// The queue's in-flight count of each node it routes to.
async fn in_flight(h: &Harness) -> Vec<(String, u32)> {
    let stats = h.queue.stats().await.unwrap();
    stats.nodes.into_iter().map(|(id, n, _)| (id, n)).collect()
}

#[tokio::test(start_paused = true)]
async fn a_node_back_from_a_disconnect_is_not_credited_with_its_old_cache() {
    let h = harness_routed(8, 4, RoutingStrategy::CacheAware).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let prompt = route(1000);

    // Both idle: the first node. n1 now holds the prompt.
    let mut a = start_routed(&h, "a", Some(prompt.clone())).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "a").await, 0);
    finish(&n1, "a", &mut a).await;
    // n1 is busier, and the prompt still goes there for its cache.
    let mut busy = start_routed(&h, "busy", None).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "busy").await, 0);
    let mut b = start_routed(&h, "b", Some(prompt.clone())).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "b").await, 0);
    finish(&n1, "busy", &mut busy).await;
    finish(&n1, "b", &mut b).await;

    // n1's connection ends; it dials in again (its engine may have restarted).
    n1.stop();
    for _ in 0..200 {
        if in_flight(&h).await.iter().all(|(id, _)| id != "n1") {
            break;
        }
        settle_a_moment().await;
    }
    let (n1, mut out1) = connect(&h, "n1").await;
    assert_eq!(
        in_flight(&h).await,
        [("n1".to_owned(), 0), ("n2".to_owned(), 0)]
    );
    // The same arrangement as before: n1 one request busier. Nothing says it still holds
    // the prompt, so the prompt goes by load, to n2.
    let mut busy = start_routed(&h, "busy-2", None).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "busy-2").await, 0);
    let mut c = start_routed(&h, "c", Some(prompt.clone())).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "c").await, 1);
    finish(&n1, "busy-2", &mut busy).await;
    finish(&n2, "c", &mut c).await;
}

#[tokio::test(start_paused = true)]
async fn a_node_replaced_by_a_new_connection_is_not_credited_with_its_old_cache() {
    let h = harness_routed(8, 4, RoutingStrategy::CacheAware).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let prompt = route(5000);
    let mut a = start_routed(&h, "a", Some(prompt.clone())).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "a").await, 0);
    finish(&n1, "a", &mut a).await;

    // A second connection of n1 arrives before the first one's end was noticed: the queue's
    // entry is replaced, not removed.
    let (n1b, mut out1b) = connect(&h, "n1").await;
    let mut busy = start_routed(&h, "busy", None).await;
    assert_eq!(assigned(&mut [&mut out1b, &mut out2], "busy").await, 0);
    let mut b = start_routed(&h, "b", Some(prompt.clone())).await;
    assert_eq!(
        assigned(&mut [&mut out1b, &mut out2], "b").await,
        1,
        "the replaced connection's cache was credited to the new one"
    );
    finish(&n1b, "busy", &mut busy).await;
    finish(&n2, "b", &mut b).await;
    drop(out1);
}

/// One slot a node, both busy: `head` (a prompt nobody holds) and then `second` (the prompt
/// n2 holds) wait; n2 frees its slot, then n1. Returns the nodes `head` and `second` went to.
async fn two_waiters(strategy: RoutingStrategy) -> (usize, usize) {
    let h = harness_routed(8, 1, strategy).await;
    let (n1, mut out1) = connect(&h, "n1").await;
    let (n2, mut out2) = connect(&h, "n2").await;
    let mut a = start_routed(&h, "a", Some(route(1000))).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "a").await, 0);
    let mut b = start_routed(&h, "b", Some(route(2000))).await;
    assert_eq!(assigned(&mut [&mut out1, &mut out2], "b").await, 1);
    let mut head = start_routed(&h, "head", Some(route(3000))).await;
    let mut second = start_routed(&h, "second", Some(route(2000))).await;
    settle_a_moment().await;
    finish(&n2, "b", &mut b).await;
    let first = if strategy == RoutingStrategy::CacheAware {
        "second"
    } else {
        "head"
    };
    let on_n2 = assigned(&mut [&mut out1, &mut out2], first).await;
    finish(&n1, "a", &mut a).await;
    let other = if first == "head" { "second" } else { "head" };
    let on_n1 = assigned(&mut [&mut out1, &mut out2], other).await;
    let nodes = [&n1, &n2];
    let (head_node, second_node) = if first == "head" {
        (on_n2, on_n1)
    } else {
        (on_n1, on_n2)
    };
    finish(nodes[head_node], "head", &mut head).await;
    finish(nodes[second_node], "second", &mut second).await;
    (head_node, second_node)
}

#[tokio::test(start_paused = true)]
async fn a_node_that_frees_its_slot_takes_the_waiting_prompt_it_holds() {
    // n2 takes the second waiter, whose prompt it holds, not the head; the head goes to n1.
    assert_eq!(two_waiters(RoutingStrategy::CacheAware).await, (0, 1));
}

#[tokio::test(start_paused = true)]
async fn least_loaded_serves_the_head_first() {
    assert_eq!(two_waiters(RoutingStrategy::LeastLoaded).await, (1, 0));
}
