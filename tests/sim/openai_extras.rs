//! What real clients send beyond plain chat: forced tool calls, logprobs, legacy completions,
//! cached-token usage, embeddings and `X-Request-Id`, each against its real vLLM capture
//! (tests/fixtures/vllm/README.md).

use serde_json::{Value, json};
use switchyard::sim::{SimConfig, SimServer};

use crate::common::{fixture, fixture_json, http, metric, shape, sse_data};

async fn sim(details: bool) -> SimServer {
    SimServer::start(SimConfig {
        model: "tiny".into(),
        time_scale: 50.0,
        max_model_len: Some(1024),
        embedding_model: Some("tiny-embed".into()),
        enable_prompt_tokens_details: details,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn events(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, String) {
    let resp = http()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.text().await.unwrap())
}

/// Replays a captured request; the body must be 200.
/// Completion `top_logprobs` dicts are keyed by token text: keep only their value types.
fn canonical(mut v: Value) -> Value {
    if let Some(choices) = v.get_mut("choices").and_then(Value::as_array_mut) {
        for c in choices {
            if let Some(tops) = c
                .pointer_mut("/logprobs/top_logprobs")
                .and_then(Value::as_array_mut)
            {
                tops.iter_mut().for_each(|t| *t = json!({"token": 0.0}));
            }
        }
    }
    shape(&v)
}

async fn replay(base: &str, path: &str, request: &str) -> String {
    let (status, _, body) = post(base, path, &fixture_json(request)).await;
    assert_eq!(status, 200, "{request}: {body}");
    body
}

/// A small JSON Schema check for what tool definitions use.
fn valid(v: &Value, schema: &Value) -> bool {
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        return e.contains(v);
    }
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(obj) = v.as_object() else {
                return false;
            };
            let required = schema.get("required").and_then(Value::as_array);
            let props = schema.get("properties").and_then(Value::as_object);
            required.is_none_or(|r| r.iter().all(|k| obj.contains_key(k.as_str().unwrap())))
                && obj
                    .iter()
                    .all(|(k, x)| props.and_then(|p| p.get(k)).is_some_and(|s| valid(x, s)))
        }
        Some("array") => v.as_array().is_some_and(|a| {
            a.iter()
                .all(|x| valid(x, schema.get("items").unwrap_or(&json!({}))))
                && num("minItems").is_none_or(|m| a.len() as f64 >= m)
                && num("maxItems").is_none_or(|m| a.len() as f64 <= m)
        }),
        Some("string") => v.as_str().is_some_and(|s| {
            num("maxLength").is_none_or(|m| s.chars().count() as f64 <= m)
                && num("minLength").is_none_or(|m| s.chars().count() as f64 >= m)
        }),
        Some(t @ ("integer" | "number")) => v.as_f64().is_some_and(|x| {
            (t == "number" || v.is_i64() || v.is_u64())
                && num("minimum").is_none_or(|m| x >= m)
                && num("maximum").is_none_or(|m| x <= m)
        }),
        Some("boolean") => v.is_boolean(),
        _ => true,
    }
}

