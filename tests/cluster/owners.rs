//! One owner per model queue and per team budget: a lease with a fencing token, taken over
//! when the owner is cut off or stops, with nothing waiting lost and nothing run twice.

use std::time::{Duration, Instant};

use switchyard::store::LedgerStatus;

use super::proxy::Proxy;
use super::{Cluster, cluster};
use crate::common::{redis_url, wait_for};

/// The queue owner replica `i` knows of.
async fn owner_seen_by(c: &Cluster, i: usize) -> Option<String> {
    let replicas = c.fleet.replicas();
    let model = &c.config.server.resolve_model("small").unwrap().name;
    replicas[i].state().queues[model].stats().await?.owner
}

/// Generations waiting in replica `i`'s queue (the owner's own and the others').
async fn waiting_in(c: &Cluster, i: usize) -> usize {
    let replicas = c.fleet.replicas();
    let model = &c.config.server.resolve_model("small").unwrap().name;
    replicas[i].state().queues[model]
        .stats()
        .await
        .unwrap()
        .waiting
}

/// A node of the first model on replica `i`, routed to by every replica.
async fn node_on(c: &mut Cluster, i: usize) {
    let model = c.config.server.resolve_model("small").unwrap().name.clone();
    let node = c
        .fleet
        .add_node_to(&c.config, "small-1", &model, i)
        .await
        .unwrap();
    c.fleet.nodes.push(node);
    assert!(c.fleet.wait_registered(Duration::from_secs(10)).await);
    c.wait_routing(1).await;
}

