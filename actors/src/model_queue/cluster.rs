//! A model's queue in a cluster: one owner at a time, by a lease with a fencing token.
//!
//! Every replica runs a [`super::ModelQueueActor`] for each model and keeps its view of the
//! nodes, but only the replica holding the lease `queue:{model}` decides: it holds the
//! waiting generations of every replica, counts each node's assignments cluster-wide and
//! picks the node. The others *follow*: they forward their generations' enqueues,
//! withdrawals and releases to the owner ([`to_queue`]) and run what it dispatches to them
//! ([`from_queue`]). A replica hears who owns a queue on [`QUEUE_OWNERS_CHANNEL`]; when the
//! owner changes (its replica died, or its queue actor restarted) each follower sends the new
//! one everything it knows — its waiting generations and its running count per node — so
//! nothing waiting is lost and no node is given more than its capacity.
//!
//! The fencing token makes a lost lease harmless: an owner that cannot renew stops deciding
//! when its lease may have run out (by its own clock), and a follower drops whatever an owner
//! older than the newest it has heard of sends it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

use super::msg::{ModelQueueHandle, QueueMsg};
use crate::cluster::{FromQueue, QUEUE_OWNERS_CHANNEL, QueueNews, QueueOwner, ToQueue};
use crate::cluster::{from_queue, queue_lease, to_queue};
use crate::ports::{Clock, CoordError, Coordinator};
use crate::tasks::TaskGuard;

/// What this replica is to a model's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It holds the lease with `fence`: it decides until `until` (its own clock: past it,
    /// with no renewal since, the lease may be another's and it dispatches nothing).
    Owner {
        /// The lease's fencing token.
        fence: u64,
        /// When the lease may have run out.
        until: Instant,
    },
    /// Another replica holds it, or nobody does yet.
    Follower,
}

/// The cluster side of one model's queue, shared by its lease task and each incarnation of
/// its actor.
#[derive(Debug)]
pub struct QueueCluster {
    /// Leases and pub/sub.
    pub coordinator: Arc<dyn Coordinator>,
    /// This replica.
    pub replica_id: String,
    /// The lease's time to live; it is renewed three times within it.
    pub lease_ttl: Duration,
    shared: Mutex<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    role: Option<Role>,
    owner: Option<QueueOwner>,
    incarnation: u64,
    /// When a follower last asked this replica's queue anything (it owned the queue then).
    peer_heard: Option<Instant>,
}

impl QueueCluster {
    /// The cluster side of a queue on `replica_id`.
    pub fn new(coordinator: Arc<dyn Coordinator>, replica_id: String, lease_ttl: Duration) -> Self {
        Self {
            coordinator,
            replica_id,
            lease_ttl,
            shared: Mutex::new(Shared::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new actor incarnation starts: its number, the role and the owner last heard of.
    pub(super) fn incarnate(&self) -> (u64, Role, Option<QueueOwner>) {
        let mut s = self.lock();
        s.incarnation += 1;
        (
            s.incarnation,
            s.role.unwrap_or(Role::Follower),
            s.owner.clone(),
        )
    }

    /// Announces this replica as the owner now (a restarted owner actor, whose followers
    /// must send it what they had sent its previous incarnation).
    pub(super) fn announce_now(self: &Arc<Self>, model: &str) {
        let (cluster, model) = (self.clone(), model.to_owned());
        tokio::spawn(async move {
            if let Err(e) = cluster.announce(&model).await {
                tracing::warn!(model, error = %e, "could not announce the queue's owner");
            }
        });
    }

    /// A follower asked this replica's queue something.
    pub(super) fn peer_heard(&self, now: Instant) {
        self.lock().peer_heard = Some(now);
    }

    /// Whether a follower asked anything within the last lease.
    pub(super) fn has_peers(&self, now: Instant) -> bool {
        self.lock()
            .peer_heard
            .is_some_and(|at| now.saturating_duration_since(at) < self.lease_ttl)
    }

    /// The owner last announced (by any replica, this one included).
    pub(super) fn last_owner(&self) -> Option<QueueOwner> {
        self.lock().owner.clone()
    }

    /// How often the lease is renewed (and followers report).
    pub fn period(&self) -> Duration {
        (self.lease_ttl / 3).max(Duration::from_millis(10))
    }

    /// Keeps the lease of `handle`'s model (or follows its owner) until the handle is
    /// stopped; then gives the lease up, so another replica takes over at once. Returns once
    /// the first attempt at the lease is over (a replica starts knowing its role), or after
    /// one lease time.
    pub async fn spawn(self: &Arc<Self>, handle: ModelQueueHandle, clock: Arc<dyn Clock>) {
        let cluster = self.clone();
        let (first, tried) = tokio::sync::oneshot::channel();
        let mut first = Some(first);
        tokio::spawn(async move {
            let _guard = TaskGuard::new("queue_lease");
            let mut stopped = handle.stopped();
            let mut pause = Duration::from_millis(100);
            loop {
                let mut renewed = false;
                let run = cluster.run(&handle, &clock, &mut first, &mut renewed);
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => break,
                    result = run => {
                        if let Err(e) = result {
                            tracing::warn!(model = handle.model(), error = %e, "lost the queue's cluster channels; subscribing again");
                        }
                    }
                }
                // The role stands: an owner keeps deciding until its lease may have run out
                // (the actor checks `until`), and the next renewal says what it is.
                if renewed {
                    pause = Duration::from_millis(100);
                }
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => break,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            let lease = queue_lease(handle.model());
            let _ = cluster
                .coordinator
                .release_lease(&lease, &cluster.replica_id)
                .await;
        });
        // Bounded: an unreachable coordinator delays the start by a lease, not forever.
        let _ = tokio::time::timeout(self.lease_ttl, tried).await;
    }

    /// Subscribes, then renews the lease every period and passes what is heard to the queue,
    /// until a subscription ends.
    async fn run(
        &self,
        handle: &ModelQueueHandle,
        clock: &Arc<dyn Clock>,
        first: &mut Option<tokio::sync::oneshot::Sender<()>>,
        renewed: &mut bool,
    ) -> Result<(), CoordError> {
        let model = handle.model().to_owned();
        let mut owners = self.coordinator.subscribe(QUEUE_OWNERS_CHANNEL).await?;
        let mut replies = self
            .coordinator
            .subscribe(&from_queue(&model, &self.replica_id))
            .await?;
        let hello = QueueNews::Hello {
            model: model.clone(),
        };
        if let Ok(payload) = serde_json::to_vec(&hello) {
            self.coordinator
                .publish(QUEUE_OWNERS_CHANNEL, payload)
                .await?;
        }
        // Heard only while this replica owns the queue.
        let mut asks: Option<(u64, UnboundedReceiver<Vec<u8>>)> = None;
        let mut tick = tokio::time::interval(self.period());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let result = self.renew(handle, clock, &mut asks).await;
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                    }
                    result?;
                    *renewed = true;
                }
                msg = owners.recv() => {
                    let payload = msg.ok_or_else(|| CoordError::Unavailable("subscription ended".into()))?;
                    match serde_json::from_slice::<QueueNews>(&payload) {
                        Ok(QueueNews::Owner(owner)) if owner.model == model => {
                            {
                                let mut s = self.lock();
                                // An owner older than the one known is out of date.
                                if s.owner.as_ref().is_none_or(|o| o.fence <= owner.fence) {
                                    s.owner = Some(owner.clone());
                                }
                            }
                            handle.cast(QueueMsg::Owner(owner));
                        }
                        Ok(QueueNews::Hello { model: m }) if m == model => self.announce(&model).await?,
                        Ok(_) => {}
                        Err(_) => tracing::warn!(bytes = payload.len(), "unreadable queue owner announcement"),
                    }
                }
                msg = replies.recv() => {
                    let payload = msg.ok_or_else(|| CoordError::Unavailable("subscription ended".into()))?;
                    match serde_json::from_slice::<FromQueue>(&payload) {
                        Ok(replies) => handle.cast(QueueMsg::Replies(replies)),
                        Err(_) => tracing::warn!(bytes = payload.len(), "unreadable message from a queue owner"),
                    }
                }
                msg = async {
                    match asks.as_mut() {
                        Some((_, rx)) => rx.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match msg {
                        Some(payload) => match serde_json::from_slice::<ToQueue>(&payload) {
                            Ok(asked) => handle.cast(QueueMsg::Remote(asked)),
                            Err(_) => tracing::warn!(bytes = payload.len(), "unreadable message for a queue owner"),
                        },
                        // Heard again at the next renewal.
                        None => asks = None,
                    }
                }
            }
        }
    }

