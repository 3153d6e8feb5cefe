//! The pub/sub side of the Redis coordinator: one dedicated connection and the routes from
//! its Redis channels to subscribers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use redis::aio::{PubSubSink, PubSubStream};
use redis::{Client, Msg, RedisError};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use switchyard_actors::ports::CoordError;

use super::{RedisCoordinatorOptions, lock, timed_out, unavailable};

/// One pub/sub connection and the routes from its Redis channels to subscribers.
pub(super) struct PubSubConn {
    /// Subscribes and unsubscribes, one at a time (see [`Coordinator::subscribe`]).
    pub(super) sink: tokio::sync::Mutex<PubSubSink>,
    /// This connection's private channel, carrying the activation markers.
    pub(super) control: String,
    routes: Mutex<Routes>,
    /// Ids of routes, unique within the connection.
    next_route: AtomicU64,
    timeout: Duration,
    /// Cancelled when the connection is lost or the coordinator dropped: the reader, the
    /// pinger and every route watcher stop, and all senders are dropped.
    pub(super) closed: CancellationToken,
}

#[derive(Default)]
struct Routes {
    /// Subscribers per Redis channel, in subscription order.
    channels: BTreeMap<String, Vec<Route>>,
    /// Channel of every route still waiting for its marker, by route id.
    pending: BTreeMap<u64, String>,
    /// Channels the connection has SUBSCRIBEd to on Redis. A channel can have routes before
    /// it is in here (its first subscriber is on the way) but never stays in here without.
    subscribed: BTreeSet<String>,
}

struct Route {
    id: u64,
    tx: UnboundedSender<Vec<u8>>,
    /// Set when the route's marker arrives; only active routes receive messages.
    active: bool,
}

impl PubSubConn {
    pub(super) async fn open(
        client: &Client,
        control: String,
        options: RedisCoordinatorOptions,
        closed: CancellationToken,
    ) -> Result<Arc<Self>, CoordError> {
        let timeout = options.command_timeout;
        let (mut sink, stream) = tokio::time::timeout(timeout, async {
            let (mut sink, stream) = client.get_async_pubsub().await?.split();
            sink.subscribe(&control).await?;
            Ok::<_, RedisError>((sink, stream))
        })
        .await
        .map_err(|_| timed_out("pub/sub connect", timeout))?
        .map_err(|e| unavailable("pub/sub connect", &e))?;

        let conn = Arc::new(Self {
            sink: tokio::sync::Mutex::new(sink.clone()),
            control,
            routes: Mutex::new(Routes::default()),
            next_route: AtomicU64::new(0),
            timeout,
            closed,
        });
        tokio::spawn(Arc::clone(&conn).read(stream));
        let pinger = Arc::clone(&conn);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(options.health_interval);
            tick.tick().await; // the first tick is immediate
            loop {
                tokio::select! {
                    () = pinger.closed.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let answer = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                if !matches!(answer, Ok(Ok(_))) {
                    tracing::warn!("redis pub/sub connection missed its ping; closing it");
                    pinger.close();
                    return;
                }
            }
        });
        Ok(conn)
    }

    /// Reads the stream until the connection ends or is closed, routing each message.
    pub(super) async fn read(self: Arc<Self>, mut stream: PubSubStream) {
        loop {
            tokio::select! {
                () = self.closed.cancelled() => break,
                msg = stream.next() => match msg {
                    Some(msg) => self.route(&msg),
                    None => {
                        tracing::warn!("redis pub/sub connection lost; closing its subscriptions");
                        break;
                    }
                },
            }
        }
        self.close();
        // Dropping the stream stops the connection's driver task and closes the socket.
    }

    pub(super) fn route(&self, msg: &Msg) {
        let channel = msg.get_channel_name();
        let payload = msg.get_payload_bytes();
        let mut routes = lock(&self.routes);
        if channel == self.control {
            let marker = std::str::from_utf8(payload)
                .ok()
                .and_then(|s| s.parse::<u64>().ok());
            let Some(id) = marker else { return };
            let Some(channel) = routes.pending.remove(&id) else {
                return;
            };
            if let Some(route) = routes
                .channels
                .get_mut(&channel)
                .and_then(|subs| subs.iter_mut().find(|r| r.id == id))
            {
                route.active = true;
            }
            return;
        }
        if let Some(subs) = routes.channels.get(channel) {
            for route in subs.iter().filter(|r| r.active) {
                // A failed send means the receiver is gone; its watcher removes the route.
                let _ = route.tx.send(payload.to_vec());
            }
        }
    }

    /// Registers an inactive route for `tx` and the watcher that removes it once the
    /// receiver is dropped. Returns the route id.
    pub(super) fn add_route(
        self: &Arc<Self>,
        channel: &str,
        tx: UnboundedSender<Vec<u8>>,
    ) -> Result<u64, CoordError> {
        let id = self.next_route.fetch_add(1, Ordering::Relaxed);
        {
            let mut routes = lock(&self.routes);
            // Checked under the lock `close` clears: no route outlives the connection.
            if self.closed.is_cancelled() {
                return Err(CoordError::Unavailable(
                    "redis subscribe: pub/sub connection lost".to_owned(),
                ));
            }
            routes
                .channels
                .entry(channel.to_owned())
                .or_default()
                .push(Route {
                    id,
                    tx: tx.clone(),
                    active: false,
                });
            routes.pending.insert(id, channel.to_owned());
        }
        let conn = Arc::clone(self);
        let channel = channel.to_owned();
        tokio::spawn(async move {
            tokio::select! {
                () = tx.closed() => conn.remove_route(&channel, id).await,
                () = conn.closed.cancelled() => {}
            }
        });
        Ok(id)
    }

    /// Whether the connection listens to `channel` on Redis. Changes only under `sink`.
    pub(super) fn is_subscribed(&self, channel: &str) -> bool {
        lock(&self.routes).subscribed.contains(channel)
    }

    pub(super) fn mark_subscribed(&self, channel: &str) {
        let mut routes = lock(&self.routes);
        // After a `close` nothing is listened to any more.
        if !self.closed.is_cancelled() {
            routes.subscribed.insert(channel.to_owned());
        }
    }

    /// Drops route `id`; the last route of a channel takes the Redis subscription with it.
    pub(super) async fn remove_route(&self, channel: &str, id: u64) {
        let mut sink = self.sink.lock().await;
        let now_empty = {
            let mut routes = lock(&self.routes);
            routes.pending.remove(&id);
            if let Some(subs) = routes.channels.get_mut(channel) {
                subs.retain(|r| r.id != id);
                if subs.is_empty() {
                    routes.channels.remove(channel);
                }
            }
            !routes.channels.contains_key(channel) && routes.subscribed.remove(channel)
        };
        if now_empty && !self.closed.is_cancelled() {
            let answer = tokio::time::timeout(self.timeout, sink.unsubscribe(channel)).await;
            if !matches!(answer, Ok(Ok(()))) {
                tracing::warn!("redis pub/sub unsubscribe failed; closing the connection");
                self.close();
            }
        }
    }

    /// Ends the connection: its tasks stop and every subscriber's receiver closes.
    pub(super) fn close(&self) {
        let mut routes = lock(&self.routes);
        self.closed.cancel();
        routes.channels.clear();
        routes.pending.clear();
        routes.subscribed.clear();
    }
}