/// Every request ran once: one settled row each, billed what the engine produced.
async fn settled_once(c: &Cluster, requests: usize) {
    let rows = settled_all(c, requests).await;
    let stats = c.fleet.nodes[0].sim.stats();
    let ran: u64 = stats.success.iter().sum();
    assert_eq!(ran, requests as u64, "the engine ran each request once");
    let settled: i64 = rows.iter().map(|r| r.completion_tokens).sum();
    assert_eq!(settled as u64, stats.generation_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_owner_cut_off_from_redis_loses_the_queue_and_nothing_runs_twice() {
    let proxy = Proxy::start(&redis_url()).await;
    let through_proxy = proxy.url.clone();
    // Replica 0 (which takes the queue's lease first) reaches Redis through the proxy; the
    // node that runs one request at a time is on replica 1.
    let mut c = cluster(2, 0, 1.0, |cfg| {
        cfg.server.owner_lease_secs = 1;
        for m in &mut cfg.server.models {
            m.node_concurrency = 1;
        }
        cfg.redis_urls.insert(0, through_proxy);
    })
    .await;
    let (p, q) = {
        let r = c.fleet.replicas();
        (
            r[0].state().replica_id.clone(),
            r[1].state().replica_id.clone(),
        )
    };
    assert_eq!(
        c.wait_queue_owner().await,
        p,
        "the first replica owns the queue"
    );
    node_on(&mut c, 1).await;

    // A long request holds the node; a second one, entering replica 1 too, waits in the
    // owner's queue on replica 0.
    let long = {
        let url = c.url(1, "/v1/chat/completions");
        let key = c.fleet.api_key.clone();
        tokio::spawn(async move { super::stream_body(&url, &key, 120).await })
    };
    let cr = &c;
    wait_for(
        Duration::from_secs(5),
        "the long request to run",
        || async move { cr.fleet.nodes[0].sim.stats().running == 1 },
    )
    .await;
    let waiting = {
        let url = c.url(1, "/v1/chat/completions");
        let key = c.fleet.api_key.clone();
        tokio::spawn(async move { super::stream_body(&url, &key, 5).await })
    };
    wait_for(
        Duration::from_secs(5),
        "the owner to hold it",
        || async move { waiting_in(cr, 0).await == 1 },
    )
    .await;

    // Cut off: the lease lapses and replica 1 takes the queue, with the request that waited.
    proxy.pause(true);
    let cut = Instant::now();
    wait_for(
        Duration::from_secs(10),
        "replica 1 to own the queue",
        || {
            let q = q.clone();
            async move { owner_seen_by(cr, 1).await == Some(q) }
        },
    )
    .await;
    let took = cut.elapsed();
    assert!(
        took <= Duration::from_secs(4),
        "took {took:?} (lease 1 s, renewal 0.33 s, Redis calls time out in 2 s)"
    );
    let long = long.await.unwrap();
    assert!(long.contains("[DONE]"), "{long}");
    let waited = waiting.await.unwrap();
    assert!(waited.contains("[DONE]"), "{waited}");

    // Back: the old owner follows the new one and has dropped what it held.
    proxy.pause(false);
    wait_for(Duration::from_secs(10), "replica 0 to follow", || {
        let q = q.clone();
        async move { owner_seen_by(cr, 0).await == Some(q) }
    })
    .await;
    assert_eq!(waiting_in(&c, 0).await, 0);
    let after = c.chat_through(0, 5).await;
    assert!(after.contains("[DONE]"));
    settled_once(&c, 3).await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_owner_that_stops_hands_its_waiting_requests_to_the_next_owner() {
    let mut c = cluster(3, 0, 1.0, |cfg| {
        for m in &mut cfg.server.models {
            m.node_concurrency = 1;
        }
    })
    .await;
    let owner = c.wait_queue_owner().await;
    let replicas: Vec<String> = c
        .fleet
        .replicas()
        .iter()
        .map(|r| r.state().replica_id.clone())
        .collect();
    let o = replicas.iter().position(|r| *r == owner).unwrap();
    let (a, b) = ((o + 1) % 3, (o + 2) % 3);
    node_on(&mut c, a).await;
    // One runs, four wait in the owner's queue, entering the two other replicas.
    let key = c.fleet.api_key.clone();
    let requests: Vec<_> = (0..5)
        .map(|i| {
            let url = c.url(if i % 2 == 0 { a } else { b }, "/v1/chat/completions");
            let key = key.clone();
            tokio::spawn(async move { super::stream_body(&url, &key, 40).await })
        })
        .collect();
    let cr = &c;
    wait_for(Duration::from_secs(5), "four to wait", || async move {
        waiting_in(cr, o).await == 4
    })
    .await;
    // The owner's replica shuts down (a deploy): its queue stops and gives the lease up,
    // and another replica owns the queue with the four that waited.
    let model = c.config.server.resolve_model("small").unwrap().name.clone();
    c.fleet.replicas()[o].state().queues[&model].stop();
    wait_for(Duration::from_secs(5), "a new owner", || {
        let old = owner.clone();
        async move {
            let seen = owner_seen_by(cr, a).await;
            seen.is_some() && seen != Some(old)
        }
    })
    .await;
    for r in requests {
        let body = r.await.unwrap();
        assert!(body.contains("[DONE]"), "{body}");
    }
    settled_once(&c, 5).await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_decides_a_teams_reservations_entering_every_replica() {
    let c = cluster(3, 3, 10.0, |_| {}).await;
    let team = c.fleet.team_id;
    let key = c.fleet.api_key.clone();
    let requests: Vec<_> = (0..30)
        .map(|i| {
            let (url, key) = (c.url(i % 3, "/v1/chat/completions"), key.clone());
            tokio::spawn(async move { super::stream_body(&url, &key, 8).await })
        })
        .collect();
    for r in requests {
        assert!(r.await.unwrap().contains("[DONE]"));
    }
    // The team's actor runs on one replica, which decided all thirty.
    let mut deciders = Vec::new();
    for (i, r) in c.fleet.replicas().iter().enumerate() {
        if let Some(stats) = r.state().budgets.stats(team).await {
            deciders.push((i, stats.decided));
        }
    }
    assert_eq!(deciders.len(), 1, "{deciders:?}");
    assert_eq!(deciders[0].1, 30, "{deciders:?}");
    settled_all(&c, 30).await;
    c.stop().await;
}

/// Every row settled, once: the rows.
async fn settled_all(c: &Cluster, requests: usize) -> Vec<switchyard::store::LedgerRow> {
    c.wait_reservations_closed().await;
    let rows = c.fleet.store.ledger_rows(None).await.unwrap();
    assert_eq!(rows.len(), requests, "one row per request");
    assert!(
        rows.iter().all(|r| r.status == LedgerStatus::Settled),
        "{rows:?}"
    );
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_teams_balance_holds_for_reservations_entering_every_replica() {
    let c = cluster(3, 3, 4.0, |_| {}).await;
    let (team, store) = (c.fleet.team_id, c.fleet.store.clone());
    // One request shows what a reservation of this size holds.
    assert!(c.chat_through(0, 200).await.contains("[DONE]"));
    let held = store.ledger_rows(Some(team)).await.unwrap()[0].estimated_cost_microcredits;
    let balance = store
        .team(team)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    // Room for five such reservations and a half.
    store
        .add_credits(team, 5 * held + held / 2 - balance, "test: room for five")
        .await
        .unwrap();
    // Twenty at once, entering all three replicas: five run, the rest are refused.
    let key = c.fleet.api_key.clone();
    let requests: Vec<_> = (0..20)
        .map(|i| {
            let (url, key) = (c.url(i % 3, "/v1/chat/completions"), key.clone());
            tokio::spawn(async move {
                let resp = crate::common::http()
                    .post(url)
                    .bearer_auth(key)
                    .json(&super::chat(200))
                    .send()
                    .await
                    .unwrap();
                (resp.status().as_u16(), resp.text().await.unwrap())
            })
        })
        .collect();
    let mut admitted = 0;
    for r in requests {
        let (status, body) = r.await.unwrap();
        match status {
            200 => {
                assert!(body.contains("[DONE]"), "{body}");
                admitted += 1;
            }
            402 => assert!(body.contains("insufficient_balance"), "{body}"),
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!(admitted, 5, "room for five reservations");
    let rows = settled_all(&c, 6).await;
    let settled: i64 = rows.iter().map(|r| r.cost_microcredits).sum();
    let left = store
        .team(team)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    assert!(left >= 0, "balance {left}");
    let probe = rows.iter().min_by_key(|r| r.id).unwrap().cost_microcredits;
    assert_eq!(left, 5 * held + held / 2 - (settled - probe));
    c.stop().await;
}

/// A team's budget owner that heard an ask and went without answering (it died: its lease
/// lapses): the asker takes the reservation to the lease's next holder instead of failing
/// it, and a row the owner opened before it went counts as the asker's, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_the_budget_owner_heard_but_never_answered_goes_to_its_successor() {
    use std::sync::Arc;
    use switchyard_actors::budget::{BudgetCluster, BudgetConfig, TeamBudgets};
    use switchyard_actors::cluster::{budget_lease, to_budget};
    use switchyard_actors::ports::{Clock, Ledger, Reservation, SystemClock, UsageBounds};

    let (db_url, db_name) = crate::common::fresh_pg().await;
    let prefix = format!("swcl:{:08x}:", rand::random::<u32>());
    let store = switchyard::store::connect_store(&db_url).await.unwrap();
    store.migrate().await.unwrap();
    let coordinator = switchyard::coord::connect_coordinator(Some(&redis_url()), &prefix)
        .await
        .unwrap();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let ledger: Arc<dyn Ledger> = store.clone();
    let lease_ttl = Duration::from_secs(1);
    let cluster = Arc::new(BudgetCluster::new(
        coordinator.clone(),
        "asker".into(),
        lease_ttl,
        clock.clone(),
    ));
    let budgets = TeamBudgets::start(ledger.clone(), clock, BudgetConfig::default())
        .await
        .unwrap()
        .in_cluster(cluster);
    // The mute owner hears asks on its channel and never answers.
    let mut heard = coordinator.subscribe(&to_budget("mute")).await.unwrap();

    for opened_before_it_went in [false, true] {
        let team = store
            .create_team(&format!("mute-{opened_before_it_went}"))
            .await
            .unwrap();
        store.add_credits(team.id, 1_000_000, "test").await.unwrap();
        let reservation = Reservation {
            request_id: format!("req_mute_{opened_before_it_went}"),
            team_id: team.id,
            key_id: None,
            model: "m".into(),
            estimated_prompt_tokens: 10,
            max_tokens: 100,
            estimated_cost: 110,
            price_input_per_mtok: 1_000_000,
            price_output_per_mtok: 2_000_000,
            bounds: UsageBounds::UNBOUNDED,
        };
        coordinator
            .acquire_lease(&budget_lease(team.id), "mute", lease_ttl)
            .await
            .unwrap()
            .expect("the mute owner takes the team's lease");
        if opened_before_it_went {
            ledger.reserve(&reservation).await.unwrap();
        }
        let started = Instant::now();
        budgets
            .reserve(&reservation)
            .await
            .expect("decided by the lease's next holder");
        // Within about a lease, not the answer timeout (20 s).
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert!(heard.try_recv().is_ok(), "the mute owner heard the ask");
        let rows: Vec<_> = store
            .ledger_rows(Some(team.id))
            .await
            .unwrap()
            .into_iter()
            .filter(|r| r.request_id == reservation.request_id)
            .collect();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].status, LedgerStatus::Reserved);
    }
    budgets.stop();
    crate::common::drop_pg(&db_name).await;
    crate::common::clean_redis(&prefix).await;
}
