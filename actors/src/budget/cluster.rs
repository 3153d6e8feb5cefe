//! A team's budget in a cluster: one replica decides a team's reservations at a time, the
//! holder of the lease `budget:{team}`, so a team's reservations meet in one actor and commit
//! in its batches. Other replicas ask it over [`crate::cluster::to_budget`] and wait for its
//! answer; a replica takes the lease itself when nobody holds it (teams are spread over the
//! replicas their traffic enters first).
//!
//! PostgreSQL remains the judge of every reservation (one locked row per team), so a lease
//! that changes hands mid-batch, or a replica deciding while the owner is unreachable, can
//! cost batching but never money: no team goes beyond its balance whoever commits.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::supervisor::TeamBudgets;
use crate::cluster::{budget_lease, to_budget};
use crate::ports::{Clock, Coordinator, LedgerError, Reservation};
use crate::tasks::TaskGuard;

/// Entries kept in the lease and owner caches before expired ones are pruned.
const PRUNE_ABOVE: usize = 4096;

/// On [`to_budget`]: a question for the replica owning a team's budget, or its answer.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BudgetWire {
    /// Decide this reservation.
    Ask {
        /// Names the answer.
        id: u64,
        /// Where the answer goes.
        from: String,
        /// The row to open.
        reservation: Box<Reservation>,
    },
    /// The answer to ask `id`.
    Answer {
        /// The ask it answers.
        id: u64,
        /// The reservation's request, checked against the ask (ids restart with a process).
        request_id: String,
        /// What became of it.
        answer: Answer,
    },
}

/// What the owner said.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Answer {
    /// Decided, as [`crate::ports::Ledger::reserve`] would answer.
    Decided(Result<(), LedgerError>),
    /// It does not own the team's budget (any more): ask again.
    NotOwner,
}

/// How an ask ended.
#[derive(Debug)]
pub(super) enum Asked {
    /// The owner answered.
    Answered(Answer),
    /// Nobody heard it (that replica is gone): deciding it elsewhere cannot run it twice.
    Unheard,
    /// Heard, but the owner lost the team's lease before answering (it died or was cut
    /// off): it may have opened the row before it went.
    Unanswered,
}

/// Who decides a team's reservations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Route {
    /// This replica holds the lease.
    Here,
    /// Another replica does.
    There(String),
}

/// The cluster side of the team budgets of one replica.
#[derive(Debug)]
pub struct BudgetCluster {
    coordinator: Arc<dyn Coordinator>,
    replica_id: String,
    lease_ttl: Duration,
    clock: Arc<dyn Clock>,
    /// Teams whose lease this replica holds, until when.
    held: Mutex<BTreeMap<i64, Instant>>,
    /// Teams another replica owns, as last looked up (trusted for a third of a lease).
    known: Mutex<BTreeMap<i64, (String, Instant)>>,
    /// Asks waiting for their answer, with their request id.
    waiting: Mutex<BTreeMap<u64, (String, oneshot::Sender<Answer>)>>,
    next_ask: AtomicU64,
    stopped: watch::Sender<bool>,
}

fn unavailable(e: impl std::fmt::Display) -> LedgerError {
    LedgerError::Unavailable(e.to_string())
}

