//! [`MemoryCoordinator`]: the in-process [`Coordinator`] of the embedded mode, one replica and
//! no Redis. It copies Redis's observable behaviour (one keyspace, lazy expiry on read, fenced
//! leases, fire-and-forget pub/sub) so code tested against it behaves the same in production.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::time::Instant;

use switchyard_actors::ports::{Clock, CoordError, Coordinator, LimitVerdict, SystemClock};

fn verdict(admitted: bool, count: usize, wait_ms: i64) -> LimitVerdict {
    LimitVerdict {
        admitted,
        count: u32::try_from(count).unwrap_or(u32::MAX),
        wait_ms: u64::try_from(wait_ms).unwrap_or(0),
    }
}

/// Writes between two sweeps of expired keys. Reads already ignore expired keys; the sweep
/// only bounds memory for keys nobody reads again (a node that never came back).
const SWEEP_EVERY_WRITES: u32 = 1024;

/// In-process coordination with Redis's semantics. Time is tokio's clock, so tests on a
/// paused runtime travel through TTLs instantly; fencing tokens are floored at the wall
/// clock, as Redis's scripts floor them at its `TIME`.
#[derive(Debug)]
pub struct MemoryCoordinator {
    /// Everything behind one lock, never held across an `.await`: each operation is atomic,
    /// as a Redis command or script is.
    inner: Mutex<Inner>,
    /// Woken on every journal append, so blocked [`Coordinator::read_events`] calls look
    /// again (each rechecks its own key; appends are rare next to the lock's cost).
    appended: tokio::sync::Notify,
    /// The wall clock that floors fencing tokens (see [`Inner::next_fence`]).
    clock: Arc<dyn Clock>,
}

impl Default for MemoryCoordinator {
    fn default() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// The keyspace shared by hashes, counters and leases, as in Redis.
    keys: BTreeMap<String, Entry>,
    /// Last fencing token handed out per lease name. Kept apart from `keys` and never
    /// expired, so a token stays larger than every earlier one even after the lease key
    /// expires or is deleted; lost only with everything else ([`MemoryCoordinator::lose_everything`]),
    /// after which the wall-clock floor keeps new tokens above the old ones.
    fences: BTreeMap<String, u64>,
    /// Live subscribers per channel, in subscription order.
    channels: BTreeMap<String, Vec<UnboundedSender<Vec<u8>>>>,
    /// Writes since the last sweep of expired keys.
    writes_since_sweep: u32,
}

#[derive(Debug)]
struct Entry {
    value: Value,
    /// When the key stops existing; `None` never happens today but keeps the shape of a
    /// Redis key without TTL.
    expires_at: Option<Instant>,
}

impl Entry {
    fn is_live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| now < at)
    }
}

#[derive(Debug)]
enum Value {
    Hash(BTreeMap<String, String>),
    Counter(i64),
    Lease {
        owner: String,
        token: u64,
    },
    /// Member → score (a Redis sorted set): bounded slots and sliding windows.
    Scored(BTreeMap<String, i64>),
    /// Number → event (a Redis stream with ids `0-<number + 1>`): a generation's journal.
    Journal(BTreeMap<u64, Vec<u8>>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Hash(_) => "hash",
            Value::Counter(_) => "counter",
            Value::Lease { .. } => "lease",
            Value::Scored(_) => "sorted set",
            Value::Journal(_) => "stream",
        }
    }
}

fn wrong_type(key: &str, found: &Value, wanted: &str) -> CoordError {
    // Redis answers WRONGTYPE; the Redis implementation maps that to `Unavailable` too, so
    // callers see the same error from both.
    CoordError::Unavailable(format!(
        "WRONGTYPE key {key:?} holds a {}, not a {wanted}",
        found.kind()
    ))
}

impl Inner {
    /// The next fencing token of `name`: one past the last, and never below the wall clock in
    /// microseconds (`floor`), so tokens issued after the store lost everything stay above
    /// those issued before, as the Redis scripts' `next_fence` does with Redis's `TIME`.
    fn next_fence(&mut self, name: &str, floor: u64) -> u64 {
        let fence = self.fences.entry(name.to_owned()).or_insert(0);
        *fence = fence.saturating_add(1).max(floor);
        *fence
    }

