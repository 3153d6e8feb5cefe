//! Helpers of the routing tests (`tests/server/routing.rs`, `tests/cluster/routing.rs`):
//! simulated engines that report their prefix-cache hits, long system prompts, conversations
//! sent one request at a time, the node each request went to (each node agent's assignment
//! counter), and a way to make one node the busiest.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::demo::{Fleet, FleetConfig};
use switchyard::sim::FaultSpec;
use switchyard_actors::model_queue::RoutingStrategy;

use super::{eventually, http};

pub const MODEL: &str = "llama-3.1-8b-instruct";
/// The simulator's (and the model's default) KV block size.
pub const BLOCK: u64 = 16;

/// Engines report `prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`); the
/// gateway routes by `routing`; a client that leaves is cancelled at its node quickly.
pub fn tweak(c: &mut FleetConfig, routing: RoutingStrategy) {
    c.sim.enable_prompt_tokens_details = true;
    c.server.routing = routing;
    c.server.timeouts.cancel_grace_ms = 100;
}

/// A system prompt of well over 600 tokens, different from its first word on for each
/// `tag` (so prompts of two tags share no KV block).
pub fn system_prompt(tag: &str) -> String {
    let rules: String = (0..60)
        .map(|i| {
            format!(
                "Rule {i}: track {} holds cars for yard {}. ",
                i * 7 % 13,
                i % 5
            )
        })
        .collect();
    format!("{tag} dispatcher. You route freight through the switchyard. {rules}")
}

/// A conversation's first messages: `tag`'s system prompt and `question`.
pub fn opening(tag: &str, question: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": system_prompt(tag)}),
        json!({"role": "user", "content": question}),
    ]
}

/// What one request came back with.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The node (index into the fleet's nodes) that served it.
    pub node: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub reply: String,
}

/// Each node's agent's assignment count, in the fleet's node order.
pub fn assignments(fleet: &Fleet) -> Vec<u64> {
    fleet
        .nodes
        .iter()
        .map(|n| n.agent_stats.assignments())
        .collect()
}

/// Sends a non-streamed chat of `messages` to `base` (`…/v1`), with `session` as
/// `x-session-id`, and reads the node that took it from the assignment counters (the caller
/// sends nothing else meanwhile).
pub async fn ask_at(
    fleet: &Fleet,
    base: &str,
    messages: &[Value],
    max_tokens: u32,
    session: Option<&str>,
) -> Answer {
    let before = assignments(fleet);
    let v = post(fleet, base, messages, max_tokens, session).await;
    let after = assignments(fleet);
    let moved: Vec<usize> = (0..after.len()).filter(|&i| after[i] > before[i]).collect();
    assert_eq!(moved.len(), 1, "one node took it: {before:?} → {after:?}");
    answer(moved[0], &v)
}

/// [`ask_at`] the fleet's first replica.
pub async fn ask(
    fleet: &Fleet,
    messages: &[Value],
    max_tokens: u32,
    session: Option<&str>,
) -> Answer {
    ask_at(
        fleet,
        &fleet.openai_base_url(),
        messages,
        max_tokens,
        session,
    )
    .await
}

