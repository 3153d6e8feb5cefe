//! The cap on concurrent connections per client address: a count per IP that exists only
//! while the address holds a connection, and a permit that gives the place back on drop.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use switchyard_actors::metric_names::{CONNECTIONS_OPEN, CONNECTIONS_REFUSED_TOTAL};
use tokio::time::Instant;

/// A capped address is logged at most this often, so a flood of refusals is one line a minute.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Open connections per client address.
#[derive(Debug)]
pub(super) struct Clients {
    /// Connections one address may hold; `0`: no cap, nothing is counted per address.
    cap: u32,
    /// Looked up by address, never iterated; an entry leaves when its count reaches zero, so
    /// the map is as large as the set of addresses connected right now.
    open: Mutex<HashMap<IpAddr, Held>>,
}

/// One address's connections.
#[derive(Debug)]
struct Held {
    /// Connections open now.
    open: u32,
    /// Refused since the last warning about this address.
    refused: u64,
    /// When this address was last warned about.
    warned: Option<Instant>,
}

impl Clients {
    pub(super) fn new(cap: u32) -> Arc<Self> {
        Arc::new(Self {
            cap,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A place for one more connection from `ip`, or `None` (counted and, now and then,
    /// logged) when the address already holds `cap`.
    pub(super) fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Permit> {
        // A dual-stack socket reports IPv4 clients as `::ffff:a.b.c.d`: one client, one count.
        let ip = ip.to_canonical();
        if self.cap > 0 {
            let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
            let held = open.entry(ip).or_insert(Held {
                open: 0,
                refused: 0,
                warned: None,
            });
            if held.open >= self.cap {
                held.refused += 1;
                metrics::counter!(CONNECTIONS_REFUSED_TOTAL, "reason" => "per_client_cap")
                    .increment(1);
                let now = Instant::now();
                if held
                    .warned
                    .is_none_or(|at| now.duration_since(at) >= WARN_EVERY)
                {
                    tracing::warn!(
                        client = %ip,
                        cap = self.cap,
                        refused = held.refused,
                        "a client address holds its cap of connections; further ones are closed at accept"
                    );
                    held.warned = Some(now);
                    held.refused = 0;
                }
                return None;
            }
            held.open += 1;
        }
        metrics::gauge!(CONNECTIONS_OPEN).increment(1.0);
        Some(Permit {
            clients: self.clone(),
            ip,
        })
    }

    fn release(&self, ip: IpAddr) {
        metrics::gauge!(CONNECTIONS_OPEN).decrement(1.0);
        if self.cap == 0 {
            return;
        }
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Entry::Occupied(mut held) = open.entry(ip) {
            held.get_mut().open = held.get().open.saturating_sub(1);
            if held.get().open == 0 {
                held.remove();
            }
        }
    }

    /// Addresses holding at least one connection.
    #[cfg(test)]
    pub(super) fn addresses(&self) -> usize {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// One admitted connection's place; it lives as long as the socket (an upgraded WebSocket
/// included), and gives the place back when dropped.
#[derive(Debug)]
pub(super) struct Permit {
    clients: Arc<Clients>,
    ip: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.clients.release(self.ip);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[tokio::test]
    async fn the_cap_holds_per_address_and_the_map_empties() {
        let clients = Clients::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        // The same client through a dual-stack socket.
        let a6: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = clients.admit(a).unwrap();
        let second = clients.admit(a6).unwrap();
        assert!(clients.admit(a).is_none(), "a third from the same address");
        let other = clients.admit(b).unwrap();
        assert_eq!(clients.addresses(), 2);
        drop(first);
        let third = clients.admit(a).unwrap();
        drop((second, third, other));
        assert_eq!(clients.addresses(), 0, "no entry outlives its connections");
    }

    #[tokio::test]
    async fn no_cap_counts_nothing_per_address() {
        let clients = Clients::new(0);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let permits: Vec<_> = (0..5000).filter_map(|_| clients.admit(ip)).collect();
        assert_eq!(permits.len(), 5000);
        assert_eq!(clients.addresses(), 0);
    }
}