    /// The live entry at `key`; an expired one is removed first, as Redis does on access.
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        if self.keys.get(key).is_some_and(|e| !e.is_live(now)) {
            self.keys.remove(key);
        }
        self.keys.get_mut(key)
    }

    /// Replaces the hash at `key` with `fields` and `fence`, expiring at `expires_at`.
    fn put_fenced_hash(
        &mut self,
        key: &str,
        fields: &BTreeMap<String, String>,
        fence: u64,
        expires_at: Instant,
    ) {
        let mut fields = fields.clone();
        fields.insert("fence".to_owned(), fence.to_string());
        self.keys.insert(
            key.to_owned(),
            Entry {
                value: Value::Hash(fields),
                expires_at: Some(expires_at),
            },
        );
    }

    fn note_write(&mut self, now: Instant) {
        self.writes_since_sweep += 1;
        if self.writes_since_sweep >= SWEEP_EVERY_WRITES {
            self.writes_since_sweep = 0;
            self.keys.retain(|_, e| e.is_live(now));
            self.channels.retain(|_, subs| {
                subs.retain(|s| !s.is_closed());
                !subs.is_empty()
            });
        }
    }
}

impl MemoryCoordinator {
    /// An empty coordinator.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty coordinator whose fencing tokens are floored at `clock`'s wall time (a
    /// simulation passes its own).
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            appended: tokio::sync::Notify::new(),
            clock,
        }
    }

    /// Everything is lost at once, as when a Redis without persistence restarts: every key,
    /// fencing counter and journal goes, and every subscription ends (its receiver closes,
    /// as a dropped Redis connection ends its subscriptions).
    pub fn lose_everything(&self) {
        let mut inner = self.lock();
        *inner = Inner::default();
        drop(inner);
        self.appended.notify_waiters();
    }

    /// The wall clock in microseconds: the floor of every new fencing token.
    fn fence_floor(&self) -> u64 {
        u64::try_from(self.clock.wall().timestamp_micros()).unwrap_or(0)
    }

    /// Runs `f` on the sorted set at `key` (created empty), which expires `ttl` from now.
    fn scored(
        &self,
        key: &str,
        ttl: Duration,
        f: impl FnOnce(&mut BTreeMap<String, i64>) -> LimitVerdict,
    ) -> Result<LimitVerdict, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        let out = match inner.live(key, now) {
            Some(Entry {
                value: Value::Scored(set),
                expires_at,
            }) => {
                let v = f(set);
                *expires_at = Some(now + ttl);
                v
            }
            Some(entry) => return Err(wrong_type(key, &entry.value, "sorted set")),
            None => {
                let mut set = BTreeMap::new();
                let v = f(&mut set);
                inner.keys.insert(
                    key.to_owned(),
                    Entry {
                        value: Value::Scored(set),
                        expires_at: Some(now + ttl),
                    },
                );
                v
            }
        };
        inner.note_write(now);
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No operation can panic halfway through a change, so a poisoned lock still guards
        // consistent data.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Up to `max` events of the journal at `key` after `after`, without waiting.
    fn journal_after(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.live(key, now) {
            None => Ok(Vec::new()),
            Some(Entry {
                value: Value::Journal(events),
                ..
            }) => {
                let from = after.map_or(0, |a| a.saturating_add(1));
                Ok(events
                    .range(from..)
                    .take(max)
                    .map(|(n, e)| (*n, e.clone()))
                    .collect())
            }
            Some(entry) => Err(wrong_type(key, &entry.value, "stream")),
        }
    }

    /// Subscribers currently registered on `channel`, closed ones included until the next
    /// publish prunes them. For tests and diagnostics.
    pub fn subscriber_count(&self, channel: &str) -> usize {
        self.lock().channels.get(channel).map_or(0, Vec::len)
    }
}