/// Every streamed chunk against the capture's chunk in the same role, then the arguments.
#[tokio::test]
async fn named_tool_call_streams_like_vllm_and_finishes_with_stop() {
    let sim = sim(false).await;
    let ours = events(
        &replay(
            &sim.base_url(),
            "/v1/chat/completions",
            "tools_named_stream.request.json",
        )
        .await,
    );
    let cap = events(&fixture("tools_named_stream.sse"));
    let n = ours.len();
    assert_eq!(shape(&ours[0]), shape(&cap[0]), "role chunk");
    assert_eq!(
        shape(&ours[1]),
        shape(&cap[1]),
        "first tool chunk: id, type, name"
    );
    assert_eq!(shape(&ours[2]), shape(&cap[2]), "argument fragment");
    assert_eq!(
        shape(&ours[n - 2]),
        shape(&cap[cap.len() - 2]),
        "finish chunk"
    );
    assert_eq!(
        shape(&ours[n - 1]),
        shape(&cap[cap.len() - 1]),
        "usage chunk"
    );
    let call = &ours[1]["choices"][0]["delta"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(ours[n - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        ours[n - 2]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
        ""
    );
    let args: String = ours[1..n - 1]
        .iter()
        .map(|e| {
            e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap()
        })
        .collect();
    let schema =
        &fixture_json("tools_named_stream.request.json")["tools"][0]["function"]["parameters"];
    assert!(
        valid(&serde_json::from_str(&args).unwrap(), schema),
        "{args}"
    );
    // Argument tokens plus the end-of-sequence token are the completion tokens.
    let usage = &ours[n - 1]["usage"];
    assert_eq!(
        usage["prompt_tokens"],
        cap[cap.len() - 1]["usage"]["prompt_tokens"]
    );
    assert_eq!(usage["completion_tokens"].as_u64().unwrap(), (n - 2) as u64);
    sim.shutdown().await;
}

#[tokio::test]
async fn required_tool_call_streams_parameters_only_and_finishes_with_tool_calls() {
    let sim = sim(false).await;
    let base = sim.base_url();
    let ours = events(
        &replay(
            &base,
            "/v1/chat/completions",
            "tools_required_stream.request.json",
        )
        .await,
    );
    let cap = events(&fixture("tools_required_stream.sse"));
    let n = ours.len();
    assert_eq!(shape(&ours[1]), shape(&cap[1]));
    assert_eq!(
        shape(&ours[2]),
        shape(&cap[2]),
        "later fragments carry name: null"
    );
    assert_eq!(
        shape(&ours[n - 2]),
        shape(&cap[cap.len() - 2]),
        "finish chunk, delta {{}}"
    );
    assert_eq!(ours[n - 2]["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(ours[n - 2]["choices"][0]["delta"], json!({}));
    // Non-streamed: message.tool_calls, arguments re-serialized as Python's json.dumps.
    let body = replay(&base, "/v1/chat/completions", "tools_required.request.json").await;
    let ours: Value = serde_json::from_str(&body).unwrap();
    let cap = fixture_json("tools_required.json");
    assert_eq!(shape(&ours), shape(&cap));
    assert_eq!(ours["choices"][0]["finish_reason"], "tool_calls");
    let args = ours["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    assert!(args.contains("\": "), "Python separators: {args}");
    let named: Value = serde_json::from_str(
        &replay(&base, "/v1/chat/completions", "tools_named.request.json").await,
    )
    .unwrap();
    assert_eq!(shape(&named), shape(&fixture_json("tools_named.json")));
    assert_eq!(named["choices"][0]["finish_reason"], "stop");
    sim.shutdown().await;
}

#[tokio::test]
async fn tool_arguments_satisfy_their_schemas() {
    let sim = sim(false).await;
    let schemas = [
        json!({"type": "object", "properties": {"q": {"type": "string", "minLength": 3, "maxLength": 8}}, "required": ["q"]}),
        json!({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "x": {"type": "number", "minimum": 0.5, "maximum": 0.75},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
            "inner": {"type": "object", "properties": {"deep": {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}, "required": ["deep"]}
        }, "required": ["n", "x", "flag", "tags", "inner"]}),
        json!({"type": "object", "properties": {}}),
    ];
    for (i, schema) in schemas.iter().enumerate() {
        for seed in 0..4 {
            let body = json!({
                "model": "tiny", "messages": [{"role": "user", "content": "go"}], "seed": seed,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": if seed % 2 == 0 { json!({"type": "function", "function": {"name": "f"}}) } else { json!("required") },
            });
            let (status, _, text) = post(&sim.base_url(), "/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            let args = v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap();
            assert!(
                valid(&serde_json::from_str(args).unwrap(), schema),
                "schema {i}: {args}"
            );
        }
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn tool_and_logprob_errors_match_the_captures() {
    let sim = sim(false).await;
    for name in [
        "error_tool_choice_unknown",
        "error_tool_choice_no_tools",
        "error_top_logprobs_21",
        "chat_top_logprobs_without_logprobs",
        "error_chat_logprobs_negative",
    ] {
        let (status, _, body) = post(
            &sim.base_url(),
            "/v1/chat/completions",
            &fixture_json(&format!("{name}.request.json")),
        )
        .await;
        assert_eq!(
            status.to_string(),
            fixture(&format!("{name}.status.txt")).trim(),
            "{name}"
        );
        let ours: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(ours, fixture_json(&format!("{name}.json")), "{name}");
    }
    sim.shutdown().await;
}

/// vLLM's invariants: logprobs ≤ 0, the sampled token first in `top_logprobs`, the others in
/// rank order, `bytes` the token's UTF-8.
fn check_chat_logprob(entry: &Value, k: usize) {
    let lp = entry["logprob"].as_f64().unwrap();
    assert!(lp <= 0.0);
    let bytes: Vec<u8> = entry["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        entry["token"].as_str().unwrap()
    );
    let top = entry["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), k);
    if k > 0 {
        assert_eq!(top[0]["token"], entry["token"]);
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        for w in top[1..].windows(2) {
            assert!(w[0]["logprob"].as_f64().unwrap() >= w[1]["logprob"].as_f64().unwrap());
        }
    }
}

#[tokio::test]
async fn logprobs_have_vllm_shapes_and_invariants_and_follow_the_seed() {
    let sim = sim(false).await;
    let base = sim.base_url();
    let body = replay(&base, "/v1/chat/completions", "chat_logprobs.request.json").await;
    let ours: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(shape(&ours), shape(&fixture_json("chat_logprobs.json")));
    let content = ours["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 6);
    content.iter().for_each(|e| check_chat_logprob(e, 2));
    let again = replay(&base, "/v1/chat/completions", "chat_logprobs.request.json").await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(
        again["choices"][0]["logprobs"], ours["choices"][0]["logprobs"],
        "same seed"
    );

    let stream = events(
        &replay(
            &base,
            "/v1/chat/completions",
            "chat_logprobs_stream.request.json",
        )
        .await,
    );
    let cap = events(&fixture("chat_logprobs_stream.sse"));
    assert_eq!(
        shape(&stream[1]),
        shape(&cap[1]),
        "content chunk with logprobs"
    );
    assert!(stream[0]["choices"][0]["logprobs"].is_null());
    let streamed: Vec<Value> = stream[1..stream.len() - 1]
        .iter()
        .map(|e| e["choices"][0]["logprobs"]["content"][0].clone())
        .collect();
    assert_eq!(
        &streamed, content,
        "stream and non-stream agree under one seed"
    );

    let top0: Value = serde_json::from_str(
        &replay(
            &base,
            "/v1/chat/completions",
            "chat_logprobs_top0.request.json",
        )
        .await,
    )
    .unwrap();
    assert_eq!(
        shape(&top0),
        shape(&fixture_json("chat_logprobs_top0.json"))
    );
    check_chat_logprob(&top0["choices"][0]["logprobs"]["content"][0], 0);
    sim.shutdown().await;
}

#[tokio::test]
async fn completions_match_the_captures_stream_and_not() {
    let sim = sim(false).await;
    let base = sim.base_url();
    for name in [
        "completions",
        "completions_plain",
        "completions_prompt_list",
        "completions_prompt_ids",
    ] {
        let ours: Value = serde_json::from_str(
            &replay(&base, "/v1/completions", &format!("{name}.request.json")).await,
        )
        .unwrap();
        let cap = fixture_json(&format!("{name}.json"));
        assert_eq!(canonical(ours.clone()), canonical(cap.clone()), "{name}");
        assert_eq!(
            ours["usage"], cap["usage"],
            "{name}: same tokenizer, same usage"
        );
        assert!(ours["id"].as_str().unwrap().starts_with("cmpl-"));
    }
    let ours: Value =
        serde_json::from_str(&replay(&base, "/v1/completions", "completions.request.json").await)
            .unwrap();
    let lp = &ours["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i], offset);
        offset += t.as_str().unwrap().chars().count();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(
            top.keys().next(),
            t.as_str().map(str::to_owned).as_ref(),
            "sampled first"
        );
        assert!((2..=3).contains(&top.len()) || top.len() == 1);
        assert!(lp["token_logprobs"][i].as_f64().unwrap() <= 0.0);
    }
    for name in ["completions_stream", "completions_plain_stream"] {
        let ours = events(&replay(&base, "/v1/completions", &format!("{name}.request.json")).await);
        let cap = events(&fixture(&format!("{name}.sse")));
        assert_eq!(
            ours.len(),
            cap.len(),
            "{name}: one chunk per token (+ usage)"
        );
        for (o, c) in ours.iter().zip(&cap) {
            assert_eq!(canonical(o.clone()), canonical(c.clone()), "{name}");
        }
        assert_eq!(
            ours.last().unwrap().get("usage"),
            cap.last().unwrap().get("usage"),
            "{name}"
        );
    }
    for name in [
        "error_completions_logprobs_21",
        "error_completions_unknown_model",
        "error_completions_token_oov",
        "error_completions_empty_prompt",
    ] {
        let (status, _, body) = post(
            &base,
            "/v1/completions",
            &fixture_json(&format!("{name}.request.json")),
        )
        .await;
        assert_eq!(
            status.to_string(),
            fixture(&format!("{name}.status.txt")).trim(),
            "{name}"
        );
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap(),
            fixture_json(&format!("{name}.json")),
            "{name}"
        );
    }
    sim.shutdown().await;
}

/// Usage of chat, tool-call and completion requests adds up to vLLM's token counters.
#[tokio::test]
async fn usage_adds_up_to_the_metrics_counters() {
    let sim = sim(false).await;
    let base = sim.base_url();
    let (mut prompt, mut generated) = (0, 0);
    for (path, req) in [
        ("/v1/chat/completions", "tools_named.request.json"),
        ("/v1/chat/completions", "tools_required.request.json"),
        ("/v1/chat/completions", "chat_logprobs.request.json"),
        ("/v1/completions", "completions.request.json"),
        ("/v1/completions", "completions_prompt_ids.request.json"),
    ] {
        let v: Value = serde_json::from_str(&replay(&base, path, req).await).unwrap();
        prompt += v["usage"]["prompt_tokens"].as_u64().unwrap();
        generated += v["usage"]["completion_tokens"].as_u64().unwrap();
    }
    let c = http();
    assert_eq!(
        metric(&c, &base, "vllm:prompt_tokens_total").await,
        prompt as f64
    );
    assert_eq!(
        metric(&c, &base, "vllm:generation_tokens_total").await,
        generated as f64
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn request_id_becomes_the_response_id_and_is_not_echoed() {
    let sim = sim(false).await;
    for (path, req, id) in [
        (
            "/v1/chat/completions",
            "chat_request_id.request.json",
            "chatcmpl-abc-123",
        ),
        (
            "/v1/completions",
            "completions_request_id.request.json",
            "cmpl-abc-123",
        ),
        (
            "/v1/embeddings",
            "embeddings_request_id.request.json",
            "embd-abc-123",
        ),
    ] {
        let resp = http()
            .post(format!("{}{path}", sim.base_url()))
            .header("X-Request-Id", "abc-123")
            .json(&fixture_json(req))
            .send()
            .await
            .unwrap();
        assert!(
            resp.headers().get("x-request-id").is_none(),
            "vLLM does not echo it"
        );
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["id"], id);
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn cached_tokens_are_reported_where_vllm_puts_them() {
    let plain = sim(false).await;
    let v: Value = serde_json::from_str(
        &replay(
            &plain.base_url(),
            "/v1/chat/completions",
            "cached_second.request.json",
        )
        .await,
    )
    .unwrap();
    assert!(
        v["usage"]["prompt_tokens_details"].is_null(),
        "off by default, as in vLLM"
    );
    plain.shutdown().await;

    let sim = sim(true).await;
    let base = sim.base_url();
    let first = events(
        &replay(
            &base,
            "/v1/chat/completions",
            "cached_first_stream.request.json",
        )
        .await,
    );
    let second = events(
        &replay(
            &base,
            "/v1/chat/completions",
            "cached_second_stream.request.json",
        )
        .await,
    );
    let cap = events(&fixture("cached_second_stream.sse"));
    let (u1, u2) = (
        &first.last().unwrap()["usage"],
        &second.last().unwrap()["usage"],
    );
    assert_eq!(shape(u2), shape(&cap.last().unwrap()["usage"]));
    assert_eq!(
        u1["prompt_tokens"],
        cap.last().unwrap()["usage"]["prompt_tokens"],
        "259 tokens"
    );
    assert_eq!(u1["prompt_tokens_details"]["cached_tokens"], 0);
    // Blocks of 16 here, 128 on vLLM's CPU backend: 256 of the 259 tokens either way.
    assert_eq!(u2["prompt_tokens_details"]["cached_tokens"], 256);
    let ns: Value = serde_json::from_str(
        &replay(&base, "/v1/chat/completions", "cached_second.request.json").await,
    )
    .unwrap();
    assert_eq!(
        shape(&ns["usage"]),
        shape(&fixture_json("cached_second.json")["usage"])
    );
    let c: Value = serde_json::from_str(
        &replay(&base, "/v1/completions", "cached_completions.request.json").await,
    )
    .unwrap();
    assert_eq!(
        shape(&c["usage"]),
        shape(&fixture_json("cached_completions.json")["usage"])
    );
    let cs = events(
        &replay(
            &base,
            "/v1/completions",
            "cached_completions_again_stream.request.json",
        )
        .await,
    );
    let cap = events(&fixture("cached_completions_again_stream.sse"));
    assert_eq!(
        shape(&cs.last().unwrap()["usage"]),
        shape(&cap.last().unwrap()["usage"])
    );
    sim.shutdown().await;
}

/// Standard base64, for checking the simulator's output.
// TODO(base64 crate): use the crate once it is a dependency.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let mut out = Vec::new();
    for chunk in s.trim_end_matches('=').as_bytes().chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | (u32::from(val(c)) << (18 - 6 * i)));
        out.extend(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

#[tokio::test]
async fn embeddings_match_the_captures_and_base64_decodes_to_the_floats() {
    let sim = sim(false).await;
    let base = sim.base_url();
    let floats: Value = serde_json::from_str(
        &replay(&base, "/v1/embeddings", "embeddings_list.request.json").await,
    )
    .unwrap();
    let cap = fixture_json("embeddings_list.json");
    assert_eq!(shape(&floats), shape(&cap));
    let v = floats["data"][1]["embedding"].as_array().unwrap();
    assert_eq!(
        v.len(),
        cap["data"][1]["embedding"].as_array().unwrap().len()
    );
    let norm: f64 = v
        .iter()
        .map(|x| x.as_f64().unwrap().powi(2))
        .sum::<f64>()
        .sqrt();
    assert!((norm - 1.0).abs() < 1e-4);
    assert_eq!(floats["usage"], cap["usage"], "same tokenizer: 14 tokens");
    let b64: Value = serde_json::from_str(
        &replay(&base, "/v1/embeddings", "embeddings_base64.request.json").await,
    )
    .unwrap();
    assert_eq!(shape(&b64), shape(&fixture_json("embeddings_base64.json")));
    for i in 0..2 {
        let bytes = base64_decode(b64["data"][i]["embedding"].as_str().unwrap());
        let decoded: Vec<f32> = bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // JSON carries each f32 widened to f64, as vLLM prints it.
        let direct: Vec<f32> = floats["data"][i]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(decoded, direct);
    }
    for name in ["embeddings_string", "embeddings_token_ids"] {
        let ours: Value = serde_json::from_str(
            &replay(&base, "/v1/embeddings", &format!("{name}.request.json")).await,
        )
        .unwrap();
        assert_eq!(
            ours["usage"],
            fixture_json(&format!("{name}.json"))["usage"],
            "{name}"
        );
    }
    for (path, name) in [
        ("/v1/embeddings", "embeddings_dimensions"),
        ("/v1/embeddings", "error_embeddings_unknown_model"),
        ("/v1/embeddings", "error_embeddings_empty"),
        ("/v1/chat/completions", "error_chat_on_embedding_model"),
        ("/v1/completions", "error_completions_on_embedding_model"),
    ] {
        let (status, _, body) =
            post(&base, path, &fixture_json(&format!("{name}.request.json"))).await;
        assert_eq!(
            status.to_string(),
            fixture(&format!("{name}.status.txt")).trim(),
            "{name}"
        );
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap(),
            fixture_json(&format!("{name}.json")),
            "{name}"
        );
    }
    let models: Value = http()
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "tiny-embed"]);
    assert_eq!(
        shape(&models["data"][1]),
        shape(&fixture_json("embedding_models.json")["data"][0])
    );
    sim.shutdown().await;
}
