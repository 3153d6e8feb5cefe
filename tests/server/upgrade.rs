//! A rolling upgrade: an agent of the previous protocol version and one of the current
//! version serve one server at once. Chat runs on both (text only from the older one);
//! legacy completions and embeddings, which the older one cannot run, go only to the newer
//! one, and are refused with `no_healthy_node` once only older agents are left.

use std::time::Duration;

use serde_json::json;
use switchyard::demo::FleetConfig;
use switchyard_actors::model_queue::RoutingStrategy;

use crate::common::{fleet, http, metric};

const PROMPTS: &str = "vllm:prompt_tokens_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_of_the_previous_and_current_versions_serve_one_server() {
    let mut fleet = fleet(&[("small", 1)], 20.0, |c| {
        c.server.routing = RoutingStrategy::RoundRobin;
    })
    .await;
    let old = FleetConfig {
        agent_protocol: 1,
        time_scale: 20.0,
        agent_backoff_min: Duration::from_millis(100),
        ..FleetConfig::default()
    };
    let old_node = fleet
        .add_node(&old, "small-v1", "llama-3.1-8b-instruct")
        .await
        .unwrap();
    fleet.nodes.push(old_node);
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    let (new, old) = (fleet.nodes[0].sim.base_url(), fleet.nodes[1].sim.base_url());
    let client = http();
    let base = fleet.openai_base_url();
    let key = fleet.api_key.clone();
    let post = |path: &str, body: serde_json::Value| {
        client
            .post(format!("{base}{path}"))
            .bearer_auth(&key)
            .json(&body)
            .send()
    };

    // Chat alternates between the two: both answer with text.
    let before = (
        metric(&client, &new, PROMPTS).await,
        metric(&client, &old, PROMPTS).await,
    );
    for i in 0..6 {
        let body = json!({"model": "small", "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("hello {i}")}]});
        let resp = post("/chat/completions", body).await.unwrap();
        assert_eq!(resp.status(), 200);
        let doc: serde_json::Value = resp.json().await.unwrap();
        let text = doc["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!text.is_empty(), "{doc}");
    }
    let after = (
        metric(&client, &new, PROMPTS).await,
        metric(&client, &old, PROMPTS).await,
    );
    assert!(after.0 > before.0, "the current agent served chat");
    assert!(after.1 > before.1, "the previous agent served chat");

    // Completions and embeddings: the current agent only.
    let old_before = metric(&client, &old, PROMPTS).await;
    for i in 0..4 {
        let body = json!({"model": "small", "prompt": format!("Once {i}"), "max_tokens": 3});
        let resp = post("/completions", body).await.unwrap();
        assert_eq!(resp.status(), 200);
        let doc: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(doc["object"], "text_completion", "{doc}");
        let resp = post(
            "/embeddings",
            json!({"model": "embed", "input": ["a", "b"]}),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), 200);
        let doc: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(doc["data"].as_array().map(Vec::len), Some(2), "{doc}");
    }
    assert_eq!(
        metric(&client, &old, PROMPTS).await,
        old_before,
        "nothing the previous agent cannot run reached it"
    );

    // Only the previous agent left: chat still runs; the rest is refused, not misrouted.
    fleet.nodes[0].stop_agent().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let body = json!({"model": "small", "max_tokens": 4,
        "messages": [{"role": "user", "content": "still there?"}]});
    assert_eq!(post("/chat/completions", body).await.unwrap().status(), 200);
    let resp = post("/completions", json!({"model": "small", "prompt": "x"}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let err: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "no_healthy_node", "{err}");
    fleet.shutdown(Duration::from_secs(1)).await;
}
