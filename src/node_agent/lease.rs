//! Attempt leases of one session. An `assign` with `lease_ms = L` may run only while the
//! agent keeps hearing from the server: any inbound message on the connection (a frame, a
//! ping or a pong) renews every lease at once, and an attempt whose server has been silent for
//! L is stopped like a `cancel`, because the server may by then have fenced it and dispatched
//! a new attempt elsewhere. So that a healthy but quiet server keeps renewing, the session
//! pings at least every L/3 (the shortest running lease) while a leased attempt runs; the
//! server's automatic pongs are the renewals.
//!
//! Pure bookkeeping with the time passed in: the session owns the timers and the tokens.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::ledger::Key;

/// Floor of the ping interval, so a tiny lease cannot turn into a ping storm.
const MIN_PING_INTERVAL: Duration = Duration::from_millis(10);

/// The leases of the attempts running on one connection.
#[derive(Debug)]
pub(crate) struct Leases {
    /// When the server was last heard from on this connection.
    last_heard: Instant,
    /// Running leased attempts and their lease length; expired ones are removed.
    held: BTreeMap<Key, Duration>,
    /// When the next keep-alive ping is due; `None` while no leased attempt runs.
    next_ping: Option<Instant>,
}

impl Leases {
    /// A connection that has just heard from the server (its `registered`).
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            last_heard: now,
            held: BTreeMap::new(),
            next_ping: None,
        }
    }

    /// Something arrived from the server: every lease is renewed.
    pub(crate) fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// A leased attempt starts; its `assign` has just been heard.
    pub(crate) fn hold(&mut self, key: Key, lease: Duration, now: Instant) {
        self.heard(now);
        self.held.insert(key, lease);
        let ping = now + ping_interval(lease);
        self.next_ping = Some(self.next_ping.map_or(ping, |p| p.min(ping)));
    }

    /// The attempt ended (or was cancelled); its lease no longer matters.
    pub(crate) fn release(&mut self, key: &Key) {
        self.held.remove(key);
        if self.held.is_empty() {
            self.next_ping = None;
        }
    }

    /// When the shortest lease runs out if nothing more is heard; `None` without leases.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.shortest().map(|l| self.last_heard + l)
    }

    /// Removes and returns the attempts whose lease ran out by `now`, with their lease and
    /// how long the server has been silent.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<(Key, Duration, Duration)> {
        let silent = now.saturating_duration_since(self.last_heard);
        let expired: Vec<_> = self
            .held
            .iter()
            .filter(|(_, lease)| silent >= **lease)
            .map(|(key, lease)| (key.clone(), *lease, silent))
            .collect();
        for (key, _, _) in &expired {
            self.release(key);
        }
        expired
    }

    /// When the next keep-alive ping is due.
    pub(crate) fn ping_due(&self) -> Option<Instant> {
        self.next_ping
    }

    /// A ping was queued at `now`: schedules the next one for the leases still held.
    pub(crate) fn pinged(&mut self, now: Instant) {
        self.next_ping = self.shortest().map(|l| now + ping_interval(l));
    }

    fn shortest(&self) -> Option<Duration> {
        self.held.values().min().copied()
    }
}

/// A third of the lease: two pings can be lost or slow before the lease is at risk.
fn ping_interval(lease: Duration) -> Duration {
    (lease / 3).max(MIN_PING_INTERVAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Key {
        (id.to_owned(), 1)
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_lease_expires_only_after_l_of_silence_and_any_message_renews_it() {
        let t0 = Instant::now();
        let mut l = Leases::new(t0);
        assert_eq!((l.deadline(), l.ping_due()), (None, None));
        l.hold(key("a"), 300 * MS, t0 + 100 * MS);
        assert_eq!(l.deadline(), Some(t0 + 400 * MS));
        assert_eq!(l.ping_due(), Some(t0 + 200 * MS));
        assert!(l.expire(t0 + 399 * MS).is_empty());
        l.heard(t0 + 350 * MS);
        assert_eq!(l.deadline(), Some(t0 + 650 * MS));
        // A message processed late never moves the renewal backwards.
        l.heard(t0 + 200 * MS);
        assert_eq!(l.deadline(), Some(t0 + 650 * MS));
        assert!(l.expire(t0 + 649 * MS).is_empty());
        let expired = l.expire(t0 + 650 * MS);
        assert_eq!(expired, vec![(key("a"), 300 * MS, 300 * MS)]);
        assert_eq!((l.deadline(), l.ping_due()), (None, None));
    }

    #[test]
    fn the_shortest_lease_sets_the_deadline_and_the_ping_pace() {
        let t0 = Instant::now();
        let mut l = Leases::new(t0);
        l.hold(key("long"), 900 * MS, t0);
        assert_eq!(l.ping_due(), Some(t0 + 300 * MS));
        l.hold(key("short"), 300 * MS, t0 + 50 * MS);
        assert_eq!(l.ping_due(), Some(t0 + 150 * MS));
        assert_eq!(l.deadline(), Some(t0 + 350 * MS));
        l.pinged(t0 + 150 * MS);
        assert_eq!(l.ping_due(), Some(t0 + 250 * MS));
        let expired = l.expire(t0 + 360 * MS);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].0, key("short"));
        assert_eq!(l.deadline(), Some(t0 + 950 * MS));
        l.pinged(t0 + 360 * MS);
        assert_eq!(l.ping_due(), Some(t0 + 660 * MS));
        l.release(&key("long"));
        assert_eq!((l.deadline(), l.ping_due()), (None, None));
        l.pinged(t0 + 700 * MS);
        assert_eq!(l.ping_due(), None);
    }

    #[test]
    fn a_tiny_lease_does_not_ping_in_a_loop() {
        let t0 = Instant::now();
        let mut l = Leases::new(t0);
        l.hold(key("a"), Duration::ZERO, t0);
        assert_eq!(l.ping_due(), Some(t0 + MIN_PING_INTERVAL));
        assert_eq!(l.expire(t0).len(), 1);
    }
}
