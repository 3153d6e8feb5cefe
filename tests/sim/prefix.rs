//! The prefix cache against real vLLM 0.32 (tests/fixtures/vllm/README.md, "Prefix caching"):
//! each captured scenario replayed in order through a simulator with the same block size and
//! cache size reports the same `cached_tokens` at every step, and its counters the same
//! totals, misses, hits, partial hits and LRU evictions included.

use std::path::Path;

use serde_json::Value;
use switchyard::sim::{SimConfig, SimServer};

use crate::common::{fixture, fixture_json, http, metrics_page, sse_data};

/// The counters a step's capture is compared on.
const COUNTERS: [&str; 4] = [
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_total",
];

/// The captured steps of `scenario` that have a request, in order.
fn steps(scenario: &str) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm");
    let prefix = format!("prefix_{scenario}_");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let step = n.strip_prefix(&prefix)?.strip_suffix(".request.json")?;
            step.as_bytes()[0].is_ascii_digit().then(|| step.to_owned())
        })
        .collect();
    names.sort();
    names
}

/// A counter's value on a metrics page.
fn counter(page: &str, name: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name}"))
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON or SSE body.
fn cached_tokens(body: &str) -> Value {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        return v["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    }
    sse_data(body)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| {
            let c = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
            (!c.is_null()).then(|| c.clone())
        })
        .unwrap_or(Value::Null)
}

/// Replays `scenario`'s steps before step `until` (one that cannot be replayed in order).
async fn replay(scenario: &str, block_size: u32, num_blocks: Option<u64>, until: &str) {
    let sim = SimServer::start(SimConfig {
        model: "tiny".into(),
        time_scale: 50.0,
        max_model_len: Some(1024),
        enable_prompt_tokens_details: true,
        block_size,
        num_gpu_blocks_override: num_blocks,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let client = http();
    let base = sim.base_url();
    let steps: Vec<String> = steps(scenario)
        .into_iter()
        .take_while(|s| s.as_str() < until)
        .collect();
    assert!(steps.len() >= 4, "{scenario}: {steps:?}");
    // The capture's server may have served other scenarios first: its counters move from here.
    let before = fixture(&format!("prefix_{scenario}_00_before.metrics.txt"));
    for step in &steps {
        let name = format!("prefix_{scenario}_{step}");
        let request = fixture_json(&format!("{name}.request.json"));
        let route = if request.get("messages").is_some() {
            "chat/completions"
        } else {
            "completions"
        };
        let body = client
            .post(format!("{base}/v1/{route}"))
            .json(&request)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let captured = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/vllm")
            .join(format!("{name}.sse"));
        let expected = if captured.exists() {
            fixture(&format!("{name}.sse"))
        } else {
            fixture(&format!("{name}.json"))
        };
        assert_eq!(
            cached_tokens(&body),
            cached_tokens(&expected),
            "{name}: cached_tokens"
        );
        let page = metrics_page(&client, &base).await;
        let real = fixture(&format!("{name}.metrics.txt"));
        for c in COUNTERS {
            let moved = counter(&real, c) - counter(&before, c);
            assert_eq!(counter(&page, c), moved, "{name}: {c}");
        }
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn misses_hits_and_partial_hits_in_blocks_of_128() {
    replay("basic", 128, None, "~").await;
}

#[tokio::test]
async fn misses_hits_and_partial_hits_in_blocks_of_32() {
    replay("b32_basic", 32, None, "~").await;
}

#[tokio::test]
async fn a_full_cache_of_twelve_blocks_evicts_the_least_recently_used() {
    // Step 14 ran two requests at once to sample the cache's use: not replayed.
    replay("evict", 128, Some(12), "14").await;
}

#[tokio::test]
async fn a_prompt_loses_its_tail_blocks_before_its_head() {
    replay("evict_tail", 128, Some(12), "~").await;
}

#[tokio::test]
async fn the_counters_and_their_help_are_vllms() {
    let sim = SimServer::start(SimConfig {
        model: "tiny".into(),
        max_model_len: Some(1024),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let page = metrics_page(&http(), &sim.base_url()).await;
    let real = fixture("prefix_basic_00_before.metrics.txt");
    let families = [
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens_cached",
        "vllm:prompt_tokens_by_source",
    ];
    for family in families {
        let total = format!("{family}_total");
        let meta = |p: &str| -> Vec<String> {
            p.lines()
                .filter(|l| l.starts_with("# ") && l.split(' ').nth(2) == Some(total.as_str()))
                .map(str::to_owned)
                .collect()
        };
        assert!(!meta(&real).is_empty(), "{family} captured");
        assert_eq!(meta(&page), meta(&real), "{family}");
    }
    sim.shutdown().await;
}

#[tokio::test]
async fn a_conversation_reads_its_earlier_turns_from_the_cache() {
    replay("b32_multiturn", 32, None, "~").await;
}
