//! The real Python `openai` package against the simulator.

use crate::common::{run_python, tiny_sim};

#[tokio::test]
async fn openai_python_sdk_streams_and_sees_not_found() {
    let sim = tiny_sim(20.0).await;
    let base = format!("{}/v1", sim.base_url());
    let out = run_python("sim_sdk.py", &[&base, "tiny"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["stream_no_usage"]["finish_reason"], "length");
    assert_eq!(seen["stream_usage"]["completion_tokens"], 12);
    assert_eq!(seen["non_stream"]["completion_tokens"], 7);
    assert_eq!(seen["unknown_model"], "NotFoundError");
    sim.shutdown().await;
}
