//! Logs never contain prompts, outputs, keys or tokens: a whole request path runs with every
//! log level captured, and the capture is searched for what the requests carried. Each request
//! leaves one access line naming its route, status, duration, request id and principal.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{fleet, http};

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_hold_no_prompt_output_key_or_token() {
    let capture = Capture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        // What `RUST_LOG=trace switchyard …` would log.
        .with_env_filter(switchyard::telemetry::filter("trace"))
        .with_writer(move || writer.clone())
        .json()
        .init();
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let prompt = "CANARY-PROMPT-7f3a9c the secret plan";
    let url = format!("{}/chat/completions", fleet.openai_base_url());
    let mut outputs = Vec::new();
    for stream in [false, true] {
        let body = json!({"model": "small", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "stream": stream});
        let resp = http()
            .post(&url)
            .bearer_auth(&fleet.api_key)
            .json(&body)
            .send()
            .await
            .unwrap();
        let text = resp.text().await.unwrap();
        if stream {
            outputs.extend(crate::common::sse_data(&text).iter().filter_map(|d| {
                serde_json::from_str::<Value>(d).ok()?["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            }));
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            outputs.push(
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
    }
    // A refused request and an admin call, whose bodies and headers hold secrets too.
    http()
        .post(&url)
        .bearer_auth("sk-sy-CANARY-wrong-key")
        .json(&json!({"model": "small", "messages": [{"role": "user", "content": prompt}]}))
        .send()
        .await
        .unwrap();
    http()
        .get(format!("{}/admin/teams", fleet.server.base_url()))
        .bearer_auth(&fleet.admin_token)
        .send()
        .await
        .unwrap();
    let (api_key, admin_token) = (fleet.api_key.clone(), fleet.admin_token.clone());
    let fleet_key_id = fleet.store.api_keys(fleet.team_id).await.unwrap()[0].id;
    fleet.shutdown(Duration::from_secs(1)).await;

    let logs = String::from_utf8_lossy(&capture.0.lock().unwrap()).into_owned();
    assert!(logs.len() > 1000, "something was logged");
    for secret in [
        prompt,
        "CANARY-PROMPT",
        &api_key,
        &admin_token,
        "sk-sy-CANARY",
        "nt-",
    ] {
        let line = logs.lines().find(|l| l.contains(secret));
        assert!(line.is_none(), "logs contain {secret:?}: {line:?}");
    }
    // One access line per request, with what an operator needs and nothing more.
    let access: Vec<Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["target"] == switchyard::http::access_log::TARGET)
        .map(|l| l["fields"].clone())
        .collect();
    let key_principal = format!("key:{}", fleet_key_id);
    let chats: Vec<&Value> = access
        .iter()
        .filter(|f| f["route"] == "/v1/chat/completions" && f["status"] == 200)
        .collect();
    assert_eq!(chats.len(), 2, "one line per chat request: {access:?}");
    for f in &chats {
        assert_eq!(f["method"], "POST");
        assert_eq!(f["principal"], key_principal.as_str());
        assert_eq!(f["outcome"], "complete");
        assert!(
            f["duration_ms"].is_u64() && f["bytes"].as_u64().unwrap() > 0,
            "{f}"
        );
        assert!(f["request_id"].as_str().unwrap().starts_with("req_"), "{f}");
    }
    assert!(
        access.iter().any(|f| f["route"] == "/v1/chat/completions"
            && f["status"] == 401
            && f["principal"] == "-"),
        "the refused request: {access:?}"
    );
    assert!(
        access.iter().any(|f| f["route"] == "/admin/teams"
            && f["status"] == 200
            && f["principal"] == "admin"),
        "the admin call: {access:?}"
    );
    for f in &access {
        let keys: Vec<&str> = f.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "message",
                "method",
                "route",
                "status",
                "duration_ms",
                "request_id",
                "principal",
                "bytes",
                "outcome"
            ],
            "only these fields"
        );
    }
    for out in outputs.iter().filter(|o| o.chars().count() >= 12) {
        assert!(
            !logs.contains(out.as_str()),
            "logs contain generated text {out:?}"
        );
    }
}
