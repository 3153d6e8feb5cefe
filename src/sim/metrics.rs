//! The engine's counters and histograms, rendered as vLLM's `/metrics` (Prometheus text).
//!
//! Names, types, help texts, label sets and bucket bounds are vLLM 0.32's (from the captures);
//! labels are sorted by name as `prometheus_client` does (`engine`, `le`, `model_name`, …).

use std::fmt::Write as _;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_SECONDS_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const TOKEN_COUNT_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// Why a request finished, as vLLM's `finished_reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishedReason {
    Stop,
    Length,
    Abort,
    Error,
    Repetition,
}

impl FinishedReason {
    const ALL: [FinishedReason; 5] = [
        Self::Stop,
        Self::Length,
        Self::Abort,
        Self::Error,
        Self::Repetition,
    ];

    /// The label value, also the OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
            Self::Repetition => "repetition",
        }
    }
}

/// A Prometheus histogram with fixed bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }
}

/// Everything `/metrics` shows; the engine updates it once per step.
#[derive(Debug, Clone)]
pub struct EngineStats {
    pub running: u64,
    pub waiting_capacity: u64,
    pub waiting_deferred: u64,
    pub used_blocks: u64,
    pub num_blocks: u64,
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, at each admission.
    pub prefix_cache_queries: u64,
    /// Of which were found there.
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    /// Of which were read from the prefix cache, not computed.
    pub prompt_tokens_cached: u64,
    pub generation_tokens: u64,
    pub success: [u64; 5],
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    /// When the engine was running steps (the simulated GPUs' activity, [`super::gpu`]).
    pub busy: super::gpu::BusyMeter,
}

impl EngineStats {
    /// Zeroed statistics for a cache of `num_blocks` blocks.
    pub fn new(num_blocks: u64) -> Self {
        Self {
            running: 0,
            waiting_capacity: 0,
            waiting_deferred: 0,
            used_blocks: 0,
            num_blocks,
            preemptions: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prompt_tokens: 0,
            prompt_tokens_cached: 0,
            generation_tokens: 0,
            success: [0; 5],
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_SECONDS_BUCKETS),
            queue_time: Histogram::new(REQUEST_SECONDS_BUCKETS),
            request_prompt_tokens: Histogram::new(TOKEN_COUNT_BUCKETS),
            request_generation_tokens: Histogram::new(TOKEN_COUNT_BUCKETS),
            busy: super::gpu::BusyMeter::default(),
        }
    }

    /// Counts a request that finished normally.
    pub fn finished(&mut self, reason: FinishedReason) {
        if let Some(i) = FinishedReason::ALL.iter().position(|r| *r == reason) {
            self.success[i] += 1;
        }
    }

    /// `vllm:kv_cache_usage_perc`: a fraction 0–1.
    /// Blocks held by running requests over the blocks that can hold tokens (all but vLLM's
    /// null block).
    pub fn kv_usage(&self) -> f64 {
        if self.num_blocks <= 1 {
            0.0
        } else {
            self.used_blocks as f64 / (self.num_blocks - 1) as f64
        }
    }
}

/// Static facts rendered with the statistics.
#[derive(Debug, Clone)]
pub struct CacheInfo {
    pub model: String,
    pub block_size: u32,
    pub num_gpu_blocks: u64,
    pub gpu_memory_utilization: f64,
    pub max_model_len: u32,
    pub kv_cache_memory_bytes: u64,
    /// Unix time the engine started, for the `_created` samples.
    pub started_unix: f64,
}

/// Formats a sample value as Python's `prometheus_client` does (`4.0`, `1.79e+09`).
fn fmt_value(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let s = format!("{v:?}");
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 && !s.contains('e') => {
            let digits: String = s.chars().filter(|c| *c != '.').collect();
            let mantissa = format!("{}.{}", &digits[..1], digits[1..].trim_end_matches('0'));
            let mantissa = mantissa.trim_end_matches('.');
            format!("{mantissa}e+{:02}", dot - 1)
        }
        _ => s,
    }
}

