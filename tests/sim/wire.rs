//! Wire fidelity: the simulator's answers have the captures' shapes — keys in order, value
//! types, event order, status codes and content types — and, where the same tokenizer makes
//! it possible, the captures' exact usage and error texts.

use serde_json::Value;

use crate::common::{fixture, fixture_json, http, metrics_page, shape, sse_data, tiny_sim};

fn parse_events(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .map(|d| {
            if d == "[DONE]" {
                Value::String(d.clone())
            } else {
                serde_json::from_str(d).unwrap()
            }
        })
        .collect()
}

fn header_value(headers_fixture: &str, name: &str) -> String {
    headers_fixture
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap()
        .trim()
        .to_string()
}

/// Posts a captured request to the simulator; returns status, content type and body.
async fn replay(base: &str, request_fixture: &str) -> (u16, String, String) {
    let resp = http()
        .post(format!("{base}/v1/chat/completions"))
        .json(&fixture_json(request_fixture))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let ctype = resp.headers()["content-type"].to_str().unwrap().to_string();
    (status, ctype, resp.text().await.unwrap())
}

/// Checks a streamed body event by event against a captured one.
fn assert_stream_shapes(ours: &[Value], captured: &[Value]) {
    assert_eq!(
        ours.last(),
        Some(&Value::String("[DONE]".into())),
        "ends with [DONE]"
    );
    let n = captured.len();
    // role chunk, content chunks, finish chunk, (usage chunk), [DONE]
    assert_eq!(shape(&ours[0]), shape(&captured[0]), "role chunk");
    assert_eq!(
        shape(&ours[ours.len() - 2]),
        shape(&captured[n - 2]),
        "last chunk before [DONE]"
    );
    if captured[n - 2]["choices"].as_array().unwrap().is_empty() {
        assert_eq!(
            shape(&ours[ours.len() - 3]),
            shape(&captured[n - 3]),
            "finish chunk"
        );
    }
    let content = &captured[1];
    for ev in &ours[1..ours.len() - 2] {
        if ev["choices"][0]["finish_reason"].is_null()
            && !ev["choices"].as_array().unwrap().is_empty()
        {
            assert_eq!(shape(ev), shape(content), "content chunk");
        }
    }
    let id = &ours[0]["id"];
    assert!(id.as_str().unwrap().starts_with("chatcmpl-"));
    assert!(
        ours[..ours.len() - 1].iter().all(|e| &e["id"] == id),
        "one id per stream"
    );
}

