//! Peaks while a comparison runs: a task reads the resident memory of every watched process
//! (with its descendants, for a proxy that runs workers) every 250 ms, and a watched
//! `/metrics` series (streams a replica or an engine carries) every 500 ms, and keeps the
//! highest reading of each.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::compare::descendants;
use crate::drill::rss_bytes;

/// How often resident memory is read.
const RSS_EVERY: Duration = Duration::from_millis(250);
/// How often a metric is read (an HTTP request to the process measured).
const METRIC_EVERY: Duration = Duration::from_millis(500);

/// What to watch, under the key of its peak in the result.
#[derive(Debug, Clone)]
pub enum Watch {
    /// `VmRSS` of a process (bytes), under `rss_bytes.NAME`.
    Rss {
        /// `serve-0`, `agent`, `engine`, `litellm`.
        name: String,
        /// Its pid.
        pid: u32,
        /// Count its descendants too (read once, when watching starts).
        tree: bool,
    },
    /// A `/metrics` series, summed over its labels, under `streams.NAME`.
    Metric {
        /// `serve-0`, `engine`.
        name: String,
        /// Base URL of the process.
        url: String,
        /// The series, e.g. `switchyard_active_streams`.
        metric: String,
    },
}

impl Watch {
    /// The resident memory of one process on its own.
    pub fn rss(name: &str, pid: u32) -> Self {
        Self::Rss {
            name: name.to_owned(),
            pid,
            tree: false,
        }
    }
}

/// The running sampler; [`Peaks::finish`] stops it and gives the peaks.
#[derive(Debug)]
pub struct Peaks {
    stop: oneshot::Sender<()>,
    task: JoinHandle<BTreeMap<String, f64>>,
}

impl Peaks {
    /// Starts reading.
    pub fn start(watch: Vec<Watch>) -> Self {
        let mut rss: Vec<(String, Vec<u32>)> = Vec::new();
        let mut metrics: Vec<(String, String, String)> = Vec::new();
        for w in watch {
            match w {
                Watch::Rss { name, pid, tree } => {
                    let mut pids = vec![pid];
                    if tree {
                        pids.extend(descendants(pid));
                    }
                    rss.push((format!("rss_bytes.{name}"), pids));
                }
                Watch::Metric { name, url, metric } => {
                    metrics.push((format!("streams.{name}"), url, metric));
                }
            }
        }
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap_or_default();
            let mut peaks: BTreeMap<String, f64> = BTreeMap::new();
            let mut keep = |key: &str, now: f64| {
                let peak = peaks.entry(key.to_owned()).or_default();
                *peak = peak.max(now);
            };
            let mut next_metric = Instant::now();
            loop {
                for (key, pids) in &rss {
                    keep(
                        key,
                        pids.iter().filter_map(|&p| rss_bytes(p)).sum::<u64>() as f64,
                    );
                }
                if Instant::now() >= next_metric {
                    next_metric += METRIC_EVERY;
                    for (key, url, metric) in &metrics {
                        if let Some(v) = read_metric(&http, url, metric).await {
                            keep(key, v);
                        }
                    }
                }
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(RSS_EVERY) => {}
                }
            }
            peaks
        });
        Self { stop, task }
    }

    /// Stops reading; the highest reading of each key.
    pub async fn finish(self) -> BTreeMap<String, f64> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

/// The series `name` in `{url}/metrics`, summed over its labels.
async fn read_metric(http: &reqwest::Client, url: &str, name: &str) -> Option<f64> {
    let text = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(metric_sum(&text, name))
}

/// Sums every sample of series `name` in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