impl BudgetCluster {
    /// The cluster side of `replica_id`'s team budgets.
    pub fn new(
        coordinator: Arc<dyn Coordinator>,
        replica_id: String,
        lease_ttl: Duration,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            coordinator,
            replica_id,
            lease_ttl,
            clock,
            held: Mutex::new(BTreeMap::new()),
            known: Mutex::new(BTreeMap::new()),
            waiting: Mutex::new(BTreeMap::new()),
            next_ask: AtomicU64::new(1),
            stopped: watch::Sender::new(false),
        }
    }

    /// Who decides `team_id`'s reservations now: this replica if it holds the lease (taken
    /// now if nobody does, renewed when half of it has passed), else the holder.
    pub(super) async fn route(&self, team_id: i64) -> Result<Route, LedgerError> {
        let now = self.clock.now();
        let renew_after = self.lease_ttl / 2;
        if lock(&self.held)
            .get(&team_id)
            .is_some_and(|until| now + renew_after < *until)
        {
            return Ok(Route::Here);
        }
        if let Some((owner, _)) = lock(&self.known)
            .get(&team_id)
            .filter(|(_, at)| now.saturating_duration_since(*at) < self.lease_ttl / 3)
        {
            return Ok(Route::There(owner.clone()));
        }
        let lease = budget_lease(team_id);
        for _ in 0..3 {
            let started = self.clock.now();
            let acquired = self
                .coordinator
                .acquire_lease(&lease, &self.replica_id, self.lease_ttl)
                .await
                .map_err(unavailable)?;
            if acquired.is_some() {
                remember(&self.held, team_id, started + self.lease_ttl, started);
                lock(&self.known).remove(&team_id);
                return Ok(Route::Here);
            }
            lock(&self.held).remove(&team_id);
            match self
                .coordinator
                .lease_holder(&lease)
                .await
                .map_err(unavailable)?
            {
                Some(owner) if owner != self.replica_id => {
                    remember(&self.known, team_id, (owner.clone(), started), started);
                    return Ok(Route::There(owner));
                }
                // It expired (or was released) in between: try again.
                _ => {}
            }
        }
        Err(unavailable("the team's budget keeps changing hands"))
    }

    /// Forgets what was known of `team_id`'s owner (it said it is not the owner).
    pub(super) fn forget(&self, team_id: i64) {
        lock(&self.known).remove(&team_id);
    }

    /// Asks `replica` to decide `reservation`, waiting at most `timeout` for the answer (then
    /// the ledger counts as unavailable), or until the replica loses the team's lease.
    pub(super) async fn ask(
        &self,
        replica: &str,
        reservation: &Reservation,
        timeout: Duration,
    ) -> Result<Asked, LedgerError> {
        let id = self.next_ask.fetch_add(1, Ordering::Relaxed);
        let ask = BudgetWire::Ask {
            id,
            from: self.replica_id.clone(),
            reservation: Box::new(reservation.clone()),
        };
        let payload = serde_json::to_vec(&ask).map_err(unavailable)?;
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(id, (reservation.request_id.clone(), tx));
        match self.coordinator.publish(&to_budget(replica), payload).await {
            Ok(0) => {
                lock(&self.waiting).remove(&id);
                self.forget(reservation.team_id);
                return Ok(Asked::Unheard);
            }
            Ok(_) => {}
            Err(e) => {
                lock(&self.waiting).remove(&id);
                return Err(unavailable(e));
            }
        }
        let answered = tokio::select! {
            answer = tokio::time::timeout(timeout, rx) => match answer {
                Ok(Ok(answer)) => Some(answer),
                _ => {
                    lock(&self.waiting).remove(&id);
                    return Err(unavailable("the team's budget owner did not answer in time"));
                }
            },
            () = self.lease_leaves(replica, reservation.team_id) => None,
        };
        if let Some(answer) = answered {
            return Ok(Asked::Answered(answer));
        }
        lock(&self.waiting).remove(&id);
        self.forget(reservation.team_id);
        tracing::warn!(
            team_id = reservation.team_id,
            owner = replica,
            "the team's budget owner lost its lease before answering; asking its successor"
        );
        Ok(Asked::Unanswered)
    }

    /// Returns once `replica` no longer holds `team_id`'s lease (checked every third of a
    /// lease); never while the lease cannot be read.
    async fn lease_leaves(&self, replica: &str, team_id: i64) {
        let lease = budget_lease(team_id);
        loop {
            tokio::time::sleep(self.lease_ttl / 3).await;
            if let Ok(holder) = self.coordinator.lease_holder(&lease).await
                && holder.as_deref() != Some(replica)
            {
                return;
            }
        }
    }

    /// Stops listening.
    pub fn stop(&self) {
        self.stopped.send_replace(true);
    }

    /// Listens on this replica's budget channel until [`BudgetCluster::stop`]: asks are
    /// decided by `budgets` (when this replica owns the team), answers go to their callers.
    pub async fn spawn(self: &Arc<Self>, budgets: Arc<TeamBudgets>) {
        let cluster = self.clone();
        let (ready, subscribed) = oneshot::channel();
        let mut ready = Some(ready);
        tokio::spawn(async move {
            let _guard = TaskGuard::new("budget_channel");
            let mut stopped = cluster.stopped.subscribe();
            let mut pause = Duration::from_millis(100);
            loop {
                match cluster
                    .coordinator
                    .subscribe(&to_budget(&cluster.replica_id))
                    .await
                {
                    Ok(mut rx) => {
                        pause = Duration::from_millis(100);
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(());
                        }
                        loop {
                            tokio::select! {
                                _ = stopped.wait_for(|s| *s) => return,
                                msg = rx.recv() => match msg {
                                    Some(payload) => cluster.heard(&budgets, &payload),
                                    None => break,
                                },
                            }
                        }
                        tracing::warn!("lost the team budgets' channel; subscribing again");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot hear the team budgets' channel; retrying");
                    }
                }
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        });
        let _ = tokio::time::timeout(self.lease_ttl, subscribed).await;
    }

    fn heard(self: &Arc<Self>, budgets: &Arc<TeamBudgets>, payload: &[u8]) {
        match serde_json::from_slice::<BudgetWire>(payload) {
            Ok(BudgetWire::Answer {
                id,
                request_id,
                answer,
            }) => {
                let mut waiting = lock(&self.waiting);
                if waiting.get(&id).is_some_and(|(r, _)| *r == request_id)
                    && let Some((_, waiter)) = waiting.remove(&id)
                {
                    let _ = waiter.send(answer);
                }
            }
            Ok(BudgetWire::Ask {
                id,
                from,
                reservation,
            }) => {
                let (cluster, budgets) = (self.clone(), budgets.clone());
                tokio::spawn(async move {
                    let answer = match cluster.route(reservation.team_id).await {
                        Ok(Route::Here) => {
                            Answer::Decided(budgets.reserve_here(&reservation).await)
                        }
                        Ok(Route::There(_)) => Answer::NotOwner,
                        Err(e) => Answer::Decided(Err(e)),
                    };
                    let request_id = reservation.request_id.clone();
                    let reply = BudgetWire::Answer {
                        id,
                        request_id,
                        answer,
                    };
                    if let Ok(payload) = serde_json::to_vec(&reply)
                        && let Err(e) = cluster
                            .coordinator
                            .publish(&to_budget(&from), payload)
                            .await
                    {
                        tracing::warn!(error = %e, "could not answer a budget ask");
                    }
                });
            }
            Err(_) => tracing::warn!(bytes = payload.len(), "unreadable team budget message"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Inserts into a per-team cache, pruning expired entries once it grows large.
fn remember<V>(cache: &Mutex<BTreeMap<i64, V>>, team_id: i64, value: V, now: Instant)
where
    V: Expiring,
{
    let mut cache = lock(cache);
    if cache.len() > PRUNE_ABOVE {
        cache.retain(|_, v| !v.expired(now));
    }
    cache.insert(team_id, value);
}

/// A cache entry that expires.
trait Expiring {
    fn expired(&self, now: Instant) -> bool;
}

impl Expiring for Instant {
    fn expired(&self, now: Instant) -> bool {
        *self <= now
    }
}

impl Expiring for (String, Instant) {
    fn expired(&self, now: Instant) -> bool {
        // Looked up more than a minute ago: stale whatever the lease time.
        now.saturating_duration_since(self.1) > Duration::from_secs(60)
    }
}