/// The response to a non-streamed chat of `messages`, answered 200.
pub async fn post(
    fleet: &Fleet,
    base: &str,
    messages: &[Value],
    max_tokens: u32,
    session: Option<&str>,
) -> Value {
    let mut req = http()
        .post(format!("{base}/chat/completions"))
        .bearer_auth(&fleet.api_key)
        .json(&json!({"model": "small", "messages": messages, "max_tokens": max_tokens}));
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

/// The usage and reply of a chat response served by `node`.
pub fn answer(node: usize, v: &Value) -> Answer {
    let usage = &v["usage"];
    Answer {
        node,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        reply: v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned(),
    }
}

/// `messages` with the reply of `a` and the next user message appended: the next turn.
pub fn next_turn(messages: &mut Vec<Value>, a: &Answer, turn: usize) {
    messages.push(json!({"role": "assistant", "content": a.reply}));
    messages.push(json!({"role": "user", "content": format!("And train {turn}?")}));
}

/// A conversation of `turns` turns through `base`, one request at a time.
pub async fn conversation(fleet: &Fleet, base: &str, tag: &str, turns: usize) -> Vec<Answer> {
    let mut messages = opening(tag, "Which track for the first train?");
    let mut answers: Vec<Answer> = Vec::new();
    for turn in 1..=turns {
        let a = ask_at(fleet, base, &messages, 24, None).await;
        next_turn(&mut messages, &a, turn + 1);
        answers.push(a);
    }
    answers
}

/// Every turn after the first was served from the cache its previous turn left: all of that
/// prompt's tokens but two blocks' worth (the last, partial block is never cached, and
/// re-tokenized at the reply's seam the last full one may differ).
pub fn assert_each_turn_hit_its_previous_prompt(turns: &[Answer]) {
    assert!(turns[0].prompt_tokens > 600, "{turns:#?}");
    assert_eq!(turns[0].cached_tokens, 0, "{turns:#?}");
    for pair in turns.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        assert!(
            next.cached_tokens + 2 * BLOCK >= prev.prompt_tokens
                && next.cached_tokens < next.prompt_tokens,
            "a turn should find its previous prompt cached: {turns:#?}"
        );
    }
}

/// The in-flight count of each node (fleet order) in replica `replica`'s queue.
pub async fn in_flight(fleet: &Fleet, replica: usize) -> Vec<u32> {
    let stats = fleet.replicas()[replica].state().queues[MODEL]
        .stats()
        .await
        .unwrap();
    fleet
        .nodes
        .iter()
        .map(|n| {
            stats
                .nodes
                .iter()
                .find(|(id, _, _)| *id == n.node_id)
                .map_or(0, |(_, f, _)| *f)
        })
        .collect()
}

/// `count` on `node`, nothing on the others.
pub fn only_on(fleet: &Fleet, node: usize, count: u32) -> Vec<u32> {
    let mut v = vec![0; fleet.nodes.len()];
    v[node] = count;
    v
}

/// Makes node `node` the busiest: `count` streams whose prompts start with `system` (so
/// cache-aware routing sends them to the node that holds it) are sent through `base` and
/// held, each stalled at its node after one token, until the returned responses are dropped.
/// Returns once replica `counted_by` (the queue's owner) counts them, on that node only.
pub async fn load_node(
    fleet: &Fleet,
    base: &str,
    node: usize,
    system: &str,
    count: u32,
    counted_by: usize,
) -> Vec<reqwest::Response> {
    let sim = &fleet.nodes[node].sim;
    sim.set_faults(&FaultSpec {
        stall_after_tokens: Some(1),
        ..FaultSpec::default()
    });
    let mut held = Vec::new();
    for i in 0..count {
        let body = json!({
            "model": "small",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("Background shunting job {i}.")},
            ],
            "max_tokens": 500,
            "stream": true,
        });
        let mut resp = http()
            .post(format!("{base}/chat/completions"))
            .bearer_auth(&fleet.api_key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        // Its first event: it has been dispatched.
        let mut text = String::new();
        while !text.contains("\n\n") {
            let chunk = resp.chunk().await.unwrap().expect("a first event");
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        held.push(resp);
    }
    // Requests arriving from now on run normally (each takes the faults in force on arrival).
    let cleared = http()
        .delete(format!("{}/sim/faults", sim.base_url()))
        .send()
        .await
        .unwrap();
    assert!(cleared.status().is_success());
    let expected = only_on(fleet, node, count);
    let expected = &expected;
    let counted = eventually(Duration::from_secs(5), || async move {
        in_flight(fleet, counted_by).await == *expected
    })
    .await;
    assert!(
        counted.is_some(),
        "the held streams, sharing node {node}'s prefix, should all run there: in flight {:?}",
        in_flight(fleet, counted_by).await
    );
    held
}