struct Out<'a> {
    buf: String,
    model: &'a str,
}

impl Out<'_> {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.buf, "# HELP {name} {help}");
        let _ = writeln!(self.buf, "# TYPE {name} {kind}");
    }

    /// One sample; `extra` labels are given already sorted around `model_name`.
    fn sample(&mut self, name: &str, before: &[(&str, &str)], after: &[(&str, &str)], v: f64) {
        let mut labels = String::from("engine=\"0\"");
        for (k, val) in before {
            let _ = write!(labels, ",{k}=\"{val}\"");
        }
        let _ = write!(labels, ",model_name=\"{}\"", self.model);
        for (k, val) in after {
            let _ = write!(labels, ",{k}=\"{val}\"");
        }
        let _ = writeln!(self.buf, "{name}{{{labels}}} {}", fmt_value(v));
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.family(name, "gauge", help);
        self.sample(name, &[], &[], v);
    }

    /// The `_created` gauge `prometheus_client` writes after each counter and histogram.
    fn created(&mut self, name: &str, help: &str, before: &[(&str, &str)], created: f64) {
        let created_name = format!("{name}_created");
        self.family(&created_name, "gauge", help);
        self.sample(&created_name, before, &[], created);
    }

    fn counter(&mut self, name: &str, help: &str, v: f64, created: f64) {
        self.family(&format!("{name}_total"), "counter", help);
        self.sample(&format!("{name}_total"), &[], &[], v);
        self.created(name, help, &[], created);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram, created: f64) {
        self.family(name, "histogram", help);
        let mut cumulative = 0u64;
        for (bound, n) in h.bounds.iter().zip(&h.counts) {
            cumulative += n;
            let le = fmt_value(*bound);
            self.sample(
                &format!("{name}_bucket"),
                &[("le", &le)],
                &[],
                cumulative as f64,
            );
        }
        self.sample(
            &format!("{name}_bucket"),
            &[("le", "+Inf")],
            &[],
            h.count as f64,
        );
        self.sample(&format!("{name}_count"), &[], &[], h.count as f64);
        self.sample(&format!("{name}_sum"), &[], &[], h.sum);
        self.created(name, help, &[], created);
    }
}

