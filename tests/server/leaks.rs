//! `switchyard_tasks_alive` returns to its baseline after load in which half of the clients
//! abandon their streams: every stream is bound to its request.

use std::time::Duration;

use futures::StreamExt;
use serde_json::json;

use crate::common::{fleet, http, wait_for};

async fn tasks_alive(base: &str) -> f64 {
    let page = http()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    page.lines()
        .find(|l| l.starts_with("switchyard_tasks_alive "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_alive_returns_to_baseline_after_1000_streams_half_abandoned() {
    let fleet = fleet(&[("small", 2)], 50.0, |c| {
        c.server.timeouts.cancel_grace_ms = 200;
    })
    .await;
    let base = fleet.server.base_url();
    let baseline = tasks_alive(&base).await;
    assert!(baseline > 0.0);
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let key = fleet.api_key.clone();
    let body = json!({
        "model": "small",
        "messages": [{"role": "user", "content": "Tell me something."}],
        "max_tokens": 24,
        "stream": true,
    });
    let results: Vec<(u16, bool)> = futures::stream::iter(0..1000)
        .map(|i| {
            let (url, key, body) = (url.clone(), key.clone(), body.clone());
            async move {
                let resp = http()
                    .post(url)
                    .bearer_auth(key)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = resp.status().as_u16();
                let mut stream = resp.bytes_stream();
                if i % 2 == 0 {
                    // Abandon after the first bytes.
                    let _ = stream.next().await;
                    return (status, false);
                }
                let mut text = String::new();
                while let Some(Ok(chunk)) = stream.next().await {
                    text.push_str(&String::from_utf8_lossy(&chunk));
                }
                (status, text.contains("data: [DONE]"))
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    assert!(results.iter().all(|(s, _)| *s == 200), "all admitted");
    assert_eq!(
        results.iter().filter(|(_, done)| *done).count(),
        500,
        "every kept stream completed"
    );
    // Back to its baseline (a leak is growth; a task alive at the baseline's reading, such
    // as a first lease round, may have ended since). On a loaded machine the 500 abandoned
    // streams' cancels take a while to drain.
    let started = std::time::Instant::now();
    let mut alive = tasks_alive(&base).await;
    while alive > baseline && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        alive = tasks_alive(&base).await;
    }
    assert!(
        alive <= baseline,
        "switchyard_tasks_alive {alive} a minute after the load; its baseline was {baseline}"
    );
    wait_for(Duration::from_secs(10), "no open reservation", || {
        let store = fleet.store.clone();
        async move { store.open_reservations().await.unwrap() == 0 }
    })
    .await;
    for node in &fleet.nodes {
        assert_eq!(
            node.sim.stats().running,
            0,
            "no sequence left on {}",
            node.node_id
        );
    }
    let rows = fleet.store.ledger_rows(None).await.unwrap();
    assert_eq!(rows.len(), 1000);
    fleet.shutdown(Duration::from_secs(1)).await;
}
