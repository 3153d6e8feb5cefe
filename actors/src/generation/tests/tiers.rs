//! Service tiers through a real queue: who goes next when the node is full, and a request
//! refused at once when the work before it would start it past its tier's budget.

use super::*;
use crate::tier::{Policy, Tier};

/// A harness of one node with `slots`, its queue under `policy`.
async fn tiered(slots: u32, policy: Policy) -> Harness {
    harness_with(QueueConfig {
        max_waiting: 64,
        max_waiting_tokens: u64::MAX,
        policy,
        node_capacity: slots,
        routing: RoutingStrategy::LeastLoaded,
        cache_blocks: 1024,
    })
    .await
}

/// Starts `request_id` of `team` at `tier`, asking for `max_tokens` of output.
async fn start_as(
    h: &Harness,
    request_id: &str,
    tier: Tier,
    team: i64,
    max_tokens: u64,
) -> Result<GenerationStream, crate::error::Failure> {
    let (args, rx) = generation_args(
        h,
        request_id,
        h.ledger.clone(),
        None,
        crate::ports::UsageBounds::UNBOUNDED,
    );
    let mut args = GenerationArgs { tier, ..args };
    args.reservation.team_id = team;
    args.reservation.max_tokens = max_tokens;
    h.gens.start_generation(args, rx).await
}

/// Ends `id`'s attempt 1 on the node: its slot frees and the queue dispatches again.
async fn finish(node: &NodeHandle, id: &str) {
    node.deliver(done(id, 1, 10, 1, "stop"));
    settle_a_moment().await;
}

/// The next request assigned to the node (acks of finished ones skipped).
async fn next_assign(out: &mut mpsc::Receiver<ServerFrame>) -> String {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), out.recv())
            .await
            .unwrap()
            .unwrap()
        {
            ServerFrame::Assign { request_id, .. } => return request_id,
            ServerFrame::Ack { .. } => {}
            other => panic!("expected assign, got {other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_flex_work_waits_behind_a_default_request_that_came_after_it() {
    let h = tiered(1, Policy::default()).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut streams = vec![start_as(&h, "flex-0", Tier::Flex, 2, 100).await.unwrap()];
    assert_eq!(next_assign(&mut out).await, "flex-0");
    for i in 1..=10 {
        streams.push(
            start_as(&h, &format!("flex-{i}"), Tier::Flex, 2, 100)
                .await
                .unwrap(),
        );
    }
    streams.push(
        start_as(&h, "default", Tier::Default, 1, 100)
            .await
            .unwrap(),
    );
    finish(&node, "flex-0").await;
    assert_eq!(next_assign(&mut out).await, "default");
}

#[tokio::test(start_paused = true)]
async fn two_teams_of_one_tier_alternate_whatever_each_sent() {
    let h = tiered(1, Policy::default()).await;
    let (node, mut out) = connect(&h, "n1").await;
    let mut streams = vec![start_as(&h, "a-0", Tier::Default, 1, 100).await.unwrap()];
    assert_eq!(next_assign(&mut out).await, "a-0");
    for i in 1..=8 {
        streams.push(
            start_as(&h, &format!("a-{i}"), Tier::Default, 1, 100)
                .await
                .unwrap(),
        );
    }
    for i in 0..2 {
        streams.push(
            start_as(&h, &format!("b-{i}"), Tier::Default, 2, 100)
                .await
                .unwrap(),
        );
    }
    let mut order = Vec::new();
    let mut running = "a-0".to_owned();
    for _ in 0..4 {
        finish(&node, &running).await;
        running = next_assign(&mut out).await;
        order.push(running.clone());
    }
    // Team 2 came last with two; it still gets every other start.
    let team_b = order.iter().filter(|id| id.starts_with("b-")).count();
    assert_eq!(team_b, 2, "{order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_request_that_would_start_past_its_budget_is_refused_at_once() {
    let mut policy = Policy::default();
    policy.tiers[Tier::Default.index()].budget = Duration::from_millis(3_500);
    let h = tiered(1, policy).await;
    let (node, mut out) = connect(&h, "n1").await;
    // A backlog drained at one request (110 tokens of work) every 500 ms for 3 s: the
    // queue measures 220 tokens a second.
    let mut streams = vec![start_as(&h, "w-0", Tier::Default, 1, 100).await.unwrap()];
    let mut running = next_assign(&mut out).await;
    for i in 1..=20 {
        streams.push(
            start_as(&h, &format!("w-{i}"), Tier::Default, 1, 100)
                .await
                .unwrap(),
        );
    }
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        finish(&node, &running).await;
        running = next_assign(&mut out).await;
    }
    // Fourteen wait (1,540 tokens, 7 s of work): a newcomer of the same team would start
    // past its 3.5 s budget. It is told now, with when to come back.
    let started = tokio::time::Instant::now();
    let refused = start_as(&h, "late", Tier::Default, 1, 100)
        .await
        .unwrap_err();
    assert_eq!(refused.code, ErrorCode::CapacityExhausted, "{refused:?}");
    assert!(started.elapsed() < Duration::from_millis(100));
    assert!(
        refused.retry_after_secs.is_some_and(|s| s >= 3),
        "{refused:?}"
    );
    assert_eq!(h.ledger.row("late").unwrap().status, RowStatus::Cancelled);
    // Another team's newcomer has nothing of its own before it: it waits its turn.
    assert!(start_as(&h, "other", Tier::Default, 2, 100).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn each_tier_waits_no_longer_than_its_budget() {
    let mut policy = Policy::default();
    policy.tiers[Tier::Priority.index()].budget = Duration::from_secs(5);
    let h = tiered(1, policy).await;
    let (_node, mut out) = connect(&h, "n1").await;
    let _running = start_as(&h, "busy", Tier::Default, 1, 100).await.unwrap();
    next_assign(&mut out).await;
    let mut priority = start_as(&h, "p", Tier::Priority, 1, 100).await.unwrap();
    let mut default = start_as(&h, "d", Tier::Default, 1, 100).await.unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let Some(GenEvent::Failed(f)) = priority.next().await else {
        panic!("capacity_exhausted expected")
    };
    assert_eq!(f.code, ErrorCode::CapacityExhausted);
    // The default tier's budget (30 s) has not run out.
    assert!(
        tokio::time::timeout(Duration::from_millis(10), default.next())
            .await
            .is_err()
    );
}
