//! What a `run` is asked to do: the run configuration, `--mix` parsing with
//! largest-remainder worker assignment, and the duration syntax the CLI accepts.
//! Pure data and parsing, so it can be unit-tested without a server.

use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;

/// When a run stops sending new requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    /// Workers start no new request once this much time has passed since the
    /// first send; requests already in flight are allowed to finish.
    Duration(Duration),
    /// Exactly this many requests are started in total, across all workers.
    Requests(u64),
}

/// One model of the run and its share of the workers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelWeight {
    /// The `model` field sent in each request.
    pub name: String,
    /// Relative weight; workers are split in proportion to it.
    pub weight: u32,
}

/// Everything [`crate::run`] needs. Build it from the CLI or directly in tests.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// OpenAI base URL as in `OPENAI_BASE_URL`, e.g. `http://127.0.0.1:8000/v1`; several,
    /// comma-separated, take requests in turn (replicas without a load balancer).
    pub url: String,
    /// Sent as `Authorization: Bearer KEY` when present.
    pub api_key: Option<String>,
    /// Number of concurrent closed-loop workers.
    pub streams: usize,
    /// When to stop starting requests.
    pub limit: Limit,
    /// Target prompt size in the endpoint's own tokens.
    pub prompt_tokens: u32,
    /// `max_tokens` of every request.
    pub max_tokens: u32,
    /// Models and weights; a single entry for `--model`.
    pub models: Vec<ModelWeight>,
    /// The target ran this many times faster than real time (the simulator's
    /// `--time-scale`); figures are converted back by it. 1 for real engines.
    pub time_scale: f64,
    /// Deadline of one request, from send to end of stream.
    pub timeout: Duration,
    /// Skip the calibration probes and assume this many prompt tokens per word
    /// (no template overhead). `None` calibrates against the endpoint.
    pub tokens_per_word: Option<f64>,
    /// Draw a progress bar on stderr (only if stderr is a terminal).
    pub progress: bool,
    /// Send a fresh `Idempotency-Key` with every request, so each goes through Switchyard's
    /// generation lifecycle (record, message quota, fencing) — to measure what it costs.
    pub idempotency_keys: bool,
    /// Workers start evenly over this long instead of all at once (clients arrive; they do
    /// not all press enter in the same millisecond).
    pub ramp: Duration,
}

impl RunConfig {
    /// A config with the CLI defaults for one model; tests adjust fields.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            api_key: None,
            streams: 1,
            limit: Limit::Duration(Duration::from_secs(60)),
            prompt_tokens: 100,
            max_tokens: 100,
            models: vec![ModelWeight {
                name: model.into(),
                weight: 1,
            }],
            time_scale: 1.0,
            timeout: Duration::from_secs(300),
            tokens_per_word: None,
            progress: false,
            idempotency_keys: false,
            ramp: Duration::ZERO,
        }
    }

    /// `{url}/chat/completions`, tolerating a trailing slash on the base URL (for several
    /// URLs, they joined with commas).
    pub fn endpoint(&self) -> String {
        self.endpoints().join(",")
    }

    /// `{url}/chat/completions` of each comma-separated base URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(|u| format!("{}/chat/completions", u.trim_end_matches('/')))
            .collect()
    }

    /// Rejects configurations that cannot produce a meaningful run.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.streams == 0 {
            bail!("--streams must be at least 1");
        }
        if self.models.is_empty() {
            bail!("one of --model or --mix is required");
        }
        if self.models.iter().all(|m| m.weight == 0) {
            bail!("--mix weights must not all be zero");
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            bail!("--time-scale must be a positive number");
        }
        if self.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        if let Limit::Requests(0) = self.limit {
            bail!("--requests must be at least 1");
        }
        if let Some(t) = self.tokens_per_word
            && !(t.is_finite() && t > 0.0)
        {
            bail!("--tokens-per-word must be a positive number");
        }
        if self.timeout.is_zero() {
            bail!("--timeout must be positive");
        }
        Ok(())
    }
}

/// Parses `small=140,medium=50,large=10` into models and weights.
pub fn parse_mix(s: &str) -> anyhow::Result<Vec<ModelWeight>> {
    let mut out: Vec<ModelWeight> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, weight) = part
            .rsplit_once('=')
            .with_context(|| format!("mix entry {part:?} is not NAME=WEIGHT"))?;
        let name = name.trim();
        if name.is_empty() {
            bail!("mix entry {part:?} has an empty model name");
        }
        let weight: u32 = weight
            .trim()
            .parse()
            .with_context(|| format!("mix entry {part:?}: weight must be a whole number"))?;
        if out.iter().any(|m| m.name == name) {
            bail!("model {name:?} appears twice in the mix");
        }
        out.push(ModelWeight {
            name: name.to_string(),
            weight,
        });
    }
    if out.is_empty() {
        bail!("empty --mix");
    }
    if out.iter().all(|m| m.weight == 0) {
        bail!("--mix weights must not all be zero");
    }
    Ok(out)
}

