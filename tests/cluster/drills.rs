//! A replica killed under load: a `switchyard serve` process holding every node's socket and
//! every queue is killed with SIGKILL while the other replicas' clients stream.

use std::time::{Duration, Instant};

use switchyard::demo::{Fleet, FleetConfig};
use switchyard::store::LedgerStatus;

use super::{Cluster, chat, free_port, has_error_event, serve_process, wait_serving};
use crate::common::{fresh_pg, http, redis_url, wait_for};

/// How one stream ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// `[DONE]` with no error event.
    Completed,
    /// An error event after its output began (its node's replica died under it).
    Cut,
    /// Refused before any output (503 or 429).
    Refused(u16),
    /// The connection broke (its replica died).
    Lost,
}

/// A stream of 60 tokens of `model` (an alias).
async fn stream(url: String, key: String, model: &str) -> Ended {
    let mut body = chat(60);
    body["model"] = model.into();
    let Ok(resp) = http().post(url).bearer_auth(key).json(&body).send().await else {
        return Ended::Lost;
    };
    let status = resp.status().as_u16();
    let Ok(body) = resp.text().await else {
        return Ended::Lost;
    };
    match status {
        200 if has_error_event(&body) => Ended::Cut,
        200 => {
            assert!(body.contains("[DONE]"), "{body}");
            Ended::Completed
        }
        503 | 429 => Ended::Refused(status),
        other => panic!("{other}: {body}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_under_load_loses_no_request_and_no_money() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swcl:{:08x}:", rand::random::<u32>());
    let admin = format!("adm-{:08x}", rand::random::<u32>());
    let port = free_port();
    // The doomed replica starts first: it takes every queue's lease.
    let mut doomed = serve_process(&db_url, &prefix, port, &admin, "doomed", &[]);
    let doomed_url = format!("http://127.0.0.1:{port}");
    wait_serving(&doomed_url).await;
    let mut config = FleetConfig {
        nodes: vec![],
        time_scale: 5.0,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        replicas: 2,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    config.server.owner_lease_secs = 1;
    config.server.admin_token = Some(admin.clone());
    config.server.nodes.heartbeat_timeout_secs = 3;
    // The survivors sweep every second what outlived 10 + 2 + 1 s.
    let timeouts = &mut config.server.timeouts;
    (timeouts.total_secs, timeouts.settle_wait_secs) = (10, 2);
    (timeouts.sweep_interval_secs, timeouts.sweep_grace_secs) = (1, 1);
    let mut fleet = Fleet::start(config.clone(), &db_url).await.unwrap();
    // Three nodes dial the doomed replica first, the others after it.
    let model = config.server.resolve_model("small").unwrap().name.clone();
    let mut servers = vec![doomed_url.clone()];
    servers.extend(fleet.replicas().iter().map(|r| r.base_url()));
    for i in 1..=3 {
        let node = fleet
            .add_node_at(&config, &format!("small-{i}"), &model, &servers)
            .await
            .unwrap();
        fleet.nodes.push(node);
    }
    // A node of `medium` knows only the doomed replica: it dies with it (its `done`s never
    // come back), with the streams of the doomed replica's own clients on it.
    let medium = config.server.resolve_model("medium").unwrap().name.clone();
    let node = fleet
        .add_node_at(
            &config,
            "medium-1",
            &medium,
            std::slice::from_ref(&doomed_url),
        )
        .await
        .unwrap();
    fleet.nodes.push(node);
    let c = Cluster {
        fleet,
        config,
        db_name,
        prefix,
    };
    c.wait_routing(4).await;
    let owner = c.wait_queue_owner().await;
    assert_eq!(owner, "doomed", "the first replica owns the queue");

    // Forty streams of `small` through the two survivors and eight of `medium` through the
    // doomed one, which dies under them.
    let key = c.fleet.api_key.clone();
    let spawn = |i: usize, url: String, model: &'static str| {
        let key = key.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10 * i as u64)).await;
            tokio::time::timeout(Duration::from_secs(60), stream(url, key, model)).await
        })
    };
    let doomed_streams: Vec<_> = (0..8)
        .map(|i| spawn(i, format!("{doomed_url}/v1/chat/completions"), "medium"))
        .collect();
    // Its clients came first: it decides the team's reservations, the survivors ask it.
    let coordinator = c.fleet.server.state().coordinator.clone();
    let lease = switchyard_actors::cluster::budget_lease(c.fleet.team_id);
    wait_for(Duration::from_secs(10), "the doomed replica to own the team's budget", || {
        let (coordinator, lease) = (coordinator.clone(), lease.clone());
        async move { coordinator.lease_holder(&lease).await.unwrap().as_deref() == Some("doomed") }
    })
    .await;
    let streams: Vec<_> = (0..40)
        .map(|i| spawn(i, c.url(i % 2, "/v1/chat/completions"), "small"))
        .collect();
    tokio::time::sleep(Duration::from_millis(250)).await;
    doomed.kill();
    let killed = Instant::now();

    // Its queues move to a survivor within the lease, its nodes reconnect to the survivors.
    let cr = &c;
    let small = model.clone();
    wait_for(
        Duration::from_secs(10),
        "a survivor to own the queue",
        || {
            let small = small.clone();
            async move {
                let mut owners = Vec::new();
                for r in cr.fleet.replicas() {
                    owners.push(r.state().queues[&small].stats().await.and_then(|s| s.owner));
                }
                owners[0].is_some()
                    && owners[0] == owners[1]
                    && owners[0].as_deref() != Some("doomed")
            }
        },
    )
    .await;
    let took = killed.elapsed();
    assert!(
        took <= Duration::from_secs(5),
        "queue ownership moved after {took:?}"
    );
    wait_for(
        Duration::from_secs(20),
        "the nodes back on the survivors",
        || async move {
            let nodes = cr.admin_nodes(0).await;
            nodes.len() == 4
                && nodes.iter().all(|n| {
                    if n["node_id"] == "medium-1" {
                        n["health"] == "offline"
                    } else {
                        n["health"] == "ready" && n["owner_replica"] != "doomed"
                    }
                })
        },
    )
    .await;

    // Every stream ended: completed, retried elsewhere and completed, or cut with an error
    // event after its output began; none hung.
    let mut ended = Vec::new();
    for s in streams {
        ended.push(
            s.await
                .unwrap()
                .expect("a stream hung after the replica died"),
        );
    }
    let completed = ended.iter().filter(|e| **e == Ended::Completed).count();
    assert!(completed >= 20, "{ended:?}");
    // None lost, none refused: the asks the doomed replica heard and never answered went to
    // the budget's next owner.
    assert!(
        ended
            .iter()
            .all(|e| matches!(e, Ended::Completed | Ended::Cut)),
        "{ended:?}"
    );
    // The doomed replica's own clients lost their connections (or finished first).
    for s in doomed_streams {
        let ended = s
            .await
            .unwrap()
            .expect("a stream hung after its replica died");
        assert!(matches!(ended, Ended::Lost | Ended::Completed), "{ended:?}");
    }
    // The survivors serve on.
    assert!(c.chat_through(0, 5).await.contains("[DONE]"));
    assert!(c.chat_through(1, 5).await.contains("[DONE]"));

    // The doomed replica's reservations on the node that died with it stay open until a
    // survivor's sweeper cancels them; the others were settled from the nodes' resent `done`s.
    let store = c.fleet.store.clone();
    let open = store.open_reservations().await.unwrap();
    assert!(open > 0, "nothing was left for the sweeper");
    // No money lost or made: every row settled or cancelled, none open, and the balance is
    // the credits minus what was settled.
    c.wait_reservations_closed().await;
    let cut = ended.iter().filter(|e| **e == Ended::Cut).count();
    eprintln!(
        "drill: queue moved {took:?} after the kill; {completed} completed, {cut} cut; {open} \
         reservations open before the sweep, none {:?} after the kill",
        killed.elapsed()
    );
    let rows = store.ledger_rows(Some(c.fleet.team_id)).await.unwrap();
    assert!(
        rows.iter()
            .all(|r| matches!(r.status, LedgerStatus::Settled | LedgerStatus::Cancelled))
    );
    let settled: i64 = rows.iter().map(|r| r.cost_microcredits).sum();
    let balance = store
        .team(c.fleet.team_id)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    assert_eq!(balance, c.config.credits - settled);
    c.stop().await;
}

