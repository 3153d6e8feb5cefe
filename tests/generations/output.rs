//! The engine's whole output through a scripted node speaking protocol 2: tool call fragments,
//! logprobs and cached tokens reach chat clients as the engine's bytes and assemble when not
//! streamed; the Generations API names them in typed events; legacy completions and
//! embeddings travel the same way; a delta no engine would send is refused and counted; and
//! every answer is billed as the node reported.

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::store::{LedgerStatus, hash_secret};

use crate::common::{http, sse_data};
use crate::harness::{
    Events, PgFleet, Ws, fake_node_serving, metric, pg_fleet, recv, send, send_raw,
};

const SMALL: &str = "llama-3.1-8b-instruct";
const CALL: &str = r#"{"tool_calls":[{"id":"chatcmpl-tool-9f","type":"function","index":0,"function":{"name":"get_weather","arguments":"{"}}]}"#;
/// Spacing and key order no serializer of ours would produce: relayed bytes are recognisable.
const ARGS: &str =
    r#"{"tool_calls":[{"index":0,"function":{"arguments":"\"city\":  \"Oslo\"}"}}]}"#;
const LOGPROBS: &str =
    r#"{"content":[{"token":"Oslo","logprob":-0.25,"bytes":[79,115,108,111],"top_logprobs":[]}]}"#;

async fn scribe(f: &PgFleet, id: &str, model: &str) -> Ws {
    f.store
        .create_node(id, "onprem", &hash_secret(&format!("nt-{id}")))
        .await
        .unwrap();
    fake_node_serving(f, id, &format!("nt-{id}"), model).await
}