#[async_trait]
impl Coordinator for MemoryCoordinator {
    async fn put_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        // A replacement, like Redis's `DEL` + `HSET` + `PEXPIRE`: whatever the key held goes.
        if fields.is_empty() {
            // Redis has no empty hashes: replacing with nothing leaves no key.
            inner.keys.remove(key);
        } else {
            inner.keys.insert(
                key.to_owned(),
                Entry {
                    value: Value::Hash(fields.clone()),
                    expires_at: Some(now + ttl),
                },
            );
        }
        inner.note_write(now);
        Ok(())
    }

    async fn get_hash(&self, key: &str) -> Result<Option<BTreeMap<String, String>>, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.live(key, now) {
            None => Ok(None),
            Some(Entry {
                value: Value::Hash(fields),
                ..
            }) => Ok(Some(fields.clone())),
            Some(entry) => Err(wrong_type(key, &entry.value, "hash")),
        }
    }

    async fn delete(&self, key: &str) -> Result<(), CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.keys.remove(key);
        inner.note_write(now);
        Ok(())
    }

    async fn claim_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<u64, CoordError> {
        let now = Instant::now();
        let floor = self.fence_floor();
        let mut inner = self.lock();
        let token = inner.next_fence(key, floor);
        inner.put_fenced_hash(key, fields, token, now + ttl);
        inner.note_write(now);
        Ok(token)
    }

    async fn put_hash_fenced(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.fences.get(key) {
            // Lost with everything else: no claim since, so the holder's token is still
            // the latest (a later claim goes past it).
            None => {
                inner.fences.insert(key.to_owned(), fence);
            }
            Some(latest) if *latest != fence => return Ok(false),
            Some(_) => {}
        }
        inner.put_fenced_hash(key, fields, fence, now + ttl);
        inner.note_write(now);
        Ok(true)
    }

    async fn delete_fenced(&self, key: &str, fence: u64) -> Result<bool, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        if inner.fences.get(key) != Some(&fence) {
            return Ok(false);
        }
        inner.keys.remove(key);
        inner.note_write(now);
        Ok(true)
    }

    async fn acquire_lease(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, CoordError> {
        let now = Instant::now();
        let floor = self.fence_floor();
        let mut inner = self.lock();
        if let Some(entry) = inner.live(name, now) {
            return match &entry.value {
                Value::Lease {
                    owner: held_by,
                    token,
                } if held_by == owner => {
                    // Renewal: same holder, same token, fresh expiry.
                    let token = *token;
                    entry.expires_at = Some(now + ttl);
                    Ok(Some(token))
                }
                Value::Lease { .. } => Ok(None),
                other => Err(wrong_type(name, other, "lease")),
            };
        }
        let token = inner.next_fence(name, floor);
        inner.keys.insert(
            name.to_owned(),
            Entry {
                value: Value::Lease {
                    owner: owner.to_owned(),
                    token,
                },
                expires_at: Some(now + ttl),
            },
        );
        inner.note_write(now);
        Ok(Some(token))
    }

    async fn release_lease(&self, name: &str, owner: &str) -> Result<(), CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        let held_by_owner = match inner.live(name, now) {
            None => false,
            Some(Entry {
                value: Value::Lease { owner: held_by, .. },
                ..
            }) => held_by == owner,
            Some(entry) => return Err(wrong_type(name, &entry.value, "lease")),
        };
        // Only the holder may release: a late release from a fenced-out owner must not free
        // the lease its successor now holds.
        if held_by_owner {
            inner.keys.remove(name);
            inner.note_write(now);
        }
        Ok(())
    }

    async fn lease_holder(&self, name: &str) -> Result<Option<String>, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.live(name, now) {
            None => Ok(None),
            Some(Entry {
                value: Value::Lease { owner, .. },
                ..
            }) => Ok(Some(owner.clone())),
            Some(entry) => Err(wrong_type(name, &entry.value, "lease")),
        }
    }

    async fn incr(&self, key: &str, by: i64, ttl: Duration) -> Result<i64, CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        let sum = match inner.live(key, now) {
            Some(Entry {
                value: Value::Counter(n),
                ..
            }) => {
                // The expiry set at creation stays: a window counter must not live longer
                // because it keeps being hit.
                *n = n.checked_add(by).ok_or_else(|| {
                    CoordError::Unavailable(format!(
                        "ERR increment or decrement would overflow (key {key:?})"
                    ))
                })?;
                *n
            }
            Some(entry) => return Err(wrong_type(key, &entry.value, "counter")),
            None => {
                inner.keys.insert(
                    key.to_owned(),
                    Entry {
                        value: Value::Counter(by),
                        expires_at: Some(now + ttl),
                    },
                );
                by
            }
        };
        inner.note_write(now);
        Ok(sum)
    }

    async fn acquire_slot(
        &self,
        key: &str,
        member: &str,
        limit: u32,
        now_ms: i64,
        ttl: Duration,
    ) -> Result<LimitVerdict, CoordError> {
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        self.scored(key, ttl, |set| {
            set.retain(|_, expires| *expires > now_ms);
            let held = set.contains_key(member);
            let admitted = held || set.len() < limit as usize;
            if admitted {
                set.insert(member.to_owned(), now_ms.saturating_add(ttl_ms));
            }
            let wait = set
                .values()
                .min()
                .map_or(0, |first| first.saturating_sub(now_ms));
            verdict(admitted, set.len(), wait)
        })
    }

    async fn release_slot(&self, key: &str, member: &str) -> Result<(), CoordError> {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.live(key, now) {
            Some(Entry {
                value: Value::Scored(set),
                ..
            }) => {
                set.remove(member);
                Ok(())
            }
            Some(entry) => Err(wrong_type(key, &entry.value, "sorted set")),
            None => Ok(()),
        }
    }

    async fn window_admit(
        &self,
        key: &str,
        member: &str,
        now_ms: i64,
        window: Duration,
        limit: u32,
    ) -> Result<LimitVerdict, CoordError> {
        let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        self.scored(key, window, |set| {
            set.retain(|_, at| *at > now_ms.saturating_sub(window_ms));
            let admitted = set.len() < limit as usize;
            if admitted {
                set.insert(member.to_owned(), now_ms);
            }
            let wait = set.values().min().map_or(0, |first| {
                first.saturating_add(window_ms).saturating_sub(now_ms)
            });
            verdict(admitted, set.len(), wait)
        })
    }

    async fn publish(&self, channel: &str, payload: Vec<u8>) -> Result<usize, CoordError> {
        let mut inner = self.lock();
        let mut received = 0;
        if let Some(subs) = inner.channels.get_mut(channel) {
            // Sending under the lock keeps publish order across concurrent publishers; a
            // failed send means the receiver is gone, so the subscriber is dropped.
            subs.retain(|s| s.send(payload.clone()).is_ok());
            received = subs.len();
            if subs.is_empty() {
                inner.channels.remove(channel);
            }
        }
        Ok(received)
    }

    async fn subscribe(&self, channel: &str) -> Result<UnboundedReceiver<Vec<u8>>, CoordError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let now = Instant::now();
        let mut inner = self.lock();
        inner
            .channels
            .entry(channel.to_owned())
            .or_default()
            .push(tx);
        inner.note_write(now);
        Ok(rx)
    }

    async fn append_events(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        let now = Instant::now();
        {
            let mut inner = self.lock();
            match inner.live(key, now) {
                Some(Entry {
                    value: Value::Journal(_),
                    expires_at,
                }) => *expires_at = Some(now + ttl),
                Some(entry) => return Err(wrong_type(key, &entry.value, "stream")),
                None => {
                    inner.keys.insert(
                        key.to_owned(),
                        Entry {
                            value: Value::Journal(BTreeMap::new()),
                            expires_at: Some(now + ttl),
                        },
                    );
                }
            }
            let Some(Entry {
                value: Value::Journal(journal),
                ..
            }) = inner.keys.get_mut(key)
            else {
                return Err(CoordError::Unavailable("journal vanished".to_owned()));
            };
            // As Redis refuses a stream id at or below the last one.
            let next = journal.keys().next_back().map_or(0, |last| last + 1);
            for (seq, event) in (first_seq..).zip(events) {
                if seq >= next {
                    journal.insert(seq, event);
                }
            }
            inner.note_write(now);
        }
        self.appended.notify_waiters();
        Ok(())
    }

    async fn read_events(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        let deadline = Instant::now() + block;
        loop {
            // Registered before looking, so an append between the look and the wait still
            // wakes this reader.
            let appended = self.appended.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            let found = self.journal_after(key, after, max)?;
            if !found.is_empty() || Instant::now() >= deadline {
                return Ok(found);
            }
            if tokio::time::timeout_at(deadline, appended).await.is_err() {
                return self.journal_after(key, after, max);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::coord::conformance;

    const P: &str = "t:";

    #[tokio::test(start_paused = true)]
    async fn full_conformance_suite() {
        conformance::conformance_suite(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn hash_round_trip_and_replace() {
        conformance::hash_round_trip_and_replace(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn hash_expiry() {
        conformance::hash_expiry(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lease_exclusive_and_renew() {
        conformance::lease_exclusive_and_renew(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lease_takeover_after_expiry() {
        conformance::lease_takeover_after_expiry(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lease_release() {
        conformance::lease_release(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lease_tokens_survive_delete() {
        conformance::lease_tokens_survive_delete(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn counter_sums_and_keeps_first_expiry() {
        conformance::counter_sums_and_keeps_first_expiry(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn pubsub_order_and_late_subscribers() {
        conformance::pubsub_order_and_late_subscribers(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn pubsub_fans_out_and_survives_dropped_subscribers() {
        conformance::pubsub_fans_out_and_survives_dropped_subscribers(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn delete_removes_any_kind() {
        conformance::delete_removes_any_kind(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn wrong_kind_is_an_error() {
        conformance::wrong_kind_is_an_error(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn journal_appends_in_order_skips_repeats_and_expires() {
        conformance::journal_appends_in_order_skips_repeats_and_expires(
            &MemoryCoordinator::new(),
            P,
        )
        .await
        .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn journal_reader_waits_for_the_next_append() {
        conformance::journal_reader_waits_for_the_next_append(&MemoryCoordinator::new(), P)
            .await
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_is_exact_on_a_paused_clock() {
        let c = MemoryCoordinator::new();
        let fields = BTreeMap::from([("owner".to_owned(), "r1".to_owned())]);
        c.put_hash("node:a", &fields, Duration::from_secs(15))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_millis(14_999)).await;
        assert_eq!(c.get_hash("node:a").await.unwrap(), Some(fields));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(c.get_hash("node:a").await.unwrap(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn closed_subscribers_are_dropped_on_publish() {
        let c = MemoryCoordinator::new();
        let kept = c.subscribe("ch").await.unwrap();
        let gone = c.subscribe("ch").await.unwrap();
        assert_eq!(c.subscriber_count("ch"), 2);
        drop(gone);
        c.publish("ch", b"x".to_vec()).await.unwrap();
        assert_eq!(c.subscriber_count("ch"), 1);
        drop(kept);
        c.publish("ch", b"y".to_vec()).await.unwrap();
        assert_eq!(c.subscriber_count("ch"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn sweep_bounds_memory_of_unread_keys() {
        let c = MemoryCoordinator::new();
        for i in 0..SWEEP_EVERY_WRITES - 1 {
            c.incr(&format!("k{i}"), 1, Duration::from_millis(10))
                .await
                .unwrap();
        }
        tokio::time::advance(Duration::from_millis(20)).await;
        c.incr("fresh", 1, Duration::from_secs(1)).await.unwrap();
        let keys = c.lock().keys.len();
        assert!(keys <= 1, "{keys} keys left after the sweep");
    }

    #[tokio::test(start_paused = true)]
    async fn counter_overflow_is_an_error() {
        let c = MemoryCoordinator::new();
        c.incr("n", i64::MAX, Duration::from_secs(1)).await.unwrap();
        assert!(c.incr("n", 1, Duration::from_secs(1)).await.is_err());
        assert_eq!(
            c.incr("n", 0, Duration::from_secs(1)).await.unwrap(),
            i64::MAX
        );
    }
}
