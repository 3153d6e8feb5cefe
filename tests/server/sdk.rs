//! The real Python `openai` package against the demo fleet.

use std::time::Duration;

use switchyard::sim::FaultSpec;

use crate::common::{fleet, metric_sum, run_node, run_python, settled_row};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_streams_from_every_model_and_sees_typed_errors() {
    let fleet = fleet(&[("small", 2), ("medium", 1), ("large", 1)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let out = run_python("server_sdk.py", &[&base, &fleet.api_key, "normal"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["small"]["model"], "llama-3.1-8b-instruct");
    assert_eq!(seen["medium"]["model"], "qwen2.5-32b-instruct");
    assert_eq!(seen["large"]["model"], "llama-3.3-70b-instruct");
    assert_eq!(seen["bad_key"], "AuthenticationError");
    assert_eq!(seen["unknown_model"], "NotFoundError");

    for node in fleet
        .nodes
        .iter()
        .filter(|n| n.model == "llama-3.1-8b-instruct")
    {
        node.sim.set_faults(&FaultSpec {
            crash_after_tokens: Some(2),
            ..FaultSpec::default()
        });
    }
    let out = run_python("server_sdk.py", &[&base, &fleet.api_key, "crash"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["mid_stream"]["error"], "APIError");
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// The `small` engines of a fleet (the first one is where a test sends direct requests).
fn small_engines(fleet: &switchyard::demo::Fleet) -> Vec<&switchyard::demo::SimNode> {
    fleet
        .nodes
        .iter()
        .filter(|n| n.model == "llama-3.1-8b-instruct")
        .collect()
}

fn last_json_line(out: &str) -> serde_json::Value {
    let line = out.trim().lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON summary ({e}): {out}"))
}

/// Forced tool calls (named → `stop`, `"required"` → `tool_calls`; streamed, assembled from the
/// deltas, and non-streamed in `message.tool_calls`), logprobs, legacy completions, embeddings
/// (float and base64) and model lookups through the Python SDK. The script sends the same
/// seeded tool-call and logprobs requests straight to one of the fleet's engines, checks the
/// engine repeats itself under a seed, and that the gateway relayed exactly its name,
/// arguments, finish_reason, tokens, logprobs and usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_relays_tool_calls_logprobs_completions_embeddings_and_models() {
    let fleet = fleet(&[("small", 2)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let engine = format!("{}/v1", small_engines(&fleet)[0].sim.base_url());
    let out = run_python(
        "server_sdk_features.py",
        &[
            &base,
            &fleet.api_key,
            "features",
            &engine,
            "llama-3.1-8b-instruct",
        ],
    )
    .await;
    let seen = last_json_line(&out);
    let named = &seen["tools"]["named"];
    assert_eq!(named["name"], "get_weather");
    assert_eq!(named["finish_stream"], "stop", "{named}");
    assert_eq!(named["finish_plain"], "stop", "{named}");
    let required = &seen["tools"]["required"];
    assert_eq!(required["finish_stream"], "tool_calls", "{required}");
    assert_eq!(required["finish_plain"], "tool_calls", "{required}");
    for call in [named, required] {
        assert!(call["args"].is_object(), "{call}");
        assert!(call["usage"][1].as_u64().unwrap() > 0, "{call}");
    }
    assert_eq!(seen["logprobs"]["tokens"], 16);
    assert_eq!(seen["completions"]["usage"][1], 8);
    assert_eq!(seen["embeddings"]["count"], 3);
    assert!(seen["embeddings"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert_eq!(seen["models"]["small"], "small");
    assert_eq!(seen["models"]["nope"], "NotFoundError");
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// LangChain's `ChatOpenAI(...).bind_tools([...], tool_choice=...)` gets its call from the demo:
/// an AIMessage whose `tool_calls[0]` names the function with a dict of arguments that match
/// its schema (named and `"required"`, invoked and streamed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn langchain_sdk_chat_openai_bind_tools_gets_the_tool_call() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let seen = last_json_line(&run_python("server_langchain.py", &[&base, &fleet.api_key]).await);
    for label in ["named", "required", "streamed"] {
        assert_eq!(seen[label]["name"], "get_weather", "{seen}");
        assert!(seen[label]["args"].is_object(), "{seen}");
    }
    assert_eq!(seen["named"]["finish_reason"], "stop", "{seen}");
    assert_eq!(seen["required"]["finish_reason"], "tool_calls", "{seen}");
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// The Node `openai` package streams a forced tool call with `include_usage` from the demo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_node_sdk_streams_a_forced_tool_call_with_usage() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let seen = last_json_line(&run_node("stream_tool_call.mjs", &[&base, &fleet.api_key]).await);
    assert_eq!(seen["name"], "get_weather", "{seen}");
    assert!(
        seen["id"].as_str().unwrap().starts_with("chatcmpl-tool-"),
        "{seen}"
    );
    assert!(seen["args"].is_object(), "{seen}");
    assert_eq!(seen["finish_reason"], "stop", "{seen}");
    assert!(
        seen["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
        "{seen}"
    );
    assert!(
        seen["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "{seen}"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

/// Every relayed token is billed: after a tool-call stream and a logprobs stream through the
/// fleet, each ledger row holds the usage the client saw, and the rows add up to what the
/// engines themselves counted (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_tool_call_and_logprobs_streams_bill_exactly_the_engine_tokens() {
    let fleet = fleet(&[("small", 2)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let engines: Vec<String> = small_engines(&fleet)
        .iter()
        .map(|n| n.sim.base_url())
        .collect();
    let label = "model_name=\"llama-3.1-8b-instruct\"";
    let counters = || async {
        let (mut prompt, mut generation) = (0.0, 0.0);
        for e in &engines {
            prompt += metric_sum(e, "vllm:prompt_tokens_total", label).await;
            generation += metric_sum(e, "vllm:generation_tokens_total", label).await;
        }
        (prompt as i64, generation as i64)
    };
    let before = counters().await;
    let seen = last_json_line(
        &run_python(
            "server_sdk_features.py",
            &[&base, &fleet.api_key, "billing"],
        )
        .await,
    );
    let (mut prompt, mut completion) = (0, 0);
    for what in ["tool_call", "logprobs"] {
        let id = seen[what]["id"].as_str().unwrap();
        let row = settled_row(&fleet.store, id).await;
        let usage = &seen[what]["usage"];
        assert_eq!(
            [row.prompt_tokens, row.completion_tokens],
            [usage[0].as_i64().unwrap(), usage[1].as_i64().unwrap()],
            "{what}: the ledger row bills the usage the client saw"
        );
        assert!(
            row.completion_tokens > 0 && row.cost_microcredits > 0,
            "{what}: {row:?}"
        );
        prompt += row.prompt_tokens;
        completion += row.completion_tokens;
    }
    let rows = fleet.store.ledger_rows(Some(fleet.team_id)).await.unwrap();
    assert_eq!(rows.len(), 2, "one row per request: {rows:?}");
    // The engines count a request when it ends, which the client may see a moment earlier.
    let mut after = counters().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while (after.0 - before.0, after.1 - before.1) != (prompt, completion)
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = counters().await;
    }
    assert_eq!(
        (prompt, completion),
        (after.0 - before.0, after.1 - before.1),
        "billed tokens equal the engines' own counters"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}
