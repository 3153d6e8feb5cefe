//! [`GenerationStore`] in process memory, for the actors' tests and the property tests. It
//! runs the same [`apply`] and [`decide`] as the SQL stores, under one mutex.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;

use super::admission::{Bucket, Decision, MessagePolicy, NewGeneration, WindowCounters, decide};
use super::{Applied, Effect, Event, GenerationRecord, GenerationStore, LifecycleError, apply};

#[derive(Debug, Default)]
struct Inner {
    records: BTreeMap<String, GenerationRecord>,
    by_key: BTreeMap<(String, String), String>,
    buckets: BTreeMap<String, Bucket>,
    windows: BTreeMap<(String, i64), WindowCounters>,
}

impl Inner {
    fn effect(&mut self, subject: &str, effect: Effect) {
        let (start, consume) = match effect {
            Effect::ConsumeMessage { window_start_ms } => (window_start_ms, true),
            Effect::ReleaseMessage { window_start_ms } => (window_start_ms, false),
        };
        let w = self.windows.entry((subject.to_owned(), start)).or_default();
        w.reserved = w.reserved.saturating_sub(1);
        if consume {
            w.used += 1;
        }
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct MemoryGenerations {
    inner: Mutex<Inner>,
}

impl MemoryGenerations {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>, LifecycleError> {
        self.inner
            .lock()
            .map_err(|_| LifecycleError::Unavailable("poisoned".into()))
    }

    /// Every record (for tests).
    pub fn records(&self) -> Vec<GenerationRecord> {
        self.inner
            .lock()
            .map(|i| i.records.values().cloned().collect())
            .unwrap_or_default()
    }
}

#[async_trait]
impl GenerationStore for MemoryGenerations {
    async fn admit_generation(
        &self,
        new: &NewGeneration,
        policy: &MessagePolicy,
        now_ms: i64,
    ) -> Result<Decision, LifecycleError> {
        let mut inner = self.lock()?;
        let key = (new.subject.clone(), new.idempotency_key.clone());
        let existing = inner
            .by_key
            .get(&key)
            .and_then(|id| inner.records.get(id))
            .cloned();
        let active = inner
            .records
            .values()
            .filter(|r| r.subject == new.subject && r.slot_held && r.slot_expires_ms > now_ms)
            .count();
        let start = super::window_start(now_ms, policy.window_ms);
        let window = inner
            .windows
            .get(&(new.subject.clone(), start))
            .copied()
            .unwrap_or_default();
        let bucket = inner.buckets.get(&new.subject).copied();
        let admit = match decide(
            new,
            existing.as_ref(),
            policy,
            bucket,
            u32::try_from(active).unwrap_or(u32::MAX),
            window,
            now_ms,
        ) {
            Ok(a) => a,
            Err(d) => return Ok(d),
        };
        inner.buckets.insert(new.subject.clone(), admit.bucket);
        inner
            .windows
            .entry((new.subject.clone(), admit.window_start_ms))
            .or_default()
            .reserved += 1;
        inner.by_key.insert(key, admit.record.id.clone());
        inner
            .records
            .insert(admit.record.id.clone(), admit.record.clone());
        Ok(Decision::Admitted(admit.record))
    }

    async fn find_generation(
        &self,
        subject: &str,
        idempotency_key: &str,
    ) -> Result<Option<GenerationRecord>, LifecycleError> {
        let inner = self.lock()?;
        Ok(inner
            .by_key
            .get(&(subject.to_owned(), idempotency_key.to_owned()))
            .and_then(|id| inner.records.get(id))
            .cloned())
    }

    async fn get_generation(&self, id: &str) -> Result<Option<GenerationRecord>, LifecycleError> {
        Ok(self.lock()?.records.get(id).cloned())
    }

    async fn apply_generation(
        &self,
        id: &str,
        event: &Event,
        now_ms: i64,
    ) -> Result<Applied, LifecycleError> {
        let mut inner = self.lock()?;
        let mut record = inner
            .records
            .get(id)
            .cloned()
            .ok_or(LifecycleError::Unknown)?;
        let result = apply(&mut record, event, now_ms);
        if let Ok(effects) = &result {
            for e in effects {
                inner.effect(&record.subject, *e);
            }
            inner.records.insert(id.to_owned(), record.clone());
        }
        Ok(Applied { record, result })
    }

    async fn sweep_generations(
        &self,
        now_ms: i64,
        retention_ms: i64,
    ) -> Result<u64, LifecycleError> {
        let mut inner = self.lock()?;
        let ids: Vec<String> = inner
            .records
            .values()
            .filter(|r| r.status.is_active() && r.slot_expires_ms <= now_ms)
            .map(|r| r.id.clone())
            .collect();
        let mut expired = 0;
        for id in ids {
            let Some(mut record) = inner.records.get(&id).cloned() else {
                continue;
            };
            if let Ok(effects) = apply(&mut record, &Event::Expire, now_ms) {
                for e in effects {
                    inner.effect(&record.subject, e);
                }
                inner.records.insert(id, record);
                expired += 1;
            }
        }
        for r in inner.records.values_mut() {
            if r.terminal_ms
                .is_some_and(|t| t.saturating_add(retention_ms) <= now_ms)
            {
                r.output = None;
                r.output_extra = None;
            }
        }
        Ok(expired)
    }

    async fn message_window(
        &self,
        subject: &str,
        window_start_ms: i64,
    ) -> Result<WindowCounters, LifecycleError> {
        Ok(self
            .lock()?
            .windows
            .get(&(subject.to_owned(), window_start_ms))
            .copied()
            .unwrap_or_default())
    }
}
