//! Calibration over HTTP at `--profile 8b`, time-scaled and converted back: the batching
//! rate, the KV capacity at 2k and 8k context, preemption, and disconnects.

use std::time::Duration;

use switchyard::sim::{ChatMessage, SimConfig, SimServer, SimTokenizer};

use crate::common::{chat_body, eventually, http, metric, stream};

/// A user message whose chat-templated prompt is exactly `tokens` tokens long.
fn prompt_of(tokens: u32) -> String {
    let tok = SimTokenizer::load().unwrap();
    let count = |content: &str| {
        let m: ChatMessage =
            serde_json::from_value(serde_json::json!({"role": "user", "content": content}))
                .unwrap();
        tok.count_chat(&[m]).unwrap()
    };
    let overhead = count("");
    let content = " a".repeat((tokens - overhead) as usize);
    assert_eq!(count(&content), tokens, "each \" a\" is one token");
    content
}

async fn sim_8b(time_scale: f64) -> SimServer {
    SimServer::start(SimConfig {
        model: "small".into(),
        time_scale,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_streams_decode_47_each_and_1500_in_total() {
    // Low enough that a debug build on two shared cores keeps up with 32 streams.
    const SCALE: f64 = 2.0;
    let sim = sim_8b(SCALE).await;
    let client = http();
    let base = sim.base_url();
    let body = chat_body("small", "Tell me a story.", 100, true);
    let runs: Vec<_> = (0..32)
        .map(|_| {
            let (client, base, body) = (client.clone(), base.clone(), body.clone());
            tokio::spawn(async move { stream(&client, &base, &body).await })
        })
        .collect();
    let mut rates = Vec::new();
    for r in runs {
        let s = r.await.unwrap();
        assert!(s.done && s.completion_tokens == Some(100), "{s:?}");
        rates.push(s.per_stream_rate() / SCALE);
    }
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let total: f64 = rates.iter().sum();
    assert!(
        (mean - 47.0).abs() <= 5.0,
        "per-stream {mean:.1} tok/s, {rates:?}"
    );
    assert!((total - 1500.0).abs() <= 150.0, "total {total:.0} tok/s");
    sim.shutdown().await;
}

/// Sends `n` streams of a `prompt_tokens` prompt, waits until all are admitted or queued and
/// returns (running, waiting) then, after checking every stream completes.
async fn occupancy(n: usize, prompt_tokens: u32, max_tokens: u32) -> (f64, f64, f64) {
    // A step budget that prefills every waiting prompt at once makes the KV cache the only
    // limit on admission (with vLLM's default of 2,048 a burst is admitted over many steps).
    // Time scale 2, not 10: the whole burst must still be running or queued when this task
    // next samples the metrics, which on two shared cores can be a second or more away.
    // Prefix caching off: these identical prompts would otherwise share their blocks, and
    // the figures are those of distinct contexts.
    let sim = SimServer::start(SimConfig {
        model: "small".into(),
        time_scale: 2.0,
        max_num_batched_tokens: 1 << 20,
        enable_prefix_caching: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let client = http();
    let base = sim.base_url();
    let body = chat_body("small", &prompt_of(prompt_tokens), max_tokens, true);
    let runs: Vec<_> = (0..n)
        .map(|_| {
            let (client, base, body) = (client.clone(), base.clone(), body.clone());
            tokio::spawn(async move { stream(&client, &base, &body).await })
        })
        .collect();
    let mut seen = (0.0, 0.0);
    let start = std::time::Instant::now();
    while seen.0 + seen.1 != n as f64 {
        // Tokenizing 23 prompts of 8k tokens in a debug build takes seconds when the other
        // tests share the cores; the bound only guards against a hang.
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "never saw all {n} admitted or queued: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        let running = metric(&client, &base, "vllm:num_requests_running").await;
        let waiting = metric(&client, &base, "vllm:num_requests_waiting").await;
        seen = (running, waiting);
    }
    for r in runs {
        let s = r.await.unwrap();
        assert_eq!(
            (s.done, s.completion_tokens),
            (true, Some(u64::from(max_tokens)))
        );
    }
    let preemptions = metric(&client, &base, "vllm:num_preemptions_total").await;
    sim.shutdown().await;
    (seen.0, seen.1, preemptions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ninety_streams_at_2k_context_fit_and_the_91st_waits() {
    // 2,032 prompt tokens + 16 generated = 2,048: 128 blocks of 16 each.
    assert_eq!(occupancy(91, 2032, 16).await, (90.0, 1.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_two_streams_at_8k_context_fit_and_the_23rd_waits() {
    assert_eq!(occupancy(23, 8176, 16).await, (22.0, 1.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exceeding_the_cache_preempts_counts_and_still_completes() {
    let sim = SimServer::start(SimConfig {
        model: "small".into(),
        time_scale: 50.0,
        max_model_len: Some(1024),
        num_gpu_blocks_override: Some(128),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let client = http();
    let base = sim.base_url();
    let body = chat_body("small", "Write a long story.", 900, true);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let (client, base, body) = (client.clone(), base.clone(), body.clone());
            tokio::spawn(async move { stream(&client, &base, &body).await })
        })
        .collect();
    for r in runs {
        let s = r.await.unwrap();
        assert_eq!(
            (s.done, s.completion_tokens),
            (true, Some(900)),
            "preempted sequences resume"
        );
    }
    assert!(metric(&client, &base, "vllm:num_preemptions_total").await > 0.0);
    assert_eq!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await,
        0.0
    );
    assert_eq!(
        metric(&client, &base, "vllm:generation_tokens_total").await,
        3600.0
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_frees_its_sequence_at_once() {
    use futures::StreamExt;
    let sim = sim_8b(1.0).await;
    let client = http();
    let base = sim.base_url();
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body("small", "Write a long story.", 4000, true))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    for _ in 0..3 {
        body.next().await.unwrap().unwrap();
    }
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await,
        1.0
    );
    drop(body);
    let freed = eventually(Duration::from_secs(3), || {
        let (client, base) = (client.clone(), base.clone());
        async move { metric(&client, &base, "vllm:num_requests_running").await == 0.0 }
    })
    .await
    .expect("the sequence is aborted when its client leaves");
    // A step is ~19 ms at this scale; the abort lands within a few steps of the socket closing.
    assert!(freed < Duration::from_millis(500), "took {freed:?}");
    let generated = metric(&client, &base, "vllm:generation_tokens_total").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        metric(&client, &base, "vllm:generation_tokens_total").await,
        generated,
        "no more tokens"
    );
    assert_eq!(
        metric(&client, &base, "vllm:kv_cache_usage_perc").await,
        0.0,
        "its blocks are free"
    );
    sim.shutdown().await;
}
