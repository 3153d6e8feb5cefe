//! The last hour of every model's queue, minute by minute, for the operator's console
//! (`GET /admin/queues`): the deepest the queue got, how many generations it dispatched and
//! their mean wait, and the requests that ended with each error code. It is fed by the
//! metrics the platform already records (`switchyard_queue_depth`,
//! `switchyard_queue_wait_seconds`, `switchyard_requests_total`): [`Tee`] wraps the process's
//! recorder and copies those three into [`Recent`] as they are recorded, so no call site
//! changes and nothing is counted twice. Process-wide, like the recorder: a replica's own view.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use serde::Serialize;
use switchyard_actors::metric_names::{QUEUE_DEPTH, QUEUE_WAIT_SECONDS, REQUESTS_TOTAL};

/// Minutes kept per model.
pub const WINDOW_MINUTES: usize = 60;

/// Request outcomes that are not refusals or failures.
const NOT_REFUSED: [&str; 3] = ["ok", "replayed", "cancelled"];

/// One minute of one model's queue.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Minute {
    /// The minute's start, in whole minutes since the Unix epoch.
    #[serde(skip)]
    pub epoch_minute: i64,
    /// Its start, RFC 3339.
    pub minute: String,
    /// The deepest the queue was (0 when it was never set this minute).
    pub depth_max: f64,
    /// Generations handed to a node.
    pub dispatched: u64,
    /// Their mean wait in the queue, seconds (0 with none).
    pub wait_mean_seconds: f64,
    #[serde(skip)]
    wait_sum: f64,
    /// Requests that ended with each error code (`client_gone` and `slow_reader` included).
    pub refused: BTreeMap<String, u64>,
}

/// Every model's last hour. The model `""` holds requests refused before a model was known.
#[derive(Debug, Default)]
pub struct Recent {
    models: Mutex<BTreeMap<String, VecDeque<Minute>>>,
}

impl Recent {
    /// The process's history.
    pub fn global() -> &'static Recent {
        static RECENT: OnceLock<Recent> = OnceLock::new();
        RECENT.get_or_init(Recent::default)
    }

    fn with_minute(&self, model: &str, f: impl FnOnce(&mut Minute)) {
        let now = chrono::Utc::now();
        let epoch_minute = now.timestamp().div_euclid(60);
        let mut models = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        // Looked up before inserting: this runs on every recorded value of the three metrics.
        if !models.contains_key(model) {
            models.insert(model.to_owned(), VecDeque::new());
        }
        let Some(minutes) = models.get_mut(model) else {
            return;
        };
        if minutes.back().is_none_or(|m| m.epoch_minute < epoch_minute) {
            let minute = chrono::DateTime::from_timestamp(epoch_minute * 60, 0)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
                .unwrap_or_default();
            minutes.push_back(Minute {
                epoch_minute,
                minute,
                ..Minute::default()
            });
        }
        while minutes
            .front()
            .is_some_and(|m| m.epoch_minute <= epoch_minute - WINDOW_MINUTES as i64)
        {
            minutes.pop_front();
        }
        if let Some(m) = minutes.back_mut() {
            f(m);
        }
    }

    /// The queue of `model` is `depth` deep.
    pub fn depth(&self, model: &str, depth: f64) {
        self.with_minute(model, |m| m.depth_max = m.depth_max.max(depth));
    }

    /// A generation of `model` waited `seconds` for its node.
    pub fn waited(&self, model: &str, seconds: f64) {
        self.with_minute(model, |m| {
            m.dispatched += 1;
            m.wait_sum += seconds;
            m.wait_mean_seconds = m.wait_sum / m.dispatched as f64;
        });
    }

    /// `n` requests of `model` ended with `code`.
    pub fn ended(&self, model: &str, code: &str, n: u64) {
        if n == 0 || NOT_REFUSED.contains(&code) {
            return;
        }
        self.with_minute(model, |m| {
            *m.refused.entry(code.to_owned()).or_default() += n
        });
    }

    /// The last hour of every model seen, oldest minute first; minutes older than the window
    /// are left out even if nothing was recorded since.
    pub fn snapshot(&self) -> BTreeMap<String, Vec<Minute>> {
        let now = chrono::Utc::now().timestamp().div_euclid(60);
        let models = self.models.lock().unwrap_or_else(PoisonError::into_inner);
        models
            .iter()
            .map(|(model, minutes)| {
                let kept = minutes
                    .iter()
                    .filter(|m| m.epoch_minute > now - WINDOW_MINUTES as i64)
                    .cloned()
                    .collect();
                (model.clone(), kept)
            })
            .collect()
    }
}

