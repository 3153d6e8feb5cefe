//! The load figures a heartbeat reports, read from the engine's Prometheus `/metrics` page:
//! vLLM exports one sample per engine and model (`{engine="0",model_name="x"}`), so samples of
//! a name are summed across label sets (the KV fraction is averaged instead), and so are the
//! engine's cumulative token counters that the drift report compares with the ledger.

use switchyard_actors::protocol::EngineCounters;

/// Waiting requests (the queue).
const WAITING: &str = "vllm:num_requests_waiting";
/// Requests in the running batch.
const RUNNING: &str = "vllm:num_requests_running";
/// KV-cache use, a fraction 0–1.
const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
/// The name vLLM used for the same gauge before `kv_cache_usage_perc` (deprecated).
const KV_USAGE_OLD: &str = "vllm:gpu_cache_usage_perc";
/// Prefill tokens processed since the engine started (a counter).
const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
/// Tokens generated since the engine started (a counter).
const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";

/// What one scrape says about the engine's load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Load {
    /// `vllm:num_requests_waiting`, summed.
    pub waiting: u64,
    /// `vllm:num_requests_running`, summed.
    pub running: u64,
    /// `vllm:kv_cache_usage_perc`, averaged across engines, clamped to 0–1.
    pub kv_cache_usage: f64,
    /// `vllm:prompt_tokens_total` and `vllm:generation_tokens_total`, summed; `None` unless
    /// the page has both.
    pub counters: Option<EngineCounters>,
}

/// Reads the load from a Prometheus text page; `None` when it is not a vLLM page (no
/// `vllm:num_requests_running` sample), so a wrong `--engine` is not reported as an idle node.
pub(crate) fn parse_load(page: &str) -> Option<Load> {
    let mut waiting = 0.0;
    let mut running = 0.0;
    let mut saw_running = false;
    let (mut kv_sum, mut kv_n) = (0.0, 0u32);
    let (mut kv_old_sum, mut kv_old_n) = (0.0, 0u32);
    let (mut prompt, mut generation) = (None::<f64>, None::<f64>);
    for (name, value) in page.lines().filter_map(sample) {
        match name {
            WAITING => waiting += value,
            RUNNING => {
                running += value;
                saw_running = true;
            }
            KV_USAGE => {
                kv_sum += value;
                kv_n += 1;
            }
            KV_USAGE_OLD => {
                kv_old_sum += value;
                kv_old_n += 1;
            }
            PROMPT_TOKENS => *prompt.get_or_insert(0.0) += value,
            GENERATION_TOKENS => *generation.get_or_insert(0.0) += value,
            _ => {}
        }
    }
    if !saw_running {
        return None;
    }
    let kv = match (kv_n, kv_old_n) {
        (0, 0) => 0.0,
        (0, n) => kv_old_sum / f64::from(n),
        (n, _) => kv_sum / f64::from(n),
    };
    Some(Load {
        waiting: count(waiting),
        running: count(running),
        kv_cache_usage: kv.clamp(0.0, 1.0),
        counters: prompt.zip(generation).map(|(p, g)| EngineCounters {
            prompt_tokens: count(p),
            generation_tokens: count(g),
        }),
    })
}

/// A gauge or counter as an integer (float-to-int `as` saturates; NaN becomes 0).
fn count(v: f64) -> u64 {
    v.max(0.0).round() as u64
}

/// One sample line: `name{labels} value [timestamp]`; comments, blanks and malformed or
/// non-finite samples give `None`.
fn sample(line: &str) -> Option<(&str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        rest = &rest[labels_end(rest)? + 1..];
    }
    let value: f64 = rest.split_ascii_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, value))
}

/// Byte index of the `}` closing the label set that `s` starts with; quoted values may hold
/// `}` and escaped quotes.
fn labels_end(s: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match (in_quotes, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_quotes = false,
            (false, _, '"') => in_quotes = true,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// Lines as the real vLLM 0.32 prints them (../shared/fixtures/vllm/metrics_busy.txt).
    const BUSY: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.002441704309608106
vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0
"#;

    #[test]
    fn reads_the_real_vllm_page() {
        let load = parse_load(BUSY).unwrap();
        assert_eq!(load.running, 4);
        assert_eq!(load.waiting, 0);
        assert!((load.kv_cache_usage - 0.002441704309608106).abs() < 1e-12);
    }

    #[test]
    fn sums_label_sets_and_tolerates_odd_lines() {
        let page = r#"
vllm:num_requests_waiting{engine="0",model_name="x"} 3.0
vllm:num_requests_waiting{engine="1",model_name="a}b \"q\""} 2 1712345678000
vllm:num_requests_running 1.0
vllm:num_requests_running{engine="1"} NaN
vllm:num_requests_running{broken 7
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:kv_cache_usage_perc{engine="1"} 1.5
garbage
"#;
        let load = parse_load(page).unwrap();
        assert_eq!(load.waiting, 5);
        assert_eq!(load.running, 1);
        assert!(
            (load.kv_cache_usage - 1.0).abs() < 1e-12,
            "averaged then clamped"
        );
    }

    #[test]
    fn token_counters_are_summed_over_label_sets_and_need_both() {
        // As vLLM prints them: a `_total` sample per engine, beside a `_created` one.
        let page = r#"
vllm:num_requests_running{engine="0"} 0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 3
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7e9
vllm:generation_tokens_total{engine="0",model_name="tiny"} 4.0e1
vllm:generation_tokens_total{engine="1",model_name="tiny"} NaN
"#;
        assert_eq!(
            parse_load(page).unwrap().counters,
            Some(EngineCounters {
                prompt_tokens: 123,
                generation_tokens: 40
            })
        );
        let only_prompt = "vllm:num_requests_running 0\nvllm:prompt_tokens_total 5\n";
        assert_eq!(parse_load(only_prompt).unwrap().counters, None);
        assert_eq!(parse_load(BUSY).unwrap().counters, None);
    }

    #[test]
    fn the_deprecated_kv_name_is_a_fallback() {
        let page = "vllm:num_requests_running 0\nvllm:gpu_cache_usage_perc 0.25\n";
        assert_eq!(parse_load(page).unwrap().kv_cache_usage, 0.25);
    }

    #[test]
    fn a_page_without_vllm_gauges_is_not_a_load() {
        assert_eq!(parse_load("up 1\n# nothing\n"), None);
        assert_eq!(parse_load(""), None);
    }
}