#[tokio::test]
async fn streaming_with_usage_matches_the_capture() {
    let sim = tiny_sim(50.0).await;
    let (status, ctype, body) = replay(&sim.base_url(), "stream_chat_usage.request.json").await;
    assert_eq!(status, 200);
    assert_eq!(
        ctype,
        header_value(&fixture("stream_chat_usage.headers.txt"), "content-type")
    );
    let ours = parse_events(&body);
    let captured = parse_events(&fixture("stream_chat_usage.sse"));
    assert_stream_shapes(&ours, &captured);
    assert_eq!(
        ours.len(),
        captured.len(),
        "role + 20 tokens + usage + [DONE]"
    );
    let usage = &ours[ours.len() - 2]["usage"];
    assert_eq!(
        usage,
        &captured[captured.len() - 2]["usage"],
        "same tokenizer, same usage: 30 + 20"
    );
    assert!(
        ours[1..ours.len() - 2]
            .iter()
            .all(|e| e.get("usage").is_none()),
        "no usage key on content chunks"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn streaming_without_usage_matches_the_capture() {
    let sim = tiny_sim(50.0).await;
    let (status, _, body) = replay(&sim.base_url(), "stream_chat_nousage.request.json").await;
    assert_eq!(status, 200);
    let ours = parse_events(&body);
    let captured = parse_events(&fixture("stream_chat_nousage.sse"));
    assert_stream_shapes(&ours, &captured);
    assert!(
        ours.iter().all(|e| e.get("usage").is_none()),
        "no usage chunk without include_usage"
    );
    assert_eq!(
        ours[ours.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert!(ours[ours.len() - 2].get("system_fingerprint").is_some());
    sim.shutdown().await;
}

#[tokio::test]
async fn stop_strings_end_with_stop_reason_and_are_not_sent() {
    let sim = tiny_sim(50.0).await;
    let (status, _, body) = replay(&sim.base_url(), "stream_chat_stop.request.json").await;
    assert_eq!(status, 200);
    let ours = parse_events(&body);
    let captured = parse_events(&fixture("stream_chat_stop.sse"));
    assert_stream_shapes(&ours, &captured);
    let finish = &ours[ours.len() - 3]["choices"][0];
    assert_eq!(finish["finish_reason"], "stop");
    assert_eq!(finish["stop_reason"], "e");
    let text: String = ours[1..ours.len() - 2]
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(
        !text.contains('e'),
        "the stop string is not part of the content: {text:?}"
    );
    assert_eq!(
        ours[ours.len() - 2]["usage"]["prompt_tokens"],
        18,
        "as the capture counted"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn non_streaming_matches_the_capture() {
    let sim = tiny_sim(50.0).await;
    let (status, ctype, body) = replay(&sim.base_url(), "chat_nonstream.request.json").await;
    assert_eq!(status, 200);
    assert_eq!(
        ctype,
        header_value(&fixture("chat_nonstream.headers.txt"), "content-type")
    );
    let ours: Value = serde_json::from_str(&body).unwrap();
    let captured = fixture_json("chat_nonstream.json");
    assert_eq!(shape(&ours), shape(&captured));
    assert_eq!(ours["usage"], captured["usage"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn same_seed_gives_the_same_text() {
    let sim = tiny_sim(50.0).await;
    let a = replay(&sim.base_url(), "chat_nonstream.request.json")
        .await
        .2;
    let b = replay(&sim.base_url(), "chat_nonstream.request.json")
        .await
        .2;
    let text = |s: &str| {
        serde_json::from_str::<Value>(s).unwrap()["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(text(&a), text(&b));
    sim.shutdown().await;
}

#[tokio::test]
async fn errors_match_the_captures_exactly() {
    let sim = tiny_sim(50.0).await;
    for (request, expected, status_file, headers) in [
        (
            "error_unknown_model.request.json",
            "error_unknown_model.json",
            "error_unknown_model.status.txt",
            "error_unknown_model.headers.txt",
        ),
        (
            "error_too_long.request.json",
            "error_too_long.json",
            "error_too_long.status.txt",
            "error_too_long.headers.txt",
        ),
        (
            "error_too_long_stream.request.json",
            "error_too_long_stream.json",
            "error_too_long_stream.status.txt",
            "error_too_long_stream.headers.txt",
        ),
    ] {
        let (status, ctype, body) = replay(&sim.base_url(), request).await;
        assert_eq!(status.to_string(), fixture(status_file).trim(), "{request}");
        assert_eq!(
            ctype,
            header_value(&fixture(headers), "content-type"),
            "{request}: plain JSON, even for streams"
        );
        let ours: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(ours, fixture_json(expected), "{request}");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn prompt_plus_max_tokens_over_the_limit_is_capped_not_refused() {
    let sim = tiny_sim(50.0).await;
    let (status, _, body) = replay(
        &sim.base_url(),
        "prompt_plus_max_tokens_over_limit.request.json",
    )
    .await;
    assert_eq!(status, 200);
    let ours: Value = serde_json::from_str(&body).unwrap();
    let captured = fixture_json("prompt_plus_max_tokens_over_limit.json");
    assert_eq!(
        ours["usage"], captured["usage"],
        "997 + 27 = 1024, as vLLM did"
    );
    assert_eq!(ours["choices"][0]["finish_reason"], "length");
    sim.shutdown().await;
}

#[tokio::test]
async fn models_health_and_version_match_the_captures() {
    let sim = tiny_sim(50.0).await;
    let client = http();
    let base = sim.base_url();
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let captured = fixture_json("models.json");
    assert_eq!(shape(&models), shape(&captured));
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 1024);
    let health = client.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(
        health.bytes().await.unwrap().len(),
        0,
        "empty body, as health.txt shows"
    );
    let version: Value = client
        .get(format!("{base}/version"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(version, serde_json::json!({"version": "0.32.0"}));
    sim.shutdown().await;
}

/// Family name → (type, help).
type Families = std::collections::BTreeMap<String, (String, String)>;
/// Sample name → label names in order.
type SampleLabels = std::collections::BTreeMap<String, Vec<String>>;

/// `# TYPE` and `# HELP` of every family and the label names of every sample of a page.
fn families(page: &str) -> (Families, SampleLabels) {
    let mut types = std::collections::BTreeMap::new();
    let mut helps = std::collections::BTreeMap::new();
    let mut labels = std::collections::BTreeMap::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_string(), kind.to_string());
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            helps.insert(name.to_string(), help.to_string());
        } else if let Some((name, rest)) = line.split_once('{') {
            let keys: Vec<String> = rest
                .split("\",")
                .filter_map(|kv| {
                    kv.split_once('=')
                        .map(|(k, _)| k.trim_start_matches(',').to_string())
                })
                .collect();
            labels.entry(name.to_string()).or_insert(keys);
        }
    }
    let merged = types.into_iter().map(|(k, t)| {
        let h = helps.get(&k).cloned().unwrap_or_default();
        (k, (t, h))
    });
    (merged.collect(), labels)
}

#[tokio::test]
async fn metrics_have_vllm_names_types_help_and_labels() {
    let sim = tiny_sim(50.0).await;
    let client = http();
    let base = sim.base_url();
    // Some traffic so every histogram has samples.
    replay(&base, "chat_nonstream.request.json").await;
    let resp = client.get(format!("{base}/metrics")).send().await.unwrap();
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let page = resp.text().await.unwrap();
    let (ours, our_labels) = families(&page);
    let (captured, captured_labels) = families(&fixture("metrics_busy.txt"));
    for required in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ] {
        assert!(ours.contains_key(required), "{required} missing");
    }
    for (name, type_help) in &ours {
        assert_eq!(
            Some(type_help),
            captured.get(name),
            "{name}: type and help as vLLM's"
        );
    }
    for (sample, keys) in &our_labels {
        let theirs = captured_labels
            .get(sample)
            .unwrap_or_else(|| panic!("{sample} is not a vLLM sample"));
        if sample == "vllm:cache_config_info" {
            for k in [
                "block_size",
                "num_gpu_blocks",
                "kv_cache_size_tokens",
                "gpu_memory_utilization",
                "engine",
            ] {
                assert!(keys.contains(&k.to_string()), "cache_config_info lacks {k}");
            }
            assert!(
                keys.iter().all(|k| theirs.contains(k)),
                "{keys:?} ⊄ {theirs:?}"
            );
        } else {
            assert_eq!(keys, theirs, "{sample}: label names and order");
        }
    }
    assert!(page.contains("vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"tiny\"} 1.0"));
    let kv: f64 = page
        .lines()
        .find(|l| l.starts_with("vllm:kv_cache_usage_perc{"))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    assert!((0.0..=1.0).contains(&kv), "a fraction, not a percentage");
    sim.shutdown().await;
}

#[tokio::test]
async fn without_max_tokens_the_model_ends_its_answer_itself() {
    let sim = tiny_sim(50.0).await;
    let body = serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": true,
        "stream_options": {},
    });
    let resp = http()
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let events = parse_events(&resp.text().await.unwrap());
    let usage = &events[events.len() - 2]["usage"];
    let finish = &events[events.len() - 3]["choices"][0];
    assert_eq!(
        finish["finish_reason"], "stop",
        "an end-of-sequence token, not the context limit"
    );
    assert!(finish["stop_reason"].is_null());
    let n = usage["completion_tokens"].as_u64().unwrap();
    assert!(
        (128..=384).contains(&n),
        "about --natural-output-tokens (256): {n}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn continuous_usage_stats_put_running_totals_on_every_chunk() {
    let sim = tiny_sim(50.0).await;
    let body = serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 5,
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true},
    });
    let resp = http()
        .post(format!("{}/v1/chat/completions", sim.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let events = parse_events(&resp.text().await.unwrap());
    let completions: Vec<u64> = events[..events.len() - 1]
        .iter()
        .map(|e| e["usage"]["completion_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(
        completions,
        [0, 1, 2, 3, 4, 5, 5],
        "role, 5 tokens, final usage chunk"
    );
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e["usage"]["prompt_tokens"] == 18)
    );
    sim.shutdown().await;
}

/// `/sim/gpu/metrics`: the profile's GPUs as DCGM exporter shows them, busy while the engine
/// ran steps; vLLM's own page stays vLLM's.
#[tokio::test]
async fn simulated_gpus_show_the_engines_busy_time_as_dcgm_exporter_does() {
    let sim = tiny_sim(1.0).await;
    let base = sim.base_url();
    let active = |page: &str| -> f64 {
        let line = page
            .lines()
            .find(|l| l.starts_with("DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu=\"0\","))
            .unwrap_or_else(|| panic!("no engine activity for GPU 0 in {page}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let gpu_page = || async {
        let resp = http()
            .get(format!("{base}/sim/gpu/metrics"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
    };
    let idle = gpu_page().await;
    assert_eq!(active(&idle), 0.0, "{idle}");
    for family in [
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
    ] {
        assert!(idle.contains(&format!("# TYPE {family} gauge")), "{idle}");
    }
    // While a stream is being decoded the engine runs a step every few tens of milliseconds:
    // the last second holds some of them. (The exact share is unit-tested in src/sim/gpu.rs.)
    let mut stream = http()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 400,
            "stream": true
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // A few tokens in: decode steps have run (the role chunk may come before any).
    let mut received = 0;
    while received < 600 {
        received += stream
            .chunk()
            .await
            .unwrap()
            .expect("the stream ended early")
            .len();
    }
    let busy = gpu_page().await;
    assert!(active(&busy) > 0.0, "{busy}");
    drop(stream);
    let vllm = metrics_page(&http(), &base).await;
    assert!(
        !vllm.contains("DCGM_FI_"),
        "vLLM's page has no DCGM metrics"
    );
}