/// Which of the three metrics a handle feeds, and for which model (and code).
#[derive(Debug, Clone)]
enum Feed {
    Depth(String),
    Wait(String),
    Ended(String, String),
}

impl Feed {
    fn of(key: &Key) -> Option<Feed> {
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
        };
        match key.name() {
            QUEUE_DEPTH => Some(Feed::Depth(label("model")?)),
            QUEUE_WAIT_SECONDS => Some(Feed::Wait(label("model")?)),
            REQUESTS_TOTAL => Some(Feed::Ended(label("model")?, label("code")?)),
            _ => None,
        }
    }
}

/// A handle that records into the wrapped recorder's handle and into [`Recent`].
struct Copied<H> {
    inner: H,
    feed: Feed,
    recent: &'static Recent,
}

impl CounterFn for Copied<Counter> {
    fn increment(&self, value: u64) {
        self.inner.increment(value);
        if let Feed::Ended(model, code) = &self.feed {
            self.recent.ended(model, code, value);
        }
    }

    fn absolute(&self, value: u64) {
        self.inner.absolute(value);
    }
}

impl GaugeFn for Copied<Gauge> {
    fn increment(&self, value: f64) {
        self.inner.increment(value);
    }

    fn decrement(&self, value: f64) {
        self.inner.decrement(value);
    }

    fn set(&self, value: f64) {
        self.inner.set(value);
        if let Feed::Depth(model) = &self.feed {
            self.recent.depth(model, value);
        }
    }
}

impl HistogramFn for Copied<Histogram> {
    fn record(&self, value: f64) {
        self.inner.record(value);
        if let Feed::Wait(model) = &self.feed {
            self.recent.waited(model, value);
        }
    }
}

/// A recorder that passes everything to `inner` and copies the queue's metrics into
/// [`Recent::global`].
#[derive(Debug)]
pub struct Tee<R> {
    inner: R,
}

impl<R> Tee<R> {
    pub fn new(inner: R) -> Self {
        Self { inner }
    }
}

impl<R: Recorder> Recorder for Tee<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        let inner = self.inner.register_counter(key, metadata);
        match Feed::of(key) {
            Some(feed) => Counter::from_arc(Arc::new(Copied {
                inner,
                feed,
                recent: Recent::global(),
            })),
            None => inner,
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        let inner = self.inner.register_gauge(key, metadata);
        match Feed::of(key) {
            Some(feed) => Gauge::from_arc(Arc::new(Copied {
                inner,
                feed,
                recent: Recent::global(),
            })),
            None => inner,
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        let inner = self.inner.register_histogram(key, metadata);
        match Feed::of(key) {
            Some(feed) => Histogram::from_arc(Arc::new(Copied {
                inner,
                feed,
                recent: Recent::global(),
            })),
            None => inner,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_minute_keeps_the_deepest_queue_the_mean_wait_and_refusals_by_code() {
        let r = Recent::default();
        r.depth("m", 3.0);
        r.depth("m", 7.0);
        r.depth("m", 1.0);
        r.waited("m", 1.0);
        r.waited("m", 2.0);
        r.ended("m", "queue_full", 2);
        r.ended("m", "ok", 5);
        r.ended("m", "capacity_exhausted", 1);
        r.ended("", "rate_limited", 1);
        let snap = r.snapshot();
        let m = snap["m"].last().unwrap();
        assert_eq!(m.depth_max, 7.0);
        assert_eq!(m.dispatched, 2);
        assert!((m.wait_mean_seconds - 1.5).abs() < 1e-9);
        assert_eq!(
            m.refused,
            BTreeMap::from([
                ("capacity_exhausted".to_owned(), 1),
                ("queue_full".to_owned(), 2)
            ])
        );
        assert_eq!(snap[""].last().unwrap().refused["rate_limited"], 1);
    }
}
