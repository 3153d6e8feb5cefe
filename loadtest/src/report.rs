//! The statistics of a run: per-request records in, figures out (hdrhistogram
//! percentiles, rates, outcome counts), converted to engine time by the time
//! scale, printed as a plain-text table or serialized as JSON with formulas.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::prompt::Calibration;

mod print;

/// Formula of each figure, printed under the table and stored in the JSON.
pub const FORMULAS: [(&str, &str); 9] = [
    (
        "ttft_ms",
        "TTFT = t(first chunk with non-empty choices[0].delta.content) - t(request sent); over completed requests",
    ),
    (
        "itl_ms",
        "ITL = (t_last_content - t_first_content) / (content_chunks - 1) per stream (mean gap between consecutive content chunks); percentiles over completed streams with >= 2 content chunks",
    ),
    (
        "per_stream_tokens_per_s",
        "per-stream tok/s = (completion_tokens - 1) / (t_last_content - t_first_content) per completed stream with >= 2 content chunks; completion_tokens from the usage chunk, else the count of content chunks",
    ),
    (
        "total_tokens_per_s",
        "total tok/s = sum of completion_tokens over all requests, completed or not (usage chunk, else content chunks) / wall time from first send to last end",
    ),
    (
        "requests_per_s",
        "requests/s = requests ended with any outcome / wall time",
    ),
    (
        "completed_requests_per_s",
        "completed/s = requests with outcome \"200 ok\" / wall time",
    ),
    (
        "prompt_tokens_mean",
        "mean prompt tokens = mean usage.prompt_tokens over requests that reported usage",
    ),
    (
        "completion_tokens_mean",
        "mean completion tokens = mean completion_tokens over completed requests",
    ),
    (
        "time_scale",
        "engine time = wall-clock time x time_scale: latencies are multiplied and rates divided by time_scale; *_wall_clock keeps the raw values",
    ),
];

/// What happened to one request, as measured by the harness. Times are
/// wall-clock microseconds: `send_us`/`end_us` since the run started, the
/// content times since this request was sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Global request number (also selects the prompt's word order).
    pub index: u64,
    /// Model the request was sent to.
    pub model: String,
    /// Outcome key: `"200 ok"` (stream ended with `[DONE]`); `"<status> <error.code>"`
    /// for a non-2xx answer (`-` when the body has no code); `"stream_error <code>"`
    /// for an error event mid-stream; `interrupted` when the body ended or broke
    /// without `[DONE]`; `transport_error` when no response head arrived
    /// (connect/send failure); `timeout`; `protocol_error bad_json` or
    /// `protocol_error event_too_large` for an unparseable stream.
    pub outcome: String,
    /// True only for a stream that ended with `data: [DONE]`.
    pub completed: bool,
    /// Send time since the start of the run.
    pub send_us: u64,
    /// End time (last byte, error or timeout) since the start of the run.
    pub end_us: u64,
    /// First non-empty content delta, since send.
    pub ttft_us: Option<u64>,
    /// Last non-empty content delta, since send.
    pub last_content_us: Option<u64>,
    /// Chunks with a non-empty `choices[0].delta.content`.
    pub content_chunks: u64,
    /// `usage.prompt_tokens`, when the stream reported usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`, when the stream reported usage.
    pub completion_tokens: Option<u64>,
}

impl RequestRecord {
    /// Output tokens: from usage, else the content chunks seen (0 if none).
    pub fn output_tokens(&self) -> u64 {
        self.completion_tokens.unwrap_or(self.content_chunks)
    }

    /// Time from first to last content chunk, when there were at least two.
    fn content_span_us(&self) -> Option<u64> {
        match (self.ttft_us, self.last_content_us) {
            (Some(first), Some(last)) if self.content_chunks >= 2 => {
                Some(last.saturating_sub(first))
            }
            _ => None,
        }
    }
}

/// Distribution of one figure. All fields are 0 when `count` is 0.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Percentiles {
    /// Number of samples.
    pub count: u64,
    /// Exact mean.
    pub mean: f64,
    /// Exact minimum.
    pub min: f64,
    /// 5th percentile (hdrhistogram, 3 significant digits).
    pub p5: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Exact maximum.
    pub max: f64,
}

