//! The `run` scenario: calibrate prompt size per model, then N closed-loop
//! workers that each send one streaming request at a time until the duration
//! or request count is used up; live progress on stderr; records to a Report.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::{Limit, RunConfig, assign_workers};
use crate::prompt::{Calibration, PROBE_WORDS, build_prompt};
use crate::report::{ConfigSummary, ModelAssignment, Report, RequestRecord};
use crate::request::{Observed, Target, probe_prompt_tokens, stream_one};

/// State every worker reads; counters feed the progress bar.
#[derive(Debug)]
struct Shared {
    target: Target,
    max_tokens: u32,
    timeout: Duration,
    start: Instant,
    deadline: Option<Instant>,
    max_requests: Option<u64>,
    started: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
    content_chunks: AtomicU64,
}

/// Runs the scenario described by `cfg` against `cfg.url` and returns the
/// report. Fails only before the load starts (bad config, client setup, a
/// failed calibration probe); every per-request failure is an outcome.
pub async fn run(cfg: RunConfig) -> anyhow::Result<Report> {
    let calibration = calibrate_models(&cfg).await?;
    run_calibrated(cfg, calibration).await
}

/// Sizes the prompt of every model that gets workers (the two probes each,
/// or `tokens_per_word` when given). `compare` calls it once per side so the
/// probes stay out of its measured phases.
pub async fn calibrate_models(cfg: &RunConfig) -> anyhow::Result<Vec<Calibration>> {
    cfg.validate()?;
    let target = make_target(cfg)?;
    let workers = assign_workers(&cfg.models, cfg.streams);
    let mut calibration = Vec::new();
    for (m, &n) in cfg.models.iter().zip(&workers) {
        if n > 0 {
            calibration.push(calibrate(&target, cfg, &m.name).await?);
        }
    }
    Ok(calibration)
}

fn make_target(cfg: &RunConfig) -> anyhow::Result<Target> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(cfg.streams + 8)
        .build()
        .context("building the HTTP client")?;
    let endpoints = cfg.endpoints();
    if endpoints.is_empty() {
        anyhow::bail!("--url names no endpoint");
    }
    Ok(Target {
        client,
        endpoints,
        turn: Arc::default(),
        auth: cfg.api_key.as_ref().map(|k| format!("Bearer {k}")),
        idempotency_keys: cfg.idempotency_keys,
    })
}

/// [`run`] with the prompt sizing already done by [`calibrate_models`].
pub async fn run_calibrated(
    cfg: RunConfig,
    calibration: Vec<Calibration>,
) -> anyhow::Result<Report> {
    cfg.validate()?;
    let target = make_target(&cfg)?;
    let workers = assign_workers(&cfg.models, cfg.streams);

    let start = Instant::now();
    let (deadline, max_requests) = match cfg.limit {
        Limit::Duration(d) => (Some(start + d), None),
        Limit::Requests(n) => (None, Some(n)),
    };
    let shared = Arc::new(Shared {
        target,
        max_tokens: cfg.max_tokens,
        timeout: cfg.timeout,
        start,
        deadline,
        max_requests,
        started: AtomicU64::new(0),
        done: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        content_chunks: AtomicU64::new(0),
    });
    let progress = (cfg.progress && std::io::stderr().is_terminal())
        .then(|| spawn_progress(Arc::clone(&shared), cfg.limit, cfg.time_scale));

    let mut handles = Vec::with_capacity(cfg.streams);
    let step = cfg
        .ramp
        .checked_div(u32::try_from(cfg.streams).unwrap_or(u32::MAX).max(1));
    let mut start = Duration::ZERO;
    for cal in &calibration {
        let n = cfg
            .models
            .iter()
            .zip(&workers)
            .find(|(m, _)| m.name == cal.model)
            .map_or(0, |(_, &n)| n);
        let model: Arc<str> = Arc::from(cal.model.as_str());
        for _ in 0..n {
            let shared = Arc::clone(&shared);
            let model = Arc::clone(&model);
            let words = cal.prompt_words;
            let after = start;
            start += step.unwrap_or_default();
            handles.push(tokio::spawn(async move {
                tokio::time::sleep(after).await;
                worker(&shared, &model, words).await
            }));
        }
    }
    let mut records = Vec::new();
    let mut join_error = None;
    for h in handles {
        match h.await {
            Ok(rs) => records.extend(rs),
            Err(e) => join_error = Some(e),
        }
    }
    if let Some((bar, ticker)) = progress {
        ticker.abort();
        bar.finish_and_clear();
    }
    if let Some(e) = join_error {
        return Err(e).context("a load worker failed");
    }

    let summary = ConfigSummary {
        url: cfg.url.clone(),
        endpoint: cfg.endpoint(),
        streams: cfg.streams,
        duration_s: match cfg.limit {
            Limit::Duration(d) => Some(d.as_secs_f64()),
            Limit::Requests(_) => None,
        },
        requests: max_requests,
        prompt_tokens: cfg.prompt_tokens,
        max_tokens: cfg.max_tokens,
        models: cfg
            .models
            .iter()
            .zip(&workers)
            .map(|(m, &n)| ModelAssignment {
                name: m.name.clone(),
                weight: m.weight,
                workers: n,
            })
            .collect(),
        time_scale: cfg.time_scale,
        timeout_s: cfg.timeout.as_secs_f64(),
        tokens_per_word: cfg.tokens_per_word,
    };
    Ok(Report::build(summary, calibration, records))
}

