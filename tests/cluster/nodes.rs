//! Node ownership across replicas: who holds each node, commands through any replica, a
//! node leaving routing everywhere, and a node moving to another replica.

use std::time::Duration;

use futures::future::join_all;

use super::{chat, cluster};
use crate::common::{http, wait_for};

/// (in flight, draining) of `node` in replica `i`'s queue of `small`, if it routes to it.
async fn queue_view(c: &super::Cluster, i: usize, node: &str) -> Option<(u32, bool)> {
    let replicas = c.fleet.replicas();
    let model = &c.fleet.nodes[0].model;
    let stats = replicas[i].state().queues[model].stats().await.unwrap();
    stats
        .nodes
        .iter()
        .find(|(id, _, _)| id == node)
        .map(|(_, n, d)| (*n, *d))
}

/// Every replica's queue shows `small-1` idle and routable.
async fn assert_idle_everywhere(c: &super::Cluster) {
    for i in 0..3 {
        assert_eq!(
            queue_view(c, i, "small-1").await,
            Some((0, false)),
            "replica {i}"
        );
    }
}

/// Sends requests one at a time through replica `follower` until its queue has started
/// `at_least` generations on granted slots.
async fn work_on_grants(c: &super::Cluster, follower: usize, at_least: u64) {
    let model = &c.fleet.nodes[0].model;
    let queue = c.fleet.replicas()[follower].state().queues[model].clone();
    let mut tries = 0;
    while queue.stats().await.unwrap().on_grant < at_least {
        tries += 1;
        assert!(tries < 40, "the follower never started work on a grant");
        assert!(c.chat_through(follower, 4).await.contains("[DONE]"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_shows_each_nodes_owner_and_a_drain_reaches_it_from_anywhere() {
    let c = cluster(2, 2, 10.0, |_| {}).await;
    let owners = [
        c.fleet.replicas()[0].state().replica_id.clone(),
        c.fleet.replicas()[1].state().replica_id.clone(),
    ];
    // small-1 dialed replica 0, small-2 replica 1; both replicas say so.
    for i in 0..2 {
        let nodes = c.admin_nodes(i).await;
        for (n, owner) in [("small-1", &owners[0]), ("small-2", &owners[1])] {
            let node = nodes.iter().find(|v| v["node_id"] == n).unwrap();
            assert_eq!(node["owner_replica"], owner.as_str(), "replica {i}: {node}");
            assert_eq!(node["health"], "ready", "replica {i}: {node}");
        }
    }
    // Drained through replica 0, whose proxy forwards it to the socket on replica 1.
    let resp = http()
        .post(c.url(0, "/admin/nodes/small-2/drain"))
        .bearer_auth(&c.fleet.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202);
    // An idle drained agent finishes at once and disconnects: every queue stops routing to
    // it either way.
    let cr = &c;
    for i in 0..2 {
        wait_for(
            Duration::from_secs(5),
            "the drain to reach every queue",
            move || async move { queue_view(cr, i, "small-2").await.is_none_or(|(_, d)| d) },
        )
        .await;
    }

    // No new work goes to it, from either replica.
    let before: u64 = c.fleet.nodes[1].sim.stats().success.iter().sum();
    for i in 0..4 {
        let _ = c.chat_through(i, 8).await;
    }
    let after: u64 = c.fleet.nodes[1].sim.stats().success.iter().sum();
    assert_eq!(after, before, "a drained node took new work");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_leaves_routing_on_every_replica_at_once() {
    let mut c = cluster(3, 3, 10.0, |_| {}).await;
    c.fleet.nodes[1].stop_agent().await;
    // Its owner says so at once: well within one heartbeat period (500 ms here).
    let took = wait_for_routing(&c, 2, Duration::from_millis(500)).await;
    println!("left routing everywhere after {took:?}");
    // Requests through every replica still complete, on the other two nodes.
    let before: u64 = c.fleet.nodes[1].sim.stats().success.iter().sum();
    for i in 0..6 {
        assert!(c.chat_through(i, 8).await.contains("[DONE]"));
    }
    let after: u64 = c.fleet.nodes[1].sim.stats().success.iter().sum();
    assert_eq!(after, before, "work reached a node that left");
    c.stop().await;
}

/// Waits until every replica routes to `n` nodes; panics after `limit`.
async fn wait_for_routing(c: &super::Cluster, n: usize, limit: Duration) -> Duration {
    let start = tokio::time::Instant::now();
    loop {
        if (0..c.fleet.replicas().len()).all(|i| c.routable(i) == n) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "replicas route to {:?} nodes after {limit:?}, want {n}",
            (0..c.fleet.replicas().len())
                .map(|i| c.routable(i))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_reconnects_to_another_replica_moves_there_and_its_old_connection_ends() {
    let c = cluster(2, 1, 10.0, |_| {}).await;
    let replicas = c.fleet.replicas();
    let (a, b) = (replicas[0].state().clone(), replicas[1].state().clone());
    assert!(a.view.is_local("small-1"));
    assert!(b.view.proxies().get("small-1").is_some());
    // The same node connects again, to replica 1, while its first connection is still open
    // (a half-open socket the first replica has not noticed).
    let config = switchyard::demo::FleetConfig {
        time_scale: 10.0,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        ..Default::default()
    };
    let mut moved = c
        .fleet
        .add_node_to(&config, "small-1", &c.fleet.nodes[0].model, 1)
        .await
        .unwrap();
    wait_for(
        Duration::from_secs(5),
        "the node to move to replica 1",
        || {
            let (a, b) = (a.clone(), b.clone());
            async move {
                b.view.is_local("small-1")
                    && !a.view.is_local("small-1")
                    && a.view.proxies().get("small-1").is_some()
                    && b.view.proxies().get("small-1").is_none()
            }
        },
    )
    .await;
    let nodes = c.admin_nodes(0).await;
    let node = nodes.iter().find(|v| v["node_id"] == "small-1").unwrap();
    assert_eq!(node["owner_replica"], b.replica_id.as_str(), "{node}");
    // Work through either replica now runs on the new connection's engine.
    for i in 0..4 {
        assert!(c.chat_through(i, 8).await.contains("[DONE]"));
    }
    let served: u64 = moved.sim.stats().success.iter().sum();
    assert_eq!(served, 4);
    moved.stop_agent().await;
    moved.sim.shutdown().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_never_runs_more_than_its_capacity_for_work_entering_every_replica() {
    // Three replicas admit work for one node that runs two at once: one queue owner counts
    // the node's assignments wherever they were admitted.
    let c = cluster(3, 1, 1.0, |cfg| {
        for m in &mut cfg.server.models {
            m.node_concurrency = 2;
        }
    })
    .await;
    // One queue owner, which every replica knows.
    let owner = c.wait_queue_owner().await;
    assert!(
        c.fleet
            .replicas()
            .iter()
            .any(|r| r.state().replica_id == owner)
    );
    let peak = peak_of_streams(&c, 12, |i| i % 3, 30).await;
    assert!(peak >= 1, "the sampler saw the node work");
    assert!(peak <= 2, "the node ran {peak} at once; its capacity is 2");
    assert_idle_everywhere(&c).await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn followers_start_work_on_their_granted_share_and_the_node_still_never_exceeds_its_capacity()
{
    // A node that runs six at once: the queue's owner lends each of the two followers two of
    // its slots while nothing waits, so their requests start without asking it; when work
    // waits for room, the loans come back.
    let c = cluster(3, 1, 1.0, |cfg| {
        // Grants are lent under least_loaded and round_robin only.
        cfg.server.routing = switchyard_actors::model_queue::RoutingStrategy::LeastLoaded;
        for m in &mut cfg.server.models {
            m.node_concurrency = 6;
        }
    })
    .await;
    let owner = c.wait_queue_owner().await;
    let replicas = c.fleet.replicas();
    let model = c.fleet.nodes[0].model.clone();
    let follower = (0..3)
        .find(|i| replicas[*i].state().replica_id != owner)
        .unwrap();
    let on_grant = |i: usize| {
        let queue = replicas[i].state().queues[&model].clone();
        async move { queue.stats().await.unwrap().on_grant }
    };
    // One at a time through a follower: once the grant is there, none asks the owner.
    work_on_grants(&c, follower, 3).await;
    // Four times the node's capacity entering every replica at once.
    let peak = peak_of_streams(&c, 24, |i| i % 3, 20).await;
    assert!(
        peak >= 4,
        "the node ran {peak} at most; more entered at once"
    );
    assert!(peak <= 6, "the node ran {peak} at once; its capacity is 6");
    let started: u64 = join_all((0..3).map(on_grant)).await.into_iter().sum();
    assert!(started >= 3, "{started} started on grants");
    assert_idle_everywhere(&c).await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_whose_queue_restarts_gives_its_lent_slots_back_through_its_report() {
    // A follower's queue actor crashes while it holds a grant: its new incarnation holds
    // none, and its next report tells the owner so; the node's whole capacity is the
    // owner's again (without the report, two of its six slots stay lent forever).
    let c = cluster(3, 1, 1.0, |cfg| {
        cfg.server.owner_lease_secs = 1;
        cfg.server.routing = switchyard_actors::model_queue::RoutingStrategy::LeastLoaded;
        for m in &mut cfg.server.models {
            m.node_concurrency = 6;
        }
    })
    .await;
    let owner = c.wait_queue_owner().await;
    let replicas = c.fleet.replicas();
    let model = c.fleet.nodes[0].model.clone();
    let is_owner = |i: &usize| replicas[*i].state().replica_id == owner;
    let owner_at = (0..3).find(is_owner).unwrap();
    let follower = (0..3).find(|i| !is_owner(i)).unwrap();
    let queue = replicas[follower].state().queues[&model].clone();
    work_on_grants(&c, follower, 1).await;
    queue.crash();
    // Restarted (at once, by its supervisor), and reported to the owner (a renewal period
    // is a third of a second; a loaded machine takes longer).
    tokio::time::sleep(Duration::from_secs(4)).await;
    // A busy machine can keep the streams from overlapping fully: a few tries. Slots lent
    // forever cap every try at 4.
    let mut peak = 0;
    for _ in 0..3 {
        peak = peak_of_streams(&c, 24, |_| owner_at, 30).await;
        assert!(peak <= 6, "the node ran {peak} at once; its capacity is 6");
        if peak >= 5 {
            break;
        }
    }
    assert!(
        peak >= 5,
        "the owner used {peak} of the node's 6 slots: lent slots never came back"
    );
    c.stop().await;
}

/// Sends `n` streams at once, the `i`th through replica `entry(i)`, and waits for them all
/// to complete; how many node 0 ran at once at the most (sampled every millisecond).
async fn peak_of_streams(
    c: &super::Cluster,
    n: usize,
    entry: impl Fn(usize) -> usize,
    max_tokens: u32,
) -> u64 {
    let key = c.fleet.api_key.clone();
    let streams: Vec<_> = (0..n)
        .map(|i| {
            let (url, key) = (c.url(entry(i), "/v1/chat/completions"), key.clone());
            tokio::spawn(async move {
                let resp = http()
                    .post(url)
                    .bearer_auth(key)
                    .json(&chat(max_tokens))
                    .send()
                    .await
                    .unwrap();
                resp.text().await.unwrap()
            })
        })
        .collect();
    let mut peak = 0;
    while !streams.iter().all(|s| s.is_finished()) {
        let s = c.fleet.nodes[0].sim.stats();
        peak = peak.max(s.running + s.waiting_capacity + s.waiting_deferred);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for s in streams {
        assert!(s.await.unwrap().contains("[DONE]"));
    }
    peak
}