impl Percentiles {
    /// Summarizes integer samples; each is divided by `unit` for the result
    /// (samples are µs or milli-tokens/s so the histogram keeps precision).
    pub fn from_samples(samples: &[u64], unit: f64) -> Self {
        let Some(&first) = samples.first() else {
            return Self::default();
        };
        let mut hist = Histogram::<u64>::new(3).ok();
        let (mut min, mut max, mut sum) = (first, first, 0u128);
        for &v in samples {
            min = min.min(v);
            max = max.max(v);
            sum += u128::from(v);
            if let Some(h) = hist.as_mut() {
                // Auto-resizing histogram: recording only fails on allocation
                // limits, in which case percentiles fall back to min/max below.
                if h.record(v).is_err() {
                    hist = None;
                }
            }
        }
        let q = |quantile: f64| match &hist {
            Some(h) => h.value_at_quantile(quantile).clamp(min, max) as f64 / unit,
            None => max as f64 / unit,
        };
        Self {
            count: samples.len() as u64,
            mean: sum as f64 / samples.len() as f64 / unit,
            min: min as f64 / unit,
            p5: q(0.05),
            p50: q(0.50),
            p90: q(0.90),
            p95: q(0.95),
            p99: q(0.99),
            max: max as f64 / unit,
        }
    }

    fn scaled(&self, factor: f64) -> Self {
        Self {
            count: self.count,
            mean: self.mean * factor,
            min: self.min * factor,
            p5: self.p5 * factor,
            p50: self.p50 * factor,
            p90: self.p90 * factor,
            p95: self.p95 * factor,
            p99: self.p99 * factor,
            max: self.max * factor,
        }
    }
}

/// The figures of a set of requests (the whole run or one model).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    /// Requests that ended, with any outcome.
    pub requests: u64,
    /// Requests whose stream ended with `[DONE]`.
    pub completed: u64,
    /// Requests with any other outcome.
    pub failed: u64,
    /// Count of each outcome key.
    pub outcomes: BTreeMap<String, u64>,
    /// Run wall time (first send to last end), in this figure set's time base.
    pub wall_time_s: f64,
    /// See [`FORMULAS`].
    pub requests_per_s: f64,
    /// See [`FORMULAS`].
    pub completed_requests_per_s: f64,
    /// Time to first token, milliseconds.
    pub ttft_ms: Percentiles,
    /// Mean inter-token gap of each stream, milliseconds.
    pub itl_ms: Percentiles,
    /// Decode rate of each stream, tokens per second.
    pub per_stream_tokens_per_s: Percentiles,
    /// Output tokens per second over the whole run.
    pub total_tokens_per_s: f64,
    /// Sum of output tokens of all requests (not time-dependent).
    pub completion_tokens_sum: u64,
    /// Mean `usage.prompt_tokens`; `None` when no request reported usage.
    pub prompt_tokens_mean: Option<f64>,
    /// Mean completion tokens of completed requests.
    pub completion_tokens_mean: Option<f64>,
}

