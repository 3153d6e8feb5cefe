//! `--profile fixed`: first token exactly T after arrival, then one every I, however many
//! streams run, with the usual wire, usage, metrics, faults and disconnects. Bounds are loose
//! (a debug build on two shared cores) but far from what batching or queueing would give.

use std::time::Duration;

use switchyard::sim::{FaultSpec, SimConfig, SimServer, Timing};

use crate::common::{Streamed, chat_body, eventually, http, metric, metric_sum, stream};

const TTFT: f64 = 0.050;
const ITL: f64 = 0.020;

async fn sim_fixed(max_num_seqs: usize) -> SimServer {
    SimServer::start(SimConfig {
        model: "small".into(),
        timing: Timing::fixed_ms(50, 20),
        max_num_seqs,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// Measured time to first content and mean gap between contents, in seconds.
fn timing(s: &Streamed) -> (f64, f64) {
    let times = &s.content_times;
    assert!(times.len() > 32, "{s:?}");
    let ttft = times[0].duration_since(s.sent.unwrap()).as_secs_f64();
    let span = times[times.len() - 1]
        .duration_since(times[0])
        .as_secs_f64();
    (ttft, span / (times.len() - 1) as f64)
}

fn assert_timing(what: &str, ttft: f64, itl: f64) {
    assert!(
        (TTFT..=TTFT + 0.150).contains(&ttft),
        "{what}: TTFT {ttft:.3} s"
    );
    assert!(
        (ITL * 0.85..=ITL * 2.0).contains(&itl),
        "{what}: mean ITL {itl:.4} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_gets_the_fixed_ttft_and_itl() {
    let sim = sim_fixed(256).await;
    let client = http();
    let base = sim.base_url();
    let s = stream(&client, &base, &chat_body("small", "Hi.", 64, true)).await;
    assert!(s.status == 200 && s.done, "{s:?}");
    assert_eq!(s.completion_tokens, Some(64));
    let (ttft, itl) = timing(&s);
    assert_timing("one stream", ttft, itl);

    // Usage and metrics as with the modeled profiles; the engine's own TTFT is exact.
    let prompt = s.prompt_tokens.unwrap() as f64;
    assert_eq!(
        metric(&client, &base, "vllm:generation_tokens_total").await,
        64.0
    );
    assert_eq!(
        metric(&client, &base, "vllm:prompt_tokens_total").await,
        prompt
    );
    assert_eq!(
        metric_sum(&base, "vllm:request_success_total", "length").await,
        1.0
    );
    assert_eq!(
        metric(&client, &base, "vllm:time_to_first_token_seconds_count").await,
        1.0
    );
    let ttft_sum = metric(&client, &base, "vllm:time_to_first_token_seconds_sum").await;
    assert!((ttft_sum - TTFT).abs() < 1e-3, "{ttft_sum}");
    let itl_sum = metric(&client, &base, "vllm:inter_token_latency_seconds_sum").await;
    assert!((itl_sum - 63.0 * ITL).abs() < 1e-3, "{itl_sum}");
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await,
        0.0
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_streams_are_as_fast_as_one_with_no_batching_or_queueing() {
    // Eight slots would queue 42 of the 50 in a modeled engine; fixed timing has no slots.
    let sim = sim_fixed(8).await;
    let client = http();
    let base = sim.base_url();
    let body = chat_body("small", "Tell me a story.", 64, true);
    let single = stream(&client, &base, &body).await;
    let (ttft_1, itl_1) = timing(&single);
    assert_timing("one stream", ttft_1, itl_1);

    // The engine's own clock is exact; the clients' clock is a debug build on two shared
    // cores. So the engine's histograms carry the exact claim, and the wall clock only has to
    // tell fixed timing (about 1.3 s for all fifty) from a queue of eight (over 9 s).
    let started = std::time::Instant::now();
    let runs: Vec<_> = (0..50)
        .map(|_| {
            let (client, base, body) = (client.clone(), base.clone(), body.clone());
            tokio::spawn(async move { stream(&client, &base, &body).await })
        })
        .collect();
    let all_running = eventually(Duration::from_secs(1), || async {
        metric(&client, &base, "vllm:num_requests_running").await == 50.0
    })
    .await;
    assert!(all_running.is_some(), "all 50 run at once");
    for r in runs {
        let s = r.await.unwrap();
        assert!(s.done && s.completion_tokens == Some(64), "{s:?}");
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert!(elapsed < 5.0, "fifty streams took {elapsed:.2} s");
    assert_eq!(
        metric(&client, &base, "vllm:time_to_first_token_seconds_count").await,
        51.0
    );
    let ttft_sum = metric(&client, &base, "vllm:time_to_first_token_seconds_sum").await;
    assert!((ttft_sum - 51.0 * TTFT).abs() < 51e-3, "{ttft_sum}");
    let itl_sum = metric(&client, &base, "vllm:inter_token_latency_seconds_sum").await;
    assert!((itl_sum - 51.0 * 63.0 * ITL).abs() < 51e-3, "{itl_sum}");
    assert_eq!(
        metric(&client, &base, "vllm:generation_tokens_total").await,
        51.0 * 64.0
    );
    assert_eq!(
        metric(&client, &base, "vllm:num_preemptions_total").await,
        0.0
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_is_aborted_and_faults_apply() {
    let sim = sim_fixed(256).await;
    let client = http();
    let base = sim.base_url();
    // Disconnect: read a few chunks, drop the response; the stream stops running.
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body("small", "Hi.", 10_000, true))
        .send()
        .await
        .unwrap();
    let mut bytes = resp.bytes_stream();
    for _ in 0..3 {
        futures::StreamExt::next(&mut bytes).await.unwrap().unwrap();
    }
    assert_eq!(
        metric(&client, &base, "vllm:num_requests_running").await,
        1.0
    );
    drop(bytes);
    let idle = eventually(Duration::from_secs(2), || async {
        metric(&client, &base, "vllm:num_requests_running").await == 0.0
    })
    .await;
    assert!(idle.is_some(), "the abandoned stream is aborted");
    assert_eq!(
        metric_sum(&base, "vllm:request_success_total", "").await,
        0.0
    );

    // Crash fault: the stream is cut after three tokens.
    sim.set_faults(&FaultSpec {
        crash_after_tokens: Some(3),
        ..FaultSpec::default()
    });
    let s = stream(&client, &base, &chat_body("small", "Hi.", 64, true)).await;
    assert!(s.cut && !s.done, "{s:?}");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_scale_divides_fixed_timing() {
    let sim = SimServer::start(SimConfig {
        model: "small".into(),
        timing: Timing::fixed_ms(500, 200),
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let s = stream(
        &http(),
        &sim.base_url(),
        &chat_body("small", "Hi.", 64, true),
    )
    .await;
    assert_eq!(s.completion_tokens, Some(64));
    let (ttft, itl) = timing(&s);
    assert_timing("500/200 ms at time scale 10", ttft, itl);
    sim.shutdown().await;
}