    /// Takes or renews the lease, tells the queue its role, and announces an owner.
    async fn renew(
        &self,
        handle: &ModelQueueHandle,
        clock: &Arc<dyn Clock>,
        asks: &mut Option<(u64, UnboundedReceiver<Vec<u8>>)>,
    ) -> Result<(), CoordError> {
        let model = handle.model();
        let started = clock.now();
        let lease = queue_lease(model);
        if !handle.is_bound() {
            // No queue actor to decide (awaiting a restart, or given up): another replica's
            // should.
            if matches!(self.lock().role, Some(Role::Owner { .. })) {
                self.coordinator
                    .release_lease(&lease, &self.replica_id)
                    .await?;
            }
            *asks = None;
            self.set_role(handle, Role::Follower);
            return Ok(());
        }
        match self
            .coordinator
            .acquire_lease(&lease, &self.replica_id, self.lease_ttl)
            .await
        {
            Ok(Some(fence)) => {
                if asks.as_ref().is_none_or(|(f, _)| *f != fence) {
                    // Subscribed before deciding anything, so no ask sent to the new owner
                    // is missed.
                    *asks = Some((fence, self.coordinator.subscribe(&to_queue(model)).await?));
                }
                let until = started + self.lease_ttl;
                self.set_role(handle, Role::Owner { fence, until });
                self.announce(model).await?;
            }
            Ok(None) => {
                *asks = None;
                self.set_role(handle, Role::Follower);
            }
            // Still the owner until the lease may have run out (the actor checks `until`).
            Err(e) => tracing::warn!(model, error = %e, "could not renew the queue's lease"),
        }
        Ok(())
    }

    /// Says this replica owns `model`'s queue, if it does.
    async fn announce(&self, model: &str) -> Result<(), CoordError> {
        let (role, incarnation) = {
            let s = self.lock();
            (s.role, s.incarnation)
        };
        let Some(Role::Owner { fence, .. }) = role else {
            return Ok(());
        };
        let news = QueueNews::Owner(QueueOwner {
            model: model.to_owned(),
            replica: self.replica_id.clone(),
            fence,
            incarnation,
        });
        if let Ok(payload) = serde_json::to_vec(&news) {
            self.coordinator
                .publish(QUEUE_OWNERS_CHANNEL, payload)
                .await?;
        }
        Ok(())
    }

    fn set_role(&self, handle: &ModelQueueHandle, role: Role) {
        self.lock().role = Some(role);
        handle.cast(QueueMsg::Role(role));
    }
}
