#![allow(clippy::unwrap_used)]

use super::*;

fn view(id: &str, in_flight: u32, kv: f64) -> NodeView<'_> {
    NodeView {
        node_id: id,
        in_flight,
        capacity: 32,
        kv_cache_usage: kv,
        engine_waiting: 0,
    }
}

/// A prompt of `blocks` blocks of 16 tokens: a shared prefix `prefix` blocks long (the same
/// for every prompt with the same `group`), then blocks of its own.
fn prompt(group: u64, prefix: usize, own: u64, blocks: usize) -> RouteKey {
    let ids: Vec<u32> = (0..blocks * 16)
        .map(|t| {
            let block = t / 16;
            let who = if block < prefix { group } else { 1_000 + own };
            u32::try_from(who * 100_000 + t as u64).unwrap()
        })
        .collect();
    RouteKey {
        blocks: block_hashes(&ids, 16).into(),
        block_size: 16,
        prompt_tokens: u32::try_from(ids.len()).unwrap() + 5,
        session: None,
    }
}

fn cache_aware() -> Router {
    Router::new(RoutingStrategy::CacheAware, 10_000)
}

#[test]
fn least_loaded_prefers_fewer_in_flight_then_kv_headroom() {
    let mut r = Router::new(RoutingStrategy::LeastLoaded, 10);
    let nodes = [view("a", 10, 0.1), view("b", 2, 0.1), view("c", 2, 0.9)];
    assert_eq!(r.choose(None, &nodes), Some(1));
}

#[test]
fn round_robin_cycles() {
    let mut r = Router::new(RoutingStrategy::RoundRobin, 10);
    let nodes = [view("a", 10, 0.0), view("b", 0, 0.0)];
    let picks: Vec<_> = (0..4).map(|_| r.choose(None, &nodes)).collect();
    assert_eq!(picks, [Some(0), Some(1), Some(0), Some(1)]);
}

#[test]
fn strategies_parse_by_their_configuration_names() {
    for s in [
        RoutingStrategy::CacheAware,
        RoutingStrategy::LeastLoaded,
        RoutingStrategy::RoundRobin,
    ] {
        assert_eq!(RoutingStrategy::parse(s.as_str()), Some(s));
    }
    assert_eq!(RoutingStrategy::parse("random"), None);
    assert_eq!(RoutingStrategy::default(), RoutingStrategy::CacheAware);
}

#[test]
fn with_nothing_cached_cache_aware_is_least_loaded() {
    let mut r = cache_aware();
    let p = prompt(1, 10, 1, 20);
    let nodes = [view("a", 10, 0.1), view("b", 2, 0.1), view("c", 2, 0.9)];
    assert_eq!(r.choose(Some(&p), &nodes), Some(1));
    assert_eq!(r.choose(None, &nodes), Some(1));
}

#[test]
fn a_conversation_follows_its_cached_prefix_to_a_busier_node() {
    let mut r = cache_aware();
    let first = prompt(7, 300, 1, 310);
    r.placed("b", Some(&first));
    // The next turn: the whole earlier prompt, then more.
    let next = prompt(7, 300, 2, 330);
    assert_eq!(r.predicted("b", &next), 300 * 16);
    let nodes = [view("a", 0, 0.1), view("b", 20, 0.4), view("c", 3, 0.1)];
    assert_eq!(r.choose(Some(&next), &nodes), Some(1));
}

#[test]
fn a_short_cached_prompt_does_not_outweigh_load() {
    let mut r = cache_aware();
    // 4 blocks (64 tokens) cached on b, which is much busier.
    let p = prompt(3, 4, 1, 4);
    r.placed("b", Some(&p));
    let nodes = [view("a", 2, 0.1), view("b", 30, 0.3)];
    assert_eq!(r.choose(Some(&p), &nodes), Some(0));
}

#[test]
fn kv_pressure_counts_as_load_but_not_against_a_cached_prefix() {
    let mut r = cache_aware();
    let p = prompt(5, 100, 1, 110);
    r.placed("a", Some(&p));
    // a holds the prefix: under KV pressure it needs the fewest new blocks of any node.
    let nodes = [view("a", 4, 0.99), view("b", 4, 0.5)];
    assert_eq!(r.choose(Some(&p), &nodes), Some(0));
    // Nothing cached anywhere: the node with KV room wins.
    let other = prompt(6, 100, 2, 110);
    assert_eq!(r.choose(Some(&other), &nodes), Some(1));
}

