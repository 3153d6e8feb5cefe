//! Embeddings at the size retrieval pipelines send: a batch whose inputs together exceed the
//! model's context (each input is its own sequence) and whose answer is larger than a node
//! frame (the agent relays it in slices), through a real agent and the simulator.

use serde_json::json;

use crate::common::{fleet, http};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_crosses_in_slices_and_each_input_is_held_to_the_context() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let inputs: Vec<String> = (0..400)
        .map(|i| {
            format!(
                "passage {i}: {}",
                "retrieval augmented generation ".repeat(25)
            )
        })
        .collect();
    let resp = http()
        .post(format!("{}/embeddings", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .json(&json!({"model": "embed", "input": inputs}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    assert!(
        body.len() > 1 << 20,
        "larger than one node frame: {}",
        body.len()
    );
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let data = doc["data"].as_array().unwrap();
    assert_eq!(data.len(), 400);
    for (i, item) in data.iter().enumerate() {
        assert_eq!(item["index"], i, "in order, none lost");
        assert_eq!(item["embedding"].as_array().unwrap().len(), 256);
    }
    let prompt = doc["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 8192, "more than one context in all: {prompt}");

    // One input longer than the context is refused before anything runs.
    let long = "retrieval augmented generation ".repeat(3000);
    let resp = http()
        .post(format!("{}/embeddings", fleet.openai_base_url()))
        .bearer_auth(&fleet.api_key)
        .json(&json!({"model": "embed", "input": ["short", long]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let err: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    assert_eq!(err["error"]["param"], "input");
    fleet.shutdown(std::time::Duration::from_secs(1)).await;
}
