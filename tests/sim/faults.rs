//! Each fault does what it says, set at run time through `/sim/faults` or by flag.

use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{chat_body, http, metric, stream, tiny_sim};

async fn set(base: &str, spec: serde_json::Value) -> reqwest::Response {
    http()
        .post(format!("{base}/sim/faults"))
        .json(&spec)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn crash_after_n_tokens_cuts_the_connection_without_done() {
    let sim = tiny_sim(20.0).await;
    let base = sim.base_url();
    assert_eq!(
        set(&base, serde_json::json!({"crash_after_tokens": 3}))
            .await
            .status(),
        200
    );
    let s = stream(&http(), &base, &chat_body("tiny", "hi", 50, true)).await;
    assert_eq!(s.status, 200);
    assert!(s.cut, "the body ends in a transport error");
    assert!(!s.done, "no [DONE]");
    assert_eq!(s.content_chunks, 3);
    assert_eq!(
        metric(&http(), &base, "vllm:num_requests_running").await,
        0.0
    );
    // DELETE clears every fault.
    let cleared = http()
        .delete(format!("{base}/sim/faults"))
        .send()
        .await
        .unwrap();
    assert_eq!(cleared.status(), 200);
    let s = stream(&http(), &base, &chat_body("tiny", "hi", 10, true)).await;
    assert!(s.done && s.completion_tokens == Some(10));
    sim.shutdown().await;
}

#[tokio::test]
async fn stall_stops_sending_but_keeps_the_socket_and_the_slot() {
    let sim = tiny_sim(20.0).await;
    let base = sim.base_url();
    set(&base, serde_json::json!({"stall_after_tokens": 2})).await;
    let resp = http()
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body("tiny", "hi", 50, true))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("\"token_ids\"").count() < 2 {
        let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let more = tokio::time::timeout(Duration::from_millis(800), body.next()).await;
    assert!(
        more.is_err(),
        "nothing more arrives, and the socket is not closed: {more:?}"
    );
    assert_eq!(
        metric(&http(), &base, "vllm:num_requests_running").await,
        1.0
    );
    drop(body);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        metric(&http(), &base, "vllm:num_requests_running").await,
        0.0
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn http_500_fails_exactly_the_next_k_requests() {
    let sim = tiny_sim(20.0).await;
    let base = sim.base_url();
    let snapshot: serde_json::Value = set(&base, serde_json::json!({"http_500": 2}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(snapshot["http_500"], 2);
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let r = http()
            .post(format!("{base}/v1/chat/completions"))
            .json(&chat_body("tiny", "hi", 3, false))
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [500, 500, 200]);
    sim.shutdown().await;
}

#[tokio::test]
async fn slow_first_token_delays_ttft_and_shows_as_deferred_waiting() {
    let sim = tiny_sim(10.0).await;
    let base = sim.base_url();
    set(&base, serde_json::json!({"slow_first_token_ms": 3000})).await;
    let task = {
        let base = base.clone();
        tokio::spawn(async move { stream(&http(), &base, &chat_body("tiny", "hi", 3, true)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let page = http()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"tiny\",reason=\"deferred\"} 1.0"));
    let s = task.await.unwrap();
    let ttft = s.content_times[0].duration_since(s.sent.unwrap());
    assert!(
        ttft >= Duration::from_millis(300),
        "3 s of engine time at scale 10: {ttft:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn load_delay_answers_503_until_loaded() {
    let sim = tiny_sim(10.0).await;
    let base = sim.base_url();
    set(&base, serde_json::json!({"load_delay_ms": 4000})).await;
    let health = http().get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 503);
    let chat = http()
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body("tiny", "hi", 3, true))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 503);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        http()
            .get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn malformed_fault_specs_are_refused() {
    let sim = tiny_sim(10.0).await;
    let r = set(&sim.base_url(), serde_json::json!({"crash_after": 1})).await;
    assert_eq!(r.status(), 400);
    let r = http()
        .post(format!("{}/sim/faults", sim.base_url()))
        .body("\u{0}\u{ff}garbage")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    sim.shutdown().await;
}

#[tokio::test]
async fn embedded_exit_fault_cuts_streams_and_stops_serving() {
    let sim = tiny_sim(10.0).await;
    let base = sim.base_url();
    let task = {
        let base = base.clone();
        tokio::spawn(
            async move { stream(&http(), &base, &chat_body("tiny", "hi", 1000, true)).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    set(&base, serde_json::json!({"exit_after_ms": 0})).await;
    tokio::time::timeout(Duration::from_secs(5), sim.stopped())
        .await
        .unwrap();
    let s = task.await.unwrap();
    assert!(s.cut && !s.done);
    sim.shutdown().await;
}

/// Starts the real binary on a free port; returns the child and its base URL.
async fn spawn_binary(extra: &[&str]) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--model",
            "tiny",
            "--max-model-len",
            "1024",
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Some(rest) = line.split("addr=").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, format!("http://{addr}"))
}

#[tokio::test]
async fn exit_fault_kills_the_process_like_a_killed_pod() {
    let (mut child, base) = spawn_binary(&["--time-scale", "10"]).await;
    let task = {
        let base = base.clone();
        tokio::spawn(
            async move { stream(&http(), &base, &chat_body("tiny", "hi", 1000, true)).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    set(&base, serde_json::json!({"exit_after_ms": 0})).await;
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(137));
    let s = task.await.unwrap();
    assert!(!s.done, "the stream in flight never completes");
}

#[tokio::test]
async fn fault_flags_apply_from_start() {
    let started = Instant::now();
    let (mut child, base) = spawn_binary(&[
        "--time-scale",
        "10",
        "--load-delay-ms",
        "2000",
        "--fault-exit-after-ms",
        "6000",
    ])
    .await;
    assert_eq!(
        http()
            .get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        503,
        "loading"
    );
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(137));
    assert!(
        started.elapsed() >= Duration::from_millis(550),
        "exit after 6 s of engine time at scale 10"
    );
}