#[test]
fn a_hot_prefix_spills_only_when_its_node_has_no_room_and_then_is_cached_twice() {
    let mut r = cache_aware();
    let system = |own| prompt(9, 200, own, 220);
    r.placed("a", Some(&system(0)));
    // a has room: it takes the hot prefix even though b idles.
    let nodes = [view("a", 25, 0.3), view("b", 0, 0.0)];
    assert_eq!(r.choose(Some(&system(1)), &nodes), Some(0));
    // a is full (not a candidate): b takes it, and from then on holds the prefix too.
    let only_b = [view("b", 0, 0.0)];
    assert_eq!(r.choose(Some(&system(2)), &only_b), Some(0));
    r.placed("b", Some(&system(2)));
    assert_eq!(r.predicted("b", &system(3)), 200 * 16);
    let nodes = [view("a", 31, 0.3), view("b", 1, 0.1)];
    assert_eq!(r.choose(Some(&system(3)), &nodes), Some(1));
}

#[test]
fn a_hot_full_node_stops_drawing_its_prefixes_to_it() {
    let mut r = cache_aware();
    let system = |own| prompt(4, 200, own, 220);
    r.placed("a", Some(&system(0)));
    // a holds the prefix and carries 30 against a mean of 13: with KV to spare it still
    // takes the group; with its cache full it is hot, and the group spills.
    let roomy = [view("a", 30, 0.6), view("b", 5, 0.5), view("c", 5, 0.5)];
    assert_eq!(r.choose(Some(&system(1)), &roomy), Some(0));
    let full = [view("a", 30, 0.95), view("b", 5, 0.5), view("c", 5, 0.5)];
    assert_ne!(r.choose(Some(&system(2)), &full), Some(0));
    // Full but not carrying more than twice its share: the cache still draws.
    let busy = [view("a", 20, 0.95), view("b", 10, 0.9), view("c", 10, 0.9)];
    assert_eq!(r.choose(Some(&system(3)), &busy), Some(0));
}

#[test]
fn different_prefixes_spread_instead_of_piling_on_one_node() {
    let mut r = cache_aware();
    let mut in_flight = [0u32; 4];
    let ids = ["a", "b", "c", "d"];
    for g in 0..8 {
        let p = prompt(g, 100, g, 110);
        let nodes: Vec<_> = ids
            .iter()
            .zip(in_flight)
            .map(|(id, f)| view(id, f, 0.0))
            .collect();
        let i = r.choose(Some(&p), &nodes).unwrap();
        r.placed(ids[i], Some(&p));
        in_flight[i] += 1;
    }
    assert_eq!(in_flight, [2, 2, 2, 2]);
}

#[test]
fn on_an_idle_fleet_new_conversations_take_turns() {
    let mut r = cache_aware();
    let nodes = [view("a", 0, 0.0), view("b", 0, 0.0), view("c", 0, 0.0)];
    let picks: Vec<_> = (0..3)
        .map(|g| {
            let p = prompt(g, 100, g, 110);
            let i = r.choose(Some(&p), &nodes).unwrap();
            r.placed(nodes[i].node_id, Some(&p));
            i
        })
        .collect();
    assert_eq!(picks, [0, 1, 2]);
    // And each comes back to its own.
    for g in 0..3 {
        let next = prompt(g, 110, 50 + g, 130);
        assert_eq!(r.choose(Some(&next), &nodes), Some(g as usize));
    }
}

#[test]
fn a_node_that_leaves_takes_its_cache_with_it() {
    let mut r = cache_aware();
    let p = prompt(4, 100, 1, 110);
    r.placed("a", Some(&p));
    assert!(r.predicted("a", &p) > 0);
    r.forget("a");
    assert_eq!(r.predicted("a", &p), 0);
    // Back as a new connection: a busier a no longer wins on a cache it may have lost.
    let nodes = [view("a", 10, 0.1), view("b", 2, 0.1)];
    assert_eq!(r.choose(Some(&p), &nodes), Some(1));
}