/// Splits `workers` among the models in proportion to their weights by the
/// largest-remainder method, so the counts always add up to `workers` and
/// match the weights exactly when they divide evenly (200 over 140/50/10 gives
/// 140/50/10). Ties on the remainder go to the model listed first.
pub fn assign_workers(models: &[ModelWeight], workers: usize) -> Vec<usize> {
    let total: u128 = models.iter().map(|m| u128::from(m.weight)).sum();
    if total == 0 {
        return vec![0; models.len()];
    }
    let n = workers as u128;
    let mut counts: Vec<usize> = Vec::with_capacity(models.len());
    let mut remainders: Vec<(u128, usize)> = Vec::with_capacity(models.len());
    for (i, m) in models.iter().enumerate() {
        let exact = n * u128::from(m.weight);
        // Bounded by `workers`, so it always fits back into usize.
        counts.push(usize::try_from(exact / total).unwrap_or(workers));
        remainders.push((exact % total, i));
    }
    let assigned: usize = counts.iter().sum();
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(workers.saturating_sub(assigned)) {
        counts[i] += 1;
    }
    counts
}

/// Parses `90s`, `2m`, `500ms`, `1h`, `1.5s` or plain seconds (`60`).
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .with_context(|| format!("invalid duration {s:?} (try 90s, 2m, 500ms)"))?;
    let secs = match unit.trim() {
        "" | "s" | "sec" | "secs" => value,
        "ms" => value / 1000.0,
        "m" | "min" | "mins" => value * 60.0,
        "h" => value * 3600.0,
        other => bail!("invalid duration unit {other:?} in {s:?} (use ms, s, m or h)"),
    };
    Duration::try_from_secs_f64(secs).with_context(|| format!("invalid duration {s:?}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn mix_parses_and_assigns_exactly() {
        let mix = parse_mix("small=140,medium=50,large=10").unwrap();
        assert_eq!(mix.len(), 3);
        assert_eq!(mix[1].name, "medium");
        assert_eq!(mix[1].weight, 50);
        assert_eq!(assign_workers(&mix, 200), vec![140, 50, 10]);
        assert_eq!(assign_workers(&mix, 20), vec![14, 5, 1]);
    }

    #[test]
    fn largest_remainder_sums_to_workers() {
        let mix = parse_mix("a=1, b=1, c=1").unwrap();
        assert_eq!(assign_workers(&mix, 10), vec![4, 3, 3]);
        assert_eq!(assign_workers(&mix, 2), vec![1, 1, 0]);
        let mix = parse_mix("a=140,b=50,c=10").unwrap();
        // 7 * (0.7, 0.25, 0.05) = 4.9, 1.75, 0.35 -> 4,1,0 + remainders .9,.75 -> 5,2,0
        assert_eq!(assign_workers(&mix, 7), vec![5, 2, 0]);
        for n in 0..300 {
            assert_eq!(assign_workers(&mix, n).iter().sum::<usize>(), n);
        }
        let mix = parse_mix("a=0,b=3").unwrap();
        assert_eq!(assign_workers(&mix, 5), vec![0, 5]);
    }

    #[test]
    fn mix_rejects_garbage() {
        assert!(parse_mix("").is_err());
        assert!(parse_mix("small").is_err());
        assert!(parse_mix("small=x").is_err());
        assert!(parse_mix("=3").is_err());
        assert!(parse_mix("a=1,a=2").is_err());
        assert!(parse_mix("a=0,b=0").is_err());
        assert!(parse_mix("a=-1").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("60").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn endpoint_strips_trailing_slash() {
        let mut cfg = RunConfig::new("http://h:1/v1/", "m");
        assert_eq!(cfg.endpoint(), "http://h:1/v1/chat/completions");
        cfg.url = "http://h:1/v1".into();
        assert_eq!(cfg.endpoint(), "http://h:1/v1/chat/completions");
    }

    #[test]
    fn several_urls_are_several_endpoints() {
        let mut cfg = RunConfig::new("http://a:1/v1/, http://b:2/v1", "m");
        assert_eq!(
            cfg.endpoints(),
            [
                "http://a:1/v1/chat/completions",
                "http://b:2/v1/chat/completions"
            ]
        );
        cfg.url = "http://a:1/v1".into();
        assert_eq!(cfg.endpoints().len(), 1);
    }
}
