#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::model_queue::actor::Waiter;
use crate::protocol::Api;
use crate::tier::{Policy, Tier};

fn waiter(id: &str, tier: Tier, team: i64, cost: u64, arrived: Instant) -> Waiting {
    Waiting {
        request_id: id.to_owned(),
        waiter: Waiter::Remote("r".into()),
        arrived,
        deadline: arrived + Duration::from_secs(30),
        avoid: None,
        api: Api::Chat,
        route: None,
        passed: 0,
        ticket: Ticket { tier, team, cost },
    }
}

/// Dispatches `n` heads, each replaced by `refill` (the closed loop of a client that sends
/// its next request as one starts), and counts them by (tier, team).
fn serve(
    line: &mut Line,
    n: usize,
    mut refill: impl FnMut(&Waiting) -> Option<Waiting>,
) -> BTreeMap<(Tier, i64), usize> {
    let mut served = BTreeMap::new();
    for _ in 0..n {
        let lane = line.head().expect("work waiting");
        let w = line.take(lane, 0, true).unwrap();
        *served.entry((w.ticket.tier, w.ticket.team)).or_default() += 1;
        if let Some(next) = refill(&w) {
            line.push(next, false);
        }
    }
    served
}

/// A closed-loop client per (tier, team, cost): `clients` of each keep one request waiting.
fn closed_loop(line: &mut Line, t0: Instant, lanes: &[(Tier, i64, u64, usize)]) {
    let mut k = 0;
    for &(tier, team, cost, clients) in lanes {
        for _ in 0..clients {
            k += 1;
            line.push(waiter(&format!("w{k}"), tier, team, cost, t0), false);
        }
    }
}

fn again(w: &Waiting) -> Option<Waiting> {
    Some(waiter(
        &format!("{}+", w.request_id),
        w.ticket.tier,
        w.ticket.team,
        w.ticket.cost,
        w.arrived + Duration::from_millis(1),
    ))
}

#[test]
fn two_teams_of_one_tier_share_it_equally_whatever_they_send() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(
        &mut line,
        t0,
        &[(Tier::Default, 1, 400, 200), (Tier::Default, 2, 400, 20)],
    );
    let served = serve(&mut line, 1_000, again);
    assert_eq!(served[&(Tier::Default, 1)], 500);
    assert_eq!(served[&(Tier::Default, 2)], 500);
}

#[test]
fn work_is_counted_in_tokens_not_requests() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(
        &mut line,
        t0,
        &[(Tier::Default, 1, 4_000, 10), (Tier::Default, 2, 400, 10)],
    );
    let served = serve(&mut line, 1_100, again);
    // Ten of the small for each large one: equal tokens.
    assert_eq!(served[&(Tier::Default, 1)], 100);
    assert_eq!(served[&(Tier::Default, 2)], 1_000);
}

#[test]
fn tiers_share_by_weight_and_flex_keeps_its_minimum_share() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(
        &mut line,
        t0,
        &[
            (Tier::Priority, 1, 400, 50),
            (Tier::Default, 2, 400, 50),
            (Tier::Flex, 3, 400, 50),
        ],
    );
    let served = serve(&mut line, 1_000, again);
    let (p, d, f) = (
        served[&(Tier::Priority, 1)],
        served[&(Tier::Default, 2)],
        served[&(Tier::Flex, 3)],
    );
    // Weights 8:4:1 would give flex 77 of 1,000; its minimum share is 100.
    assert!((100..=102).contains(&f), "flex got {f}");
    assert!(p.abs_diff(2 * d) <= 4, "priority {p}, default {d}");

    // Without flex waiting, the weights alone: 2:1.
    let mut line = Line::new(Policy::default());
    closed_loop(
        &mut line,
        t0,
        &[(Tier::Priority, 1, 400, 5), (Tier::Default, 2, 400, 5)],
    );
    let served = serve(&mut line, 900, again);
    assert_eq!(served[&(Tier::Priority, 1)], 600);
    assert_eq!(served[&(Tier::Default, 2)], 300);
}

#[test]
fn a_lane_that_was_idle_starts_level_not_ahead() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(&mut line, t0, &[(Tier::Default, 1, 100, 10)]);
    // Team 1 alone for a long while, then team 2 arrives with ten waiting.
    serve(&mut line, 1_000, again);
    closed_loop(&mut line, t0, &[(Tier::Default, 2, 100, 10)]);
    let served = serve(&mut line, 100, again);
    let newcomer = served[&(Tier::Default, 2)];
    assert!((49..=51).contains(&newcomer), "{newcomer}");
}