#[test]
fn a_session_sticks_to_its_last_node_when_the_prompt_does_not_say_so() {
    let mut r = cache_aware();
    let mut first = prompt(11, 0, 1, 100);
    first.session = Some(42);
    r.placed("b", Some(&first));
    // The next turn shares no block (the client rewrote its history), but names the session.
    let mut next = prompt(12, 0, 2, 100);
    next.session = Some(42);
    let nodes = [view("a", 2, 0.1), view("b", 6, 0.1)];
    assert_eq!(r.choose(Some(&next), &nodes), Some(1));
    next.session = Some(43);
    assert_eq!(r.choose(Some(&next), &nodes), Some(0));
}

#[test]
fn a_session_does_not_outlive_its_node() {
    let mut r = cache_aware();
    let mut first = prompt(11, 0, 1, 100);
    first.session = Some(42);
    r.placed("b", Some(&first));
    r.forget("b");
    let mut next = prompt(12, 0, 2, 100);
    next.session = Some(42);
    let nodes = [view("a", 2, 0.1), view("b", 6, 0.1)];
    assert_eq!(r.choose(Some(&next), &nodes), Some(0));
}

#[test]
fn the_oracle_uses_the_cached_tokens_it_is_given() {
    let mut r = cache_aware();
    let p = prompt(1, 100, 1, 110);
    r.placed("a", Some(&p));
    let nodes = [view("a", 2, 0.1), view("b", 2, 0.1)];
    // The index says a; the engines say b holds it and a evicted it.
    assert_eq!(r.choose_on(Some(&p), &nodes, &[0, 1600]), Some(1));
}

#[test]
fn an_index_is_as_large_as_the_node_cache() {
    let mut r = Router::new(RoutingStrategy::CacheAware, 50);
    let p = prompt(1, 0, 1, 120);
    r.placed("a", Some(&p));
    // Only the 50 most recent blocks stay, and the prefix is the most recent: kept.
    assert_eq!(r.predicted("a", &p), 50 * 16);
}

#[test]
fn a_node_that_frees_a_slot_takes_the_waiter_it_holds_the_most_of() {
    let mut r = cache_aware();
    let held = prompt(21, 100, 1, 110);
    r.placed("a", Some(&held));
    let head = prompt(22, 100, 2, 110);
    let other = prompt(23, 100, 3, 110);
    let same_group = prompt(21, 100, 4, 110);
    let waiting = [Some(&head), Some(&other), Some(&same_group)];
    assert_eq!(r.pick("a", 0, waiting.into_iter()), 2);
    // Nothing held of any: the head.
    assert_eq!(r.pick("b", 0, waiting.into_iter()), 0);
    // A waiter without a prompt, or one that may not run there (None), is never preferred.
    assert_eq!(r.pick("a", 0, [Some(&head), None].into_iter()), 0);
}

#[test]
fn a_waiter_is_passed_over_a_bounded_number_of_times() {
    let mut r = cache_aware();
    let held = prompt(31, 100, 1, 110);
    r.placed("a", Some(&held));
    let head = prompt(32, 100, 2, 110);
    let better = prompt(31, 100, 3, 110);
    let waiting = [Some(&head), Some(&better)];
    assert_eq!(r.pick("a", MAX_PASSED - 1, waiting.into_iter()), 1);
    assert_eq!(r.pick("a", MAX_PASSED, waiting.into_iter()), 0);
    // Beyond the look-ahead nothing is seen.
    let mut far: Vec<Option<&RouteKey>> = vec![Some(&head); LOOK_AHEAD];
    far.push(Some(&better));
    assert_eq!(r.pick("a", 0, far.into_iter()), 0);
}

#[test]
fn only_cache_aware_reorders_the_queue() {
    let mut r = Router::new(RoutingStrategy::LeastLoaded, 10_000);
    let held = prompt(41, 100, 1, 110);
    r.placed("a", Some(&held));
    let head = prompt(42, 100, 2, 110);
    assert_eq!(r.pick("a", 0, [Some(&head), Some(&held)].into_iter()), 0);
}