fn chunk(id: &str, seq: u64, delta: &str, logprobs: Option<&str>) -> String {
    let logprobs = logprobs.map_or(String::new(), |l| format!(r#","logprobs":{l}"#));
    format!(
        r#"{{"type":"chunk","request_id":"{id}","attempt":1,"seq":{seq},"delta":{delta}{logprobs}}}"#
    )
}

/// Serves the next assignment: a tool call in two fragments (the second with logprobs), done
/// with `cached` prompt tokens; returns the assignment.
async fn call_tool(node: &mut Ws, cached: u64) -> Value {
    let assign = recv(node).await;
    assert_eq!(assign["type"], "assign");
    let id = assign["request_id"].as_str().unwrap().to_owned();
    send(
        node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    send_raw(node, &chunk(&id, 0, CALL, None)).await;
    send_raw(node, &chunk(&id, 1, ARGS, Some(LOGPROBS))).await;
    send(
        node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 12,
               "completion_tokens": 7, "finish_reason": "tool_calls", "cached_tokens": cached}),
    )
    .await;
    assert_eq!(recv(node).await["type"], "ack");
    assign
}

fn tool_request(stream: bool) -> Value {
    json!({"model": "small", "stream": stream, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 50,
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "required", "logprobs": true})
}

async fn post(
    f: &PgFleet,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut req = http().post(f.url(path)).bearer_auth(&f.api_key).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_and_logprobs_reach_chat_clients_as_the_engines_bytes() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scribe(&f, "scribe", SMALL).await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    // Streamed: the deltas and logprobs are the node's bytes, between the gateway's fields.
    let headers = [("x-request-id", "trace-me-1"), ("traceparent", traceparent)];
    let resp = post(&f, "/v1/chat/completions", &tool_request(true), &headers).await;
    let assign = call_tool(&mut node, 8).await;
    assert_eq!(
        assign.get("api"),
        None,
        "chat is written as version 1 wrote it"
    );
    let forwarded = assign["x_request_id"].as_str().unwrap();
    assert!(forwarded.starts_with("trace-me-1.chatcmpl-"), "{forwarded}");
    assert_eq!(assign["traceparent"], traceparent);
    assert_eq!(resp.status(), 200);
    let id = assign["request_id"].as_str().unwrap().to_owned();
    let body = resp.text().await.unwrap();
    assert!(
        body.contains(&format!(
            r#""delta":{CALL},"logprobs":null,"finish_reason":null"#
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            r#""delta":{ARGS},"logprobs":{LOGPROBS},"finish_reason":null"#
        )),
        "{body}"
    );
    let events = sse_data(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let finish = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(finish["finish_reason"], "tool_calls");
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(
        (
            &usage["prompt_tokens"],
            &usage["completion_tokens"],
            &usage["prompt_tokens_details"]["cached_tokens"]
        ),
        (&json!(12), &json!(7), &json!(8))
    );
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (LedgerStatus::Settled, 12, 7)
    );

    // Not streamed: one message with the call assembled; cached tokens never above the prompt.
    let request = tool_request(false);
    let resp = post(&f, "/v1/chat/completions", &request, &[]);
    let (resp, _) = tokio::join!(resp, call_tool(&mut node, 99));
    let doc: Value = resp.json().await.unwrap();
    let choice = &doc["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        choice["message"]["tool_calls"],
        json!([{"id": "chatcmpl-tool-9f", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":  \"Oslo\"}"}}])
    );
    assert_eq!(choice["logprobs"]["content"][0]["token"], "Oslo");
    assert_eq!(doc["usage"]["prompt_tokens_details"]["cached_tokens"], 12);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generations_api_names_reasoning_text_and_tool_calls_in_typed_events() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scribe(&f, "scribe", SMALL).await;
    let mut request = super::harness::body("Weather in Oslo?", 50, true);
    request["tools"] = tool_request(true)["tools"].clone();
    request["tool_choice"] = json!("required");
    let mut events = Events::new(f.submit("typed-1", &request).await);
    let assign = recv(&mut node).await;
    assert_eq!(
        assign["body"]["tool_choice"], "required",
        "tools reach the engine"
    );
    let id = assign["request_id"].as_str().unwrap().to_owned();
    send(
        &mut node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    send_raw(
        &mut node,
        &chunk(
            &id,
            0,
            r#"{"reasoning_content":"User wants weather."}"#,
            None,
        ),
    )
    .await;
    send_raw(
        &mut node,
        &chunk(&id, 1, r#"{"content":"Checking."}"#, None),
    )
    .await;
    send_raw(&mut node, &chunk(&id, 2, CALL, None)).await;
    send_raw(&mut node, &chunk(&id, 3, ARGS, None)).await;
    send(
        &mut node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 10,
               "completion_tokens": 9, "finish_reason": "tool_calls"}),
    )
    .await;
    let all = events.rest().await;
    assert_eq!(recv(&mut node).await["type"], "ack");
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "generation.created",
            "generation.reasoning.delta",
            "generation.text.delta",
            "generation.tool_call.delta",
            "generation.tool_call.delta",
            "generation.completed"
        ]
    );
    assert_eq!(all[1].1["delta"], "User wants weather.");
    assert_eq!(
        (
            &all[3].1["tool_call_index"],
            &all[3].1["id"],
            &all[3].1["name"],
            &all[3].1["arguments_delta"]
        ),
        (
            &json!(0),
            &json!("chatcmpl-tool-9f"),
            &json!("get_weather"),
            &json!("{")
        )
    );
    assert_eq!(all[4].1["arguments_delta"], "\"city\":  \"Oslo\"}");
    assert_eq!(all[4].1.get("name"), None);
    assert_eq!(all[5].1["finish_reason"], "tool_calls");
    assert_eq!(all[5].1["usage"]["output_tokens"], 9);

    // Not streamed: the output lists each kind in order.
    request["stream"] = json!(false);
    let submitted = f.submit("typed-2", &request);
    let serve = async {
        let assign = recv(&mut node).await;
        let id = assign["request_id"].as_str().unwrap().to_owned();
        send(
            &mut node,
            json!({"type": "accepted", "request_id": id, "attempt": 1}),
        )
        .await;
        send_raw(&mut node, &chunk(&id, 0, CALL, None)).await;
        send_raw(&mut node, &chunk(&id, 1, ARGS, None)).await;
        send(
            &mut node,
            json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 10,
                   "completion_tokens": 4, "finish_reason": "stop"}),
        )
        .await;
        assert_eq!(recv(&mut node).await["type"], "ack");
    };
    let (resp, ()) = tokio::join!(submitted, serve);
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(
        doc["output"],
        json!([{"type": "tool_call", "id": "chatcmpl-tool-9f", "name": "get_weather",
                "arguments": "{\"city\":  \"Oslo\"}"}]),
        "{doc}"
    );
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_completions_and_embeddings_run_on_the_engines_own_routes() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scribe(&f, "scribe", SMALL).await;
    let mut embedder = scribe(&f, "embedder", "bge-m3").await;
    let lp1 = r#"{"text_offset":[0],"token_logprobs":[-0.5],"tokens":[" upon"],"top_logprobs":[{" upon":-0.5}]}"#;
    let lp2 = r#"{"text_offset":[5],"token_logprobs":[-1.5],"tokens":[" a"],"top_logprobs":[{" a":-1.5}]}"#;
    for stream in [true, false] {
        let request = json!({"model": "small", "prompt": "Once", "max_tokens": 2,
            "logprobs": 1, "stream": stream, "stream_options": {"include_usage": true}});
        let sent = post(&f, "/v1/completions", &request, &[]);
        let serve = async {
            let assign = recv(&mut node).await;
            assert_eq!(assign["api"], "completions", "{assign}");
            assert_eq!(assign["body"]["prompt"], "Once");
            let id = assign["request_id"].as_str().unwrap().to_owned();
            assert!(id.starts_with("cmpl-"), "{id}");
            send(
                &mut node,
                json!({"type": "accepted", "request_id": id, "attempt": 1}),
            )
            .await;
            send_raw(&mut node, &chunk(&id, 0, r#"{"text":" upon"}"#, Some(lp1))).await;
            send_raw(&mut node, &chunk(&id, 1, r#"{"text":" a"}"#, Some(lp2))).await;
            send(
                &mut node,
                json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 2,
                       "completion_tokens": 2, "finish_reason": "length"}),
            )
            .await;
            assert_eq!(recv(&mut node).await["type"], "ack");
            id
        };
        let (resp, id) = tokio::join!(sent, serve);
        assert_eq!(resp.status(), 200);
        if stream {
            let body = resp.text().await.unwrap();
            assert!(
                body.contains(&format!(
                    r#""text":" upon","logprobs":{lp1},"finish_reason":null"#
                )),
                "{body}"
            );
            let events = sse_data(&body);
            let finish: Value = serde_json::from_str(&events[events.len() - 3]).unwrap();
            assert_eq!(finish["object"], "text_completion");
            assert_eq!(finish["choices"][0]["finish_reason"], "length");
            let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
            assert_eq!(usage["usage"]["total_tokens"], 4);
        } else {
            let doc: Value = resp.json().await.unwrap();
            assert_eq!(doc["choices"][0]["text"], " upon a");
            assert_eq!(
                doc["choices"][0]["logprobs"]["tokens"],
                json!([" upon", " a"])
            );
            assert_eq!(doc["choices"][0]["logprobs"]["text_offset"], json!([0, 5]));
        }
        let row = f.store.ledger_row(&id).await.unwrap().unwrap();
        assert_eq!((row.prompt_tokens, row.completion_tokens), (2, 2));
    }

    // Embeddings: the engine's array as it sent it, billed by input tokens only.
    let embed = json!({"model": "embed", "input": ["a b", "c"]});
    let data = r#"[{"index":0,"object":"embedding","embedding":[0.5,-0.25]},{"index":1,"object":"embedding","embedding":[1e-3,0.0]}]"#;
    let sent = post(&f, "/v1/embeddings", &embed, &[]);
    let serve = async {
        let assign = recv(&mut embedder).await;
        assert_eq!(assign["api"], "embeddings");
        assert_eq!(assign["model"], "bge-m3");
        let id = assign["request_id"].as_str().unwrap().to_owned();
        send(
            &mut embedder,
            json!({"type": "accepted", "request_id": id, "attempt": 1}),
        )
        .await;
        send_raw(
            &mut embedder,
            &chunk(&id, 0, &format!(r#"{{"data":{data}}}"#), None),
        )
        .await;
        send(
            &mut embedder,
            json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 3,
                   "completion_tokens": 0, "finish_reason": "stop"}),
        )
        .await;
        id
    };
    let (resp, id) = tokio::join!(sent, serve);
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert!(body.contains(&format!(r#""data":{data}"#)), "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["usage"], json!({"prompt_tokens": 3, "total_tokens": 3}));
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.prompt_tokens, row.completion_tokens),
        (LedgerStatus::Settled, 3, 0)
    );

    // Each route refuses the other kind of model.
    let resp = post(
        &f,
        "/v1/embeddings",
        &json!({"model": "small", "input": "x"}),
        &[],
    )
    .await;
    assert_eq!(resp.status(), 400);
    let resp = post(
        &f,
        "/v1/completions",
        &json!({"model": "embed", "prompt": "x"}),
        &[],
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["param"], "model");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_no_engine_would_send_is_refused_counted_and_never_relayed() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scribe(&f, "scribe", SMALL).await;
    let before = metric(
        &f,
        "switchyard_node_protocol_violations_total",
        "malformed_frame",
    )
    .await;
    let resp = post(&f, "/v1/chat/completions", &tool_request(true), &[]).await;
    let assign = recv(&mut node).await;
    let id = assign["request_id"].as_str().unwrap().to_owned();
    send(
        &mut node,
        json!({"type": "accepted", "request_id": id, "attempt": 1}),
    )
    .await;
    for (seq, bad) in [
        r#"{"content":5}"#,
        r#"{"tool_calls":[{"index":4000}]}"#,
        r#"{"tool_calls":{"index":0}}"#,
        r#"[1,2]"#,
    ]
    .iter()
    .enumerate()
    {
        send_raw(&mut node, &chunk(&id, seq as u64, bad, None)).await;
    }
    send_raw(
        &mut node,
        &chunk(&id, 4, r#"{"content":"fine"}"#, Some("[1]")),
    )
    .await;
    send_raw(&mut node, &chunk(&id, 5, r#"{"content":"ok"}"#, None)).await;
    send(
        &mut node,
        json!({"type": "done", "request_id": id, "attempt": 1, "prompt_tokens": 5,
               "completion_tokens": 1, "finish_reason": "stop"}),
    )
    .await;
    let body = resp.text().await.unwrap();
    let contents: Vec<String> = sse_data(&body)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(contents, ["ok"], "{body}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = metric(
        &f,
        "switchyard_node_protocol_violations_total",
        "malformed_frame",
    )
    .await;
    assert_eq!(after - before, 5.0);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_tool_call_is_replayed_and_shown_whole() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let mut node = scribe(&f, "scribe", SMALL).await;
    let request = tool_request(false);
    let first = post(
        &f,
        "/v1/chat/completions",
        &request,
        &[("idempotency-key", "calls-1")],
    );
    let (first, _) = tokio::join!(first, call_tool(&mut node, 0));
    let first: Value = first.json().await.unwrap();
    let id = first["id"].as_str().unwrap().to_owned();
    let expected = json!([{"id": "chatcmpl-tool-9f", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\":  \"Oslo\"}"}}]);
    assert_eq!(first["choices"][0]["message"]["tool_calls"], expected);

    // The same key again: the retained answer, tool call included, never a rerun.
    for stream in [false, true] {
        let mut again = request.clone();
        again["stream"] = json!(stream);
        let resp = post(
            &f,
            "/v1/chat/completions",
            &again,
            &[("idempotency-key", "calls-1")],
        )
        .await;
        assert_eq!(resp.status(), 200);
        if stream {
            let body = resp.text().await.unwrap();
            let calls: Vec<Value> = sse_data(&body)
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .filter_map(|c| c["choices"][0]["delta"].get("tool_calls").cloned())
                .collect();
            assert_eq!(calls.len(), 1, "{body}");
            assert_eq!(
                calls[0][0]["function"]["arguments"],
                "{\"city\":  \"Oslo\"}"
            );
            assert_eq!(calls[0][0]["id"], "chatcmpl-tool-9f");
        } else {
            let doc: Value = resp.json().await.unwrap();
            assert_eq!(doc["id"], id.as_str());
            assert_eq!(doc["choices"][0]["message"]["tool_calls"], expected);
            assert_eq!(doc["choices"][0]["finish_reason"], "tool_calls");
        }
    }
    let (status, doc) = f.get(&id).await;
    assert_eq!(status, 200);
    assert_eq!(
        doc["output"],
        json!([{"type": "tool_call", "id": "chatcmpl-tool-9f", "name": "get_weather",
                "arguments": "{\"city\":  \"Oslo\"}"}]),
        "{doc}"
    );
    assert_eq!(
        recv_within_quiet(&mut node).await,
        None,
        "the replays ran nothing"
    );
    f.stop().await;
}

async fn recv_within_quiet(node: &mut Ws) -> Option<Value> {
    crate::harness::recv_within(node, Duration::from_millis(300)).await
}
