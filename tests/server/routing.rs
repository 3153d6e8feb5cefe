//! Cache-aware routing end to end (issue 16, item 2): the gateway hashes each chat prompt's
//! KV blocks, the queue sends a prompt to the node it sent that prefix to before, and the
//! simulated engines — whose prefix caches name blocks by the same hash chain and report
//! hits in `usage.prompt_tokens_details.cached_tokens` — show the prefill saved. Which node
//! took a request is read from each node agent's assignment counter (requests go one at a
//! time where that matters); the queue's in-flight counts show the load each choice was
//! made against.

use std::time::Duration;

use serde_json::Value;
use switchyard::demo::Fleet;
use switchyard_actors::model_queue::RoutingStrategy;

use crate::common::fleet;
use crate::common::routing::{
    Answer, BLOCK, MODEL, answer, ask, assert_each_turn_hit_its_previous_prompt, assignments,
    conversation, in_flight, load_node, next_turn, only_on, opening, post, system_prompt, tweak,
};

/// `nodes` simulated 8B nodes reporting cached prompt tokens, routed by `routing`.
async fn routed_fleet(nodes: u32, routing: RoutingStrategy) -> Fleet {
    fleet(&[("small", nodes)], 20.0, |c| tweak(c, routing)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_stays_on_the_node_holding_its_prefix_though_that_node_is_the_busiest() {
    let fleet = routed_fleet(3, RoutingStrategy::CacheAware).await;
    let base = fleet.openai_base_url();
    let mut messages = opening("Northern", "Which track for the first train?");
    let first = ask(&fleet, &messages, 24, None).await;
    // Four held streams make its node the busiest by far: by load alone, either other node
    // would take every later turn.
    let held = load_node(&fleet, &base, first.node, &system_prompt("Northern"), 4, 0).await;
    let mut turns = vec![first.clone()];
    for turn in 2..=4 {
        next_turn(&mut messages, turns.last().unwrap(), turn);
        turns.push(ask(&fleet, &messages, 24, None).await);
    }
    assert!(
        turns.iter().all(|t| t.node == first.node),
        "every turn on the node holding the conversation: {turns:#?}"
    );
    assert_each_turn_hit_its_previous_prompt(&turns);
    assert_eq!(
        in_flight(&fleet, 0).await,
        only_on(&fleet, first.node, 4),
        "the held streams ran throughout"
    );
    drop(held);
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_conversations_spread_over_the_nodes_and_each_keeps_its_own() {
    let fleet = routed_fleet(2, RoutingStrategy::CacheAware).await;
    let base = fleet.openai_base_url();
    // Four conversations at once, each with its own system prompt. Their first turns are
    // long (200 tokens), so all four run when the last is placed: nothing is cached
    // anywhere yet, so they go by load, two to each node. Later turns follow their own
    // conversation's cache.
    let tags = ["Alpha", "Bravo", "Charlie", "Delta"];
    let runs =
        futures::future::join_all(tags.iter().map(|tag| three_turns(&fleet, &base, tag))).await;
    for turns in &runs {
        assert_eq!(turns[0].cached_tokens, 0, "{turns:#?}");
        for pair in turns.windows(2) {
            assert!(
                pair[1].cached_tokens + 2 * BLOCK >= pair[0].prompt_tokens,
                "each turn finds its own conversation cached: {turns:#?}"
            );
        }
    }
    // Three turns of two conversations on each node.
    assert_eq!(assignments(&fleet), [6, 6]);
    for node in &fleet.nodes {
        let stats = node.sim.stats();
        assert!(
            stats.prompt_tokens_cached > 0,
            "{}: {} prompt tokens, none cached",
            node.node_id,
            stats.prompt_tokens
        );
    }
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// A conversation of three turns among others running at once (so the node of each turn is
/// not read: `node` is 0).
async fn three_turns(fleet: &Fleet, base: &str, tag: &str) -> Vec<Answer> {
    let mut messages = opening(tag, "Which track for the first train?");
    let mut answers = Vec::new();
    for turn in 1..=3 {
        let max_tokens = if turn == 1 { 200 } else { 24 };
        let a = answer(0, &post(fleet, base, &messages, max_tokens, None).await);
        next_turn(&mut messages, &a, turn + 1);
        answers.push(a);
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_loses_most_of_the_cache_a_conversation_builds() {
    let run = |routing| async move {
        let fleet = routed_fleet(3, routing).await;
        let turns = conversation(&fleet, &fleet.openai_base_url(), "Eastern", 4).await;
        fleet.shutdown(Duration::from_secs(1)).await;
        turns
    };
    let (cache_aware, round_robin) = tokio::join!(
        run(RoutingStrategy::CacheAware),
        run(RoutingStrategy::RoundRobin)
    );
    assert!(cache_aware.iter().all(|t| t.node == cache_aware[0].node));
    assert_each_turn_hit_its_previous_prompt(&cache_aware);
    // Each node in turn: only the fourth turn finds a prompt of this conversation (the
    // first turn's) on its node.
    let nodes: Vec<usize> = round_robin.iter().map(|t| t.node).collect();
    assert_eq!(nodes, [0, 1, 2, 0], "{round_robin:#?}");
    let cached = |turns: &[Answer]| turns.iter().map(|t| t.cached_tokens).sum::<u64>();
    let (ca, rr) = (cached(&cache_aware), cached(&round_robin));
    let per_turn = |turns: &[Answer]| {
        turns
            .iter()
            .map(|t| (t.prompt_tokens, t.cached_tokens))
            .collect::<Vec<_>>()
    };
    println!(
        "(prompt, cached) tokens per turn: cache_aware {:?}, round_robin {:?}",
        per_turn(&cache_aware),
        per_turn(&round_robin)
    );
    assert!(
        rr * 2 < ca,
        "round robin should cache far less: {rr} against {ca}\n{round_robin:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_goes_back_to_its_node_though_its_next_prompt_shares_no_block() {
    let fleet = routed_fleet(2, RoutingStrategy::CacheAware).await;
    let base = fleet.openai_base_url();
    let first_prompt = opening("Western", "Which track for the first train?");
    let first = ask(&fleet, &first_prompt, 8, Some("trip-17")).await;
    let held = load_node(&fleet, &base, first.node, &system_prompt("Western"), 4, 0).await;

    // The client rewrote its history: no block of the next prompt is cached anywhere.
    let rewritten = opening("Southern", "Summarise the yard rules.");
    let (a, b) = (blocks(&first_prompt).await, blocks(&rewritten).await);
    assert!(
        a.len() > 30 && b.len() > 30,
        "{} and {} blocks",
        a.len(),
        b.len()
    );
    assert!(
        a.iter().all(|x| !b.contains(x)),
        "the prompts share a block"
    );

    // Named by its session, it goes back to its node, the busy one, all the same.
    let next = ask(&fleet, &rewritten, 8, Some("trip-17")).await;
    assert_eq!(next.node, first.node, "the session's node");
    assert_eq!(next.cached_tokens, 0, "nothing of it was cached there");
    // Alike prompts of another session, or of none, go by load: to the other node.
    let other = opening("Central", "Summarise the yard rules.");
    assert_ne!(
        ask(&fleet, &other, 8, Some("trip-18")).await.node,
        first.node
    );
    let unnamed = opening("Coastal", "Summarise the yard rules.");
    assert_ne!(ask(&fleet, &unnamed, 8, None).await.node, first.node);
    assert_eq!(in_flight(&fleet, 0).await, only_on(&fleet, first.node, 4));
    drop(held);
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// The KV block hashes the gateway computes for a chat prompt of `messages`.
async fn blocks(messages: &[Value]) -> Vec<u64> {
    let counter = switchyard::tokens::PromptCounter::load([(MODEL, None, None)]).unwrap();
    let body = serde_json::json!({ "messages": messages });
    counter
        .count_chat(MODEL, body.as_object().unwrap(), 8192, BLOCK as u32)
        .await
        .unwrap()
        .unwrap()
        .blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_also_routes_a_prompt_the_gateway_does_not_hash() {
    // A completions prompt is counted but not hashed into KV blocks: its session alone
    // names a node.
    let fleet = routed_fleet(2, RoutingStrategy::CacheAware).await;
    let base = fleet.openai_base_url();
    let first = ask(
        &fleet,
        &opening("Western", "Which track?"),
        8,
        Some("trip-17"),
    )
    .await;
    let held = load_node(&fleet, &base, first.node, &system_prompt("Western"), 4, 0).await;
    assert_eq!(
        complete(&fleet, &base, "Ledger", "trip-17").await,
        first.node
    );
    assert_ne!(
        complete(&fleet, &base, "Tariff", "trip-18").await,
        first.node
    );
    drop(held);
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// The node that served a completion of `tag`'s system prompt text with `session`.
async fn complete(fleet: &Fleet, base: &str, tag: &str, session: &str) -> usize {
    let before = assignments(fleet);
    let resp = crate::common::http()
        .post(format!("{base}/completions"))
        .bearer_auth(&fleet.api_key)
        .header("x-session-id", session)
        .json(&serde_json::json!({"model": "small", "prompt": system_prompt(tag), "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 600, "{v}");
    let after = assignments(fleet);
    let moved: Vec<usize> = (0..after.len()).filter(|&i| after[i] > before[i]).collect();
    assert_eq!(moved.len(), 1, "{before:?} → {after:?}");
    moved[0]
}