/// Requests the engine of node `i` has taken so far (finished, running or waiting).
fn taken(c: &Cluster, i: usize) -> u64 {
    let s = c.fleet.nodes[i].sim.stats();
    s.success.iter().sum::<u64>() + s.running + s.waiting_capacity + s.waiting_deferred
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_whose_socket_is_cut_leaves_routing_and_gets_nothing_while_gone() {
    let mut c = super::cluster(2, 0, 2.0, |cfg| {
        cfg.server.nodes.heartbeat_timeout_secs = 2;
        // The same short prompt on both nodes: by load, not by its cached first block.
        cfg.server.routing = switchyard_actors::model_queue::RoutingStrategy::LeastLoaded;
    })
    .await;
    // small-1 reaches replica 1 only through a TCP proxy; small-2 dials replica 0.
    let r1 = c.fleet.replicas()[1].addr();
    let proxy = super::proxy::Proxy::start(&format!("redis://{r1}")).await;
    let through = proxy.url.replacen("redis://", "http://", 1);
    let model = c.config.server.resolve_model("small").unwrap().name.clone();
    let cut_node = c
        .fleet
        .add_node_at(&c.config, "small-1", &model, &[through])
        .await
        .unwrap();
    c.fleet.nodes.push(cut_node);
    let other = c
        .fleet
        .add_node_to(&c.config, "small-2", &model, 0)
        .await
        .unwrap();
    c.fleet.nodes.push(other);
    c.wait_routing(2).await;

    // Streams through both replicas, on both nodes; then small-1's socket goes silent (its
    // bytes stop both ways, the sockets stay open) and no new connection gets through.
    let key = c.fleet.api_key.clone();
    let first: Vec<_> = (0..8)
        .map(|i| {
            let (url, key) = (c.url(i % 2, "/v1/chat/completions"), key.clone());
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(60), stream(url, key, "small")).await
            })
        })
        .collect();
    let cr = &c;
    wait_for(
        Duration::from_secs(5),
        "both nodes to work",
        || async move { taken(cr, 0) > 0 && taken(cr, 1) > 0 },
    )
    .await;
    proxy.pause(true);
    proxy.strand();
    let cut = Instant::now();
    wait_for(
        Duration::from_secs(10),
        "small-1 to leave routing",
        || async move { cr.routable(0) == 1 && cr.routable(1) == 1 },
    )
    .await;
    let left = cut.elapsed();
    assert!(
        left <= Duration::from_secs(4),
        "left routing after {left:?} (heartbeat timeout 2 s)"
    );

    // While it is gone, nothing is sent to it.
    let before = taken(&c, 0);
    for i in 0..6 {
        assert!(c.chat_through(i % 2, 5).await.contains("[DONE]"));
    }
    assert_eq!(
        taken(&c, 0),
        before,
        "work was sent to a node out of routing"
    );
    // Every stream of the cut ended: completed (on small-2, or retried there having streamed
    // nothing) or with an error event; none hung.
    for s in first {
        let ended = s
            .await
            .unwrap()
            .expect("a stream hung after its node was cut");
        assert!(matches!(ended, Ended::Completed | Ended::Cut), "{ended:?}");
    }
    c.wait_reservations_closed().await;
    let store = c.fleet.store.clone();
    let rows = store.ledger_rows(None).await.unwrap();
    assert_eq!(rows.len(), 8 + 6, "one row per request");
    assert!(
        rows.iter()
            .all(|r| matches!(r.status, LedgerStatus::Settled | LedgerStatus::Cancelled))
    );
    proxy.pause(false);
    c.stop().await;
}