impl Figures {
    /// Raw wall-clock figures of `records` over a run of `wall_us`.
    pub fn compute<'a>(records: impl IntoIterator<Item = &'a RequestRecord>, wall_us: u64) -> Self {
        let mut f = Figures::default();
        let (mut ttft, mut itl, mut tps) = (Vec::new(), Vec::new(), Vec::new());
        let (mut prompt_sum, mut prompt_n, mut compl_sum) = (0u64, 0u64, 0u64);
        for r in records {
            f.requests += 1;
            *f.outcomes.entry(r.outcome.clone()).or_insert(0) += 1;
            f.completion_tokens_sum += r.output_tokens();
            if let Some(p) = r.prompt_tokens {
                prompt_sum += p;
                prompt_n += 1;
            }
            if !r.completed {
                continue;
            }
            f.completed += 1;
            compl_sum += r.output_tokens();
            if let Some(t) = r.ttft_us {
                ttft.push(t);
            }
            if let Some(span) = r.content_span_us() {
                itl.push(span / (r.content_chunks - 1));
                let tokens = r.output_tokens().saturating_sub(1);
                if span > 0 && tokens > 0 {
                    // milli-tokens per second keeps 3 decimals in the histogram.
                    tps.push((tokens as f64 * 1e9 / span as f64).round() as u64);
                }
            }
        }
        f.failed = f.requests - f.completed;
        let wall_s = wall_us as f64 / 1e6;
        f.wall_time_s = wall_s;
        let per_s = |n: f64| if wall_s > 0.0 { n / wall_s } else { 0.0 };
        f.requests_per_s = per_s(f.requests as f64);
        f.completed_requests_per_s = per_s(f.completed as f64);
        f.total_tokens_per_s = per_s(f.completion_tokens_sum as f64);
        f.ttft_ms = Percentiles::from_samples(&ttft, 1e3);
        f.itl_ms = Percentiles::from_samples(&itl, 1e3);
        f.per_stream_tokens_per_s = Percentiles::from_samples(&tps, 1e3);
        f.prompt_tokens_mean = (prompt_n > 0).then(|| prompt_sum as f64 / prompt_n as f64);
        f.completion_tokens_mean = (f.completed > 0).then(|| compl_sum as f64 / f.completed as f64);
        f
    }

    /// The same figures in engine time for a target that ran `time_scale`
    /// times faster than real: latencies × scale, rates ÷ scale.
    pub fn to_engine_time(&self, time_scale: f64) -> Self {
        let mut f = self.clone();
        f.wall_time_s *= time_scale;
        f.requests_per_s /= time_scale;
        f.completed_requests_per_s /= time_scale;
        f.total_tokens_per_s /= time_scale;
        f.ttft_ms = self.ttft_ms.scaled(time_scale);
        f.itl_ms = self.itl_ms.scaled(time_scale);
        f.per_stream_tokens_per_s = self.per_stream_tokens_per_s.scaled(1.0 / time_scale);
        f
    }
}

/// A model of the run with the workers it was given.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelAssignment {
    /// Model name.
    pub name: String,
    /// Weight from `--mix` (1 for `--model`).
    pub weight: u32,
    /// Workers assigned by largest remainder.
    pub workers: usize,
}

/// The run's configuration as recorded in the report (never the API key).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfigSummary {
    /// Base URL as given.
    pub url: String,
    /// The chat completions URL requests went to.
    pub endpoint: String,
    /// Concurrent workers.
    pub streams: usize,
    /// `--duration` in seconds, when the run was time-limited.
    pub duration_s: Option<f64>,
    /// `--requests`, when the run was count-limited.
    pub requests: Option<u64>,
    /// Target prompt tokens.
    pub prompt_tokens: u32,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// Models and their workers.
    pub models: Vec<ModelAssignment>,
    /// See [`Report::time_scale`].
    pub time_scale: f64,
    /// Per-request timeout in seconds.
    pub timeout_s: f64,
    /// Given tokens-per-word ratio when calibration was skipped.
    pub tokens_per_word: Option<f64>,
}

/// Everything a run produced. `overall`/`per_model` are in engine time
/// (converted by `time_scale`); the `*_wall_clock` twins are the raw values.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// What was run.
    pub config: ConfigSummary,
    /// The target ran this many times faster than real; 1 means no conversion.
    pub time_scale: f64,
    /// Formula of each figure, keyed by figure name.
    pub formulas: BTreeMap<String, String>,
    /// Prompt sizing per model.
    pub calibration: Vec<Calibration>,
    /// Count of each outcome key over the whole run.
    pub outcomes: BTreeMap<String, u64>,
    /// Figures of the whole run, engine time.
    pub overall: Figures,
    /// Figures per model (only when more than one model ran), engine time.
    pub per_model: BTreeMap<String, Figures>,
    /// `overall` in raw wall-clock time.
    pub overall_wall_clock: Figures,
    /// `per_model` in raw wall-clock time.
    pub per_model_wall_clock: BTreeMap<String, Figures>,
    /// Every request, raw wall-clock microseconds.
    pub requests: Vec<RequestRecord>,
}