/// Renders the whole `/metrics` page.
pub fn render(stats: &EngineStats, info: &CacheInfo) -> String {
    let mut o = Out {
        buf: String::with_capacity(16 * 1024),
        model: &info.model,
    };
    let t0 = info.started_unix;
    o.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        stats.running as f64,
    );
    o.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        (stats.waiting_capacity + stats.waiting_deferred) as f64,
    );
    o.family(
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    );
    o.sample(
        "vllm:num_requests_waiting_by_reason",
        &[],
        &[("reason", "capacity")],
        stats.waiting_capacity as f64,
    );
    o.sample(
        "vllm:num_requests_waiting_by_reason",
        &[],
        &[("reason", "deferred")],
        stats.waiting_deferred as f64,
    );
    o.family(
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    );
    for (state, v) in [
        ("awake", 1.0),
        ("weights_offloaded", 0.0),
        ("discard_all", 0.0),
    ] {
        o.sample("vllm:engine_sleep_state", &[], &[("sleep_state", state)], v);
    }
    o.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        stats.kv_usage(),
    );
    o.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries as f64,
        t0,
    );
    o.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits as f64,
        t0,
    );
    o.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        stats.preemptions as f64,
        t0,
    );
    o.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        stats.prompt_tokens as f64,
        t0,
    );
    let by_source = "Number of prompt tokens by source.";
    let computed = stats
        .prompt_tokens
        .saturating_sub(stats.prompt_tokens_cached);
    let sources = [
        ("local_compute", computed),
        ("local_cache_hit", stats.prompt_tokens_cached),
        ("external_kv_transfer", 0),
    ];
    o.family("vllm:prompt_tokens_by_source_total", "counter", by_source);
    for (source, n) in sources {
        o.sample(
            "vllm:prompt_tokens_by_source_total",
            &[],
            &[("source", source)],
            n as f64,
        );
    }
    o.family("vllm:prompt_tokens_by_source_created", "gauge", by_source);
    for (source, _) in sources {
        o.sample(
            "vllm:prompt_tokens_by_source_created",
            &[],
            &[("source", source)],
            t0,
        );
    }
    o.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        stats.prompt_tokens_cached as f64,
        t0,
    );
    o.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        stats.generation_tokens as f64,
        t0,
    );
    let success_help = "Count of successfully processed requests.";
    o.family("vllm:request_success_total", "counter", success_help);
    for (reason, n) in FinishedReason::ALL.iter().zip(stats.success) {
        o.sample(
            "vllm:request_success_total",
            &[("finished_reason", reason.as_str())],
            &[],
            n as f64,
        );
    }
    o.family("vllm:request_success_created", "gauge", success_help);
    for reason in FinishedReason::ALL {
        o.sample(
            "vllm:request_success_created",
            &[("finished_reason", reason.as_str())],
            &[],
            t0,
        );
    }
    o.histogram(
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        &stats.request_prompt_tokens,
        t0,
    );
    o.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        &stats.request_generation_tokens,
        t0,
    );
    o.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &stats.ttft,
        t0,
    );
    o.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &stats.itl,
        t0,
    );
    o.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &stats.e2e,
        t0,
    );
    o.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &stats.queue_time,
        t0,
    );
    o.family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
    );
    let kv_tokens = info.num_gpu_blocks * u64::from(info.block_size);
    let concurrency = kv_tokens as f64 / f64::from(info.max_model_len.max(1));
    let cache_labels = [
        ("block_size", info.block_size.to_string()),
        ("cache_dtype", "auto".to_string()),
        ("enable_prefix_caching", "False".to_string()),
        (
            "gpu_memory_utilization",
            info.gpu_memory_utilization.to_string(),
        ),
        ("kv_cache_max_concurrency", format!("{concurrency:.1}")),
        (
            "kv_cache_memory_bytes",
            info.kv_cache_memory_bytes.to_string(),
        ),
        ("kv_cache_size_tokens", kv_tokens.to_string()),
    ];
    // vLLM's info gauge carries `engine` but no `model_name`; labels sorted by name.
    let blocks = info.num_gpu_blocks.to_string();
    let mut all: Vec<(&str, &str)> = cache_labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    all.push(("engine", "0"));
    all.push(("num_gpu_blocks", &blocks));
    all.sort_by(|a, b| a.0.cmp(b.0));
    let rendered: Vec<String> = all.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let _ = writeln!(
        o.buf,
        "vllm:cache_config_info{{{}}} 1.0",
        rendered.join(",")
    );
    o.buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_print_like_prometheus_client() {
        assert_eq!(fmt_value(4.0), "4.0");
        assert_eq!(fmt_value(0.002441704309608106), "0.002441704309608106");
        assert_eq!(fmt_value(1795974273.3146176), "1.7959742733146176e+09");
        assert_eq!(fmt_value(f64::INFINITY), "+Inf");
        assert_eq!(fmt_value(0.001), "0.001");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(TTFT_BUCKETS);
        h.observe(0.003);
        h.observe(0.5);
        h.observe(1e9);
        let info = CacheInfo {
            model: "m".into(),
            block_size: 16,
            num_gpu_blocks: 10,
            gpu_memory_utilization: 0.9,
            max_model_len: 100,
            kv_cache_memory_bytes: 1,
            started_unix: 1.0,
        };
        let mut s = EngineStats::new(10);
        s.ttft = h;
        let page = render(&s, &info);
        assert!(page.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.005\",model_name=\"m\"} 1.0"));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"m\"} 2.0"
        ));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 3.0"
        ));
        assert!(
            page.contains(
                "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 3.0"
            )
        );
        assert!(page.contains(",kv_cache_size_tokens=\"160\",num_gpu_blocks=\"10\"} 1.0"));
    }
}