#[test]
fn a_team_that_empties_its_lane_after_each_start_gains_nothing_by_it() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(&mut line, t0, &[(Tier::Default, 1, 100, 10)]);
    line.push(waiter("solo", Tier::Default, 2, 100, t0), false);
    // Team 2 has one request at a time: its next arrives only after it started.
    let mut solo = 0;
    let mut pending = None;
    for _ in 0..100 {
        if let Some(w) = pending.take() {
            line.push(w, false);
        }
        let lane = line.head().unwrap();
        let w = line.take(lane, 0, true).unwrap();
        if w.ticket.team == 2 {
            solo += 1;
            pending = again(&w);
        } else {
            line.push(again(&w).unwrap(), false);
        }
    }
    assert!((49..=51).contains(&solo), "{solo}");
}

#[test]
fn retries_go_first_and_a_lane_keeps_arrival_order() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut line = Line::new(Policy::default());
    line.push(waiter("late", Tier::Default, 1, 10, at(30)), false);
    line.push(waiter("early", Tier::Default, 1, 10, at(10)), false);
    line.push(waiter("retry", Tier::Flex, 2, 10, at(50)), true);
    let order: Vec<String> = std::iter::from_fn(|| {
        let lane = line.head()?;
        line.take(lane, 0, true).map(|w| w.request_id)
    })
    .collect();
    assert_eq!(order, ["retry", "early", "late"]);
    assert!(line.is_empty());
    assert_eq!(line.tokens(), 0);
}

#[test]
fn off_it_is_one_line_in_arrival_order() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut line = Line::new(Policy::fifo(Duration::from_secs(30)));
    line.push(waiter("a", Tier::Flex, 1, 9_000, at(1)), false);
    line.push(waiter("b", Tier::Priority, 2, 10, at(2)), false);
    line.push(waiter("c", Tier::Flex, 1, 9_000, at(3)), false);
    let order: Vec<String> = std::iter::from_fn(|| {
        let lane = line.head()?;
        line.take(lane, 0, true).map(|w| w.request_id)
    })
    .collect();
    assert_eq!(order, ["a", "b", "c"]);
}

#[test]
fn a_waiter_set_aside_goes_back_where_it_was_uncharged() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let mut line = Line::new(Policy::default());
    line.push(waiter("a", Tier::Default, 1, 10, at(1)), false);
    line.push(waiter("b", Tier::Default, 1, 10, at(2)), false);
    line.push(waiter("c", Tier::Default, 2, 10, at(3)), false);
    let lane = line.head().unwrap();
    let a = line.take(lane, 0, false).unwrap();
    assert_eq!(a.request_id, "a");
    // Set aside, team 1 is not charged: its next still goes before team 2's.
    let lane2 = line.head().unwrap();
    assert_eq!(line.lane(lane2).next().unwrap().request_id, "b");
    line.put_back(lane, a);
    let ids: Vec<&str> = line.lane(lane).map(|w| w.request_id.as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!((line.len(), line.tokens()), (3, 30));
}

#[test]
fn removing_waiters_keeps_the_counts() {
    let t0 = Instant::now();
    let mut line = Line::new(Policy::default());
    closed_loop(
        &mut line,
        t0,
        &[(Tier::Default, 1, 10, 3), (Tier::Flex, 2, 20, 3)],
    );
    line.push(waiter("r", Tier::Flex, 2, 5, t0), true);
    let gone = line.remove_if(|w| w.ticket.team == 2);
    assert_eq!(gone.len(), 4);
    assert_eq!((line.len(), line.tokens()), (3, 30));
    assert_eq!(line.by_tier(), [0, 3, 0]);
    assert!(!line.contains("r"));
    assert_eq!(line.drain().len(), 3);
    assert!(line.head().is_none());
}

#[test]
fn a_waiter_sent_again_goes_behind_those_that_came_before_it() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let line = [at(10), at(20), at(30)];
    // A newcomer at the back, one that came first at the head, one between in between.
    assert_eq!(place_at(line.into_iter(), at(40)), 3);
    assert_eq!(place_at(line.into_iter(), at(5)), 0);
    assert_eq!(place_at(line.into_iter(), at(25)), 2);
    // Ties keep the order they were sent in.
    assert_eq!(place_at(line.into_iter(), at(20)), 2);
    assert_eq!(place_at(std::iter::empty(), at(20)), 0);
}
