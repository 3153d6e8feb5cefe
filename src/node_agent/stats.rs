//! Counters a caller (the CLI, tests, a simulation) can read while the agent runs: cheap
//! atomics, updated where the events happen, never read by the agent itself.

use std::sync::atomic::{AtomicU64, Ordering};

/// What the agent has done so far; share it with [`super::run_with_stats`] through an `Arc`.
#[derive(Debug, Default)]
pub struct AgentStats {
    /// WebSocket handshakes that succeeded.
    connections: AtomicU64,
    /// `registered` answers received.
    registrations: AtomicU64,
    /// `rejected` answers received.
    rejections: AtomicU64,
    /// Heartbeat frames handed to the writer.
    heartbeats: AtomicU64,
    /// Assignments forwarded to the engine (duplicates and refusals excluded).
    assignments: AtomicU64,
    /// Assignments whose engine request is still open.
    in_flight: AtomicU64,
    /// `done` frames kept until the server acks them.
    unacked_dones: AtomicU64,
}

impl AgentStats {
    /// WebSocket handshakes that succeeded.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// `registered` answers received.
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// `rejected` answers received.
    pub fn rejections(&self) -> u64 {
        self.rejections.load(Ordering::Relaxed)
    }

    /// Heartbeat frames sent.
    pub fn heartbeats(&self) -> u64 {
        self.heartbeats.load(Ordering::Relaxed)
    }

    /// Assignments forwarded to the engine.
    pub fn assignments(&self) -> u64 {
        self.assignments.load(Ordering::Relaxed)
    }

    /// Engine requests open right now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// `done` frames the server has not acked yet.
    pub fn unacked_dones(&self) -> u64 {
        self.unacked_dones.load(Ordering::Relaxed)
    }

    pub(crate) fn connected(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn registered(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn rejected(&self) {
        self.rejections.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn heartbeat_sent(&self) {
        self.heartbeats.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn assignment_started(&self) {
        self.assignments.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_in_flight(&self, n: usize) {
        self.in_flight.store(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn set_unacked_dones(&self, n: usize) {
        self.unacked_dones.store(n as u64, Ordering::Relaxed);
    }
}
