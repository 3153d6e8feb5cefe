//! The real Python `openai` package against the demo fleet.

use std::time::Duration;

use switchyard::sim::FaultSpec;

use crate::common::{fleet, run_python};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_streams_from_every_model_and_sees_typed_errors() {
    let fleet = fleet(&[("small", 2), ("medium", 1), ("large", 1)], 20.0, |_| {}).await;
    let base = fleet.openai_base_url();
    let out = run_python("server_sdk.py", &[&base, &fleet.api_key, "normal"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["small"]["model"], "llama-3.1-8b-instruct");
    assert_eq!(seen["medium"]["model"], "qwen2.5-32b-instruct");
    assert_eq!(seen["large"]["model"], "llama-3.3-70b-instruct");
    assert_eq!(seen["bad_key"], "AuthenticationError");
    assert_eq!(seen["unknown_model"], "NotFoundError");

    for node in fleet
        .nodes
        .iter()
        .filter(|n| n.model == "llama-3.1-8b-instruct")
    {
        node.sim.set_faults(&FaultSpec {
            crash_after_tokens: Some(2),
            ..FaultSpec::default()
        });
    }
    let out = run_python("server_sdk.py", &[&base, &fleet.api_key, "crash"]).await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["mid_stream"]["error"], "APIError");
    fleet.shutdown(Duration::from_secs(1)).await;
}