impl Report {
    /// Computes all figures from the per-request records.
    pub fn build(
        config: ConfigSummary,
        calibration: Vec<Calibration>,
        mut requests: Vec<RequestRecord>,
    ) -> Self {
        requests.sort_by_key(|r| r.index);
        let start = requests.iter().map(|r| r.send_us).min().unwrap_or(0);
        let end = requests.iter().map(|r| r.end_us).max().unwrap_or(0);
        let wall_us = end.saturating_sub(start);
        let scale = config.time_scale;
        let overall_wall_clock = Figures::compute(&requests, wall_us);
        let mut per_model_wall_clock = BTreeMap::new();
        if config.models.iter().filter(|m| m.workers > 0).count() > 1 {
            for m in config.models.iter().filter(|m| m.workers > 0) {
                let rs = requests.iter().filter(|r| r.model == m.name);
                per_model_wall_clock.insert(m.name.clone(), Figures::compute(rs, wall_us));
            }
        }
        Self {
            time_scale: scale,
            formulas: FORMULAS
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
            calibration,
            outcomes: overall_wall_clock.outcomes.clone(),
            overall: overall_wall_clock.to_engine_time(scale),
            per_model: per_model_wall_clock
                .iter()
                .map(|(k, f)| (k.clone(), f.to_engine_time(scale)))
                .collect(),
            overall_wall_clock,
            per_model_wall_clock,
            requests,
            config,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn rec(model: &str, ok: bool, ttft: u64, last: u64, chunks: u64, tokens: u64) -> RequestRecord {
        RequestRecord {
            model: model.into(),
            outcome: if ok { "200 ok" } else { "interrupted" }.into(),
            completed: ok,
            send_us: 0,
            end_us: 2_000_000,
            ttft_us: Some(ttft),
            last_content_us: Some(last),
            content_chunks: chunks,
            prompt_tokens: ok.then_some(10),
            completion_tokens: ok.then_some(tokens),
            ..Default::default()
        }
    }

    #[test]
    fn figures_follow_the_formulas() {
        // 11 tokens over 1 s after the first one: 10 tok/s, ITL 100 ms.
        let rs = [
            rec("a", true, 50_000, 1_050_000, 11, 11),
            rec("a", false, 70_000, 170_000, 3, 0),
        ];
        let f = Figures::compute(&rs, 2_000_000);
        assert_eq!(f.requests, 2);
        assert_eq!(f.completed, 1);
        assert_eq!(f.ttft_ms.count, 1);
        assert!((f.ttft_ms.p50 - 50.0).abs() < 0.1);
        assert!((f.itl_ms.p50 - 100.0).abs() < 0.1);
        assert!((f.per_stream_tokens_per_s.p50 - 10.0).abs() < 0.01);
        // interrupted stream contributes its 3 content chunks.
        assert_eq!(f.completion_tokens_sum, 14);
        assert!((f.total_tokens_per_s - 7.0).abs() < 1e-9);
        assert_eq!(f.prompt_tokens_mean, Some(10.0));
        let e = f.to_engine_time(20.0);
        assert!((e.ttft_ms.p50 - 1000.0).abs() < 2.0);
        assert!((e.per_stream_tokens_per_s.p50 - 0.5).abs() < 1e-3);
        assert!((e.total_tokens_per_s - 0.35).abs() < 1e-9);
        assert_eq!(e.completion_tokens_sum, 14);
    }

    #[test]
    fn empty_run_prints() {
        let cfg = ConfigSummary {
            url: "u".into(),
            endpoint: "u/chat/completions".into(),
            streams: 1,
            duration_s: None,
            requests: Some(1),
            prompt_tokens: 1,
            max_tokens: 1,
            models: vec![],
            time_scale: 2.0,
            timeout_s: 1.0,
            tokens_per_word: None,
        };
        let r = Report::build(cfg, vec![], vec![]);
        let mut out = Vec::new();
        r.print(&mut out).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains("ENGINE TIME"));
        assert!(serde_json::to_string(&r).unwrap().contains("\"formulas\""));
    }
}
