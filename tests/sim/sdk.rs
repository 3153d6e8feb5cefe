//! The real Python `openai` package against the simulator.

use switchyard::sim::{SimConfig, SimServer};

use crate::common::run_python;

#[tokio::test]
async fn openai_python_sdk_streams_calls_tools_completes_and_embeds() {
    let sim = SimServer::start(SimConfig {
        model: "tiny".into(),
        time_scale: 20.0,
        max_model_len: Some(1024),
        embedding_model: Some("tiny-embed".into()),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let base = format!("{}/v1", sim.base_url());
    let out = run_python("sim_sdk.py", &[&base, "tiny", "tiny-embed"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["stream_no_usage"]["finish_reason"], "length");
    assert_eq!(seen["stream_usage"]["completion_tokens"], 12);
    assert_eq!(seen["non_stream"]["completion_tokens"], 7);
    assert_eq!(seen["unknown_model"], "NotFoundError");
    assert_eq!(seen["tool_call"]["finish_reason"], "stop");
    assert_eq!(seen["logprobs"], 4);
    assert_eq!(seen["completions"]["prompt_tokens"], 6);
    assert_eq!(seen["embeddings"]["prompt_tokens"], 14);
    sim.shutdown().await;
}