/// Two non-streaming probes of different lengths; their `prompt_tokens` give
/// the endpoint's tokens per word and its fixed template overhead.
async fn calibrate(target: &Target, cfg: &RunConfig, model: &str) -> anyhow::Result<Calibration> {
    if let Some(tpw) = cfg.tokens_per_word {
        return Ok(Calibration::assumed(model, cfg.prompt_tokens, tpw, 0.0));
    }
    let mut prompt = String::new();
    let mut probe = async |words: usize| -> anyhow::Result<(usize, u64)> {
        build_prompt(words, 0, &mut prompt);
        let tokens = probe_prompt_tokens(target, model, &prompt, cfg.timeout)
            .await
            .with_context(|| {
                format!(
                    "prompt calibration probe ({words} words, max_tokens 1) for model {model:?} \
                     at {} failed; pass --tokens-per-word to skip calibration",
                    target.endpoints.join(",")
                )
            })?;
        Ok((words, tokens))
    };
    let a = probe(PROBE_WORDS.0).await?;
    let b = probe(PROBE_WORDS.1).await?;
    Calibration::fit(model, cfg.prompt_tokens, a, b)
}

/// One closed-loop worker: a request, its end, the next, until the limit.
async fn worker(shared: &Shared, model: &str, words: usize) -> Vec<RequestRecord> {
    let mut prompt = String::new();
    let mut records = Vec::new();
    loop {
        if shared.deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let index = shared.started.fetch_add(1, Ordering::Relaxed);
        if shared.max_requests.is_some_and(|max| index >= max) {
            break;
        }
        build_prompt(words, index, &mut prompt);
        let record = one_request(shared, model, &prompt, index).await;
        if !record.completed {
            shared.errors.fetch_add(1, Ordering::Relaxed);
        }
        shared.done.fetch_add(1, Ordering::Relaxed);
        records.push(record);
    }
    records
}

async fn one_request(shared: &Shared, model: &str, prompt: &str, index: u64) -> RequestRecord {
    let mut obs = Observed::default();
    let on_content = || {
        shared.content_chunks.fetch_add(1, Ordering::Relaxed);
    };
    let t_send = Instant::now();
    let work = stream_one(
        &shared.target,
        model,
        prompt,
        shared.max_tokens,
        &mut obs,
        &on_content,
    );
    let outcome = tokio::time::timeout(shared.timeout, work).await;
    let t_end = obs.done_at.unwrap_or_else(Instant::now);
    let completed = obs.done_at.is_some();
    let outcome = match outcome {
        Ok(o) => o,
        // The deadline can only catch a finished stream while it drains the
        // connection; the request itself still completed.
        Err(_) if completed => format!("{} ok", obs.status),
        Err(_) => "timeout".to_string(),
    };
    let since_send = |t: Instant| micros(t.saturating_duration_since(t_send));
    RequestRecord {
        index,
        model: model.to_string(),
        outcome,
        completed,
        send_us: micros(t_send.saturating_duration_since(shared.start)),
        end_us: micros(t_end.saturating_duration_since(shared.start)),
        ttft_us: obs.first_content.map(since_send),
        last_content_us: obs.last_content.map(since_send),
        content_chunks: obs.content_chunks,
        prompt_tokens: obs.prompt_tokens,
        completion_tokens: obs.completion_tokens,
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Redraws the bar twice a second from the shared counters; aborted at the end.
fn spawn_progress(
    shared: Arc<Shared>,
    limit: Limit,
    time_scale: f64,
) -> (ProgressBar, tokio::task::JoinHandle<()>) {
    let (len, template) = match limit {
        Limit::Requests(n) => (
            n,
            "{elapsed_precise} [{bar:30}] {pos}/{len} requests  {msg}",
        ),
        Limit::Duration(d) => (
            micros(d) / 1000,
            "{elapsed_precise} [{bar:30}] of {len}ms  {msg}",
        ),
    };
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    let unit = if time_scale == 1.0 {
        "tok/s"
    } else {
        "tok/s (engine time)"
    };
    let b = bar.clone();
    let ticker = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut last = (Instant::now(), 0u64);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let chunks = shared.content_chunks.load(Ordering::Relaxed);
            let dt = now.duration_since(last.0).as_secs_f64();
            let rate = if dt > 0.0 {
                (chunks - last.1) as f64 / dt / time_scale
            } else {
                0.0
            };
            last = (now, chunks);
            let done = shared.done.load(Ordering::Relaxed);
            let errors = shared.errors.load(Ordering::Relaxed);
            match limit {
                Limit::Requests(_) => b.set_position(done),
                Limit::Duration(_) => {
                    b.set_position(micros(now.saturating_duration_since(shared.start)) / 1000)
                }
            }
            b.set_message(format!("done {done}  errors {errors}  {rate:.0} {unit}"));
        }
    });
    (bar, ticker)
}
