//! What a queue does as a member of a cluster (see [`super::cluster`]): as a follower it
//! forwards its generations to the owner and runs what the owner dispatches to them; as the
//! owner it decides for every replica's generations and counts every replica's assignments.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use ractor::{ActorRef, RpcReplyPort};
use tokio::time::Instant;

use super::actor::{Join, QueueState, Waiter, Waiting};
use super::cluster::{QueueCluster, Role};
use super::grant::Grants;
use super::line::Ticket;
use super::msg::{QueueMsg, Slot};
use super::routing::RouteKey;
use crate::cluster::to_queue;
use crate::cluster::{FromQueue, OnFailure, Outbox, QueueItem, QueueOwner, QueueReply, ToQueue};
use crate::error::{ErrorCode, Failure};
use crate::generation::GenerationMsg;
use crate::metric_names::QUEUE_FENCED_TOTAL;
use crate::protocol::Api;

/// How long a forwarded enqueue waits for the owner's verdict before it is taken to wait
/// anyway (see [`QueueState::expire_forwarded`]).
const VERDICT_WAIT: Duration = Duration::from_secs(4);
/// A forwarded generation outlives its deadline by this much before this replica times it
/// out itself (the owner normally does it first).
const DEADLINE_GRACE: Duration = Duration::from_secs(1);

/// A generation of this replica waiting in another replica's queue.
#[derive(Debug)]
pub(super) struct Forwarded {
    generation: ActorRef<GenerationMsg>,
    front: bool,
    avoid: Option<String>,
    api: Api,
    route: Option<Arc<RouteKey>>,
    ticket: Ticket,
    /// When it entered this model's queue (sent on to each new owner as how long it waited).
    since: Instant,
    deadline: Instant,
    /// The generation's enqueue call, until the owner's verdict (and when it was asked).
    verdict: Option<(RpcReplyPort<Result<(), Failure>>, Instant)>,
}

impl Forwarded {
    /// Its enqueue, as sent to an owner at `now`.
    fn enqueue(&self, request_id: &str, now: Instant) -> QueueItem {
        let waited = now.saturating_duration_since(self.since);
        QueueItem::Enqueue {
            request_id: request_id.to_owned(),
            front: self.front,
            avoid: self.avoid.clone(),
            api: self.api,
            route: self.route.clone(),
            waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            ticket: self.ticket,
        }
    }
}

/// What a local generation asks of the queue (see [`super::QueueMsg::Enqueue`]).
#[derive(Debug)]
pub(super) struct Asked {
    pub(super) generation: ActorRef<GenerationMsg>,
    pub(super) front: bool,
    pub(super) avoid: Option<String>,
    pub(super) api: Api,
    pub(super) route: Option<Arc<RouteKey>>,
    pub(super) ticket: Ticket,
}

/// Another replica, as the owner sees it.
#[derive(Debug)]
pub(super) struct Follower {
    pub(super) outbox: Outbox<QueueReply>,
    /// Names this record in its dispatches (unique within the owner's fence).
    pub(super) epoch: u64,
    /// Dispatches sent to it.
    pub(super) sent: u64,
    /// Dispatches and grants (number, node, slots granted: 0 for a dispatch, when sent) its
    /// last report had not seen yet.
    pub(super) unreported: VecDeque<(u64, String, u32, Instant)>,
    /// When it last said anything (it reports every lease period).
    pub(super) heard: Instant,
}

/// A queue's membership of the cluster.
#[derive(Debug)]
pub(super) struct Membership {
    pub(super) cluster: Arc<QueueCluster>,
    pub(super) myself: ActorRef<QueueMsg>,
    pub(super) incarnation: u64,
    pub(super) role: Role,
    /// The newest lease token heard of: anything an older owner sends is dropped.
    newest: u64,
    /// As a follower: the owner it synced with, and the way to it.
    owner: Option<QueueOwner>,
    to_owner: Option<Outbox<QueueItem>>,
    forwarded: BTreeMap<String, Forwarded>,
    /// The last dispatch heard: (fence, epoch, n).
    seen: Option<(u64, u64, u64)>,
    /// As the owner: the other replicas that asked.
    pub(super) followers: BTreeMap<String, Follower>,
    /// Follower records started by this incarnation (their epochs).
    pub(super) records: u64,
    /// After a takeover: no dispatch before this, so the followers' reports arrive first.
    hold_until: Option<Instant>,
    /// Capacity lent by the owner (see [`super::grant`]).
    pub(super) grants: Grants,
}

impl Membership {
    /// A new incarnation of the queue actor `myself`.
    pub(super) fn new(
        cluster: Arc<QueueCluster>,
        myself: ActorRef<QueueMsg>,
        model: &str,
        now: Instant,
    ) -> Self {
        let (incarnation, role, owner) = cluster.incarnate();
        let newest = match role {
            Role::Owner { fence, .. } => fence,
            Role::Follower => 0,
        }
        .max(owner.as_ref().map_or(0, |o| o.fence));
        let mut hold_until = None;
        if let Role::Owner { .. } = role {
            // A restarted owner knows only its own assignments: it says so at once, and
            // dispatches once its followers, if it has any, had a period to report theirs.
            cluster.announce_now(model);
            if cluster.has_peers(now) {
                hold_until = Some(now + cluster.period());
            }
        } else if let Some(owner) = owner {
            // Synced with at once: a restarted follower forwards without waiting for the
            // next announcement.
            let _ = myself.cast(QueueMsg::Owner(owner));
        }
        Self {
            cluster,
            myself,
            incarnation,
            role,
            newest,
            owner: None,
            to_owner: None,
            forwarded: BTreeMap::new(),
            seen: None,
            followers: BTreeMap::new(),
            records: 0,
            hold_until,
            grants: Grants::default(),
        }
    }

    /// As the owner: the replicas following the queue.
    pub(super) fn followers(&self) -> impl Iterator<Item = String> + '_ {
        self.followers.keys().cloned()
    }
}

impl QueueState {
    /// Another replica decides: this one forwards.
    pub(super) fn follows(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|m| m.role == Role::Follower)
    }

    /// This replica may dispatch now: it runs alone, or holds a lease that cannot have run
    /// out yet.
    pub(super) fn decides(&self) -> bool {
        let now = self.args.clock.now();
        match &self.cluster {
            None => true,
            Some(m) => match m.role {
                Role::Owner { until, .. } => {
                    now < until && m.hold_until.is_none_or(|hold| hold <= now)
                }
                Role::Follower => false,
            },
        }
    }

    /// The owner's replica, as far as this one knows.
    pub(super) fn owner(&self) -> Option<String> {
        let m = self.cluster.as_ref()?;
        match m.role {
            Role::Owner { .. } => Some(self.me.clone()),
            Role::Follower => m.owner.as_ref().map(|o| o.replica.clone()),
        }
    }

    /// This replica's generations waiting in another replica's queue.
    pub(super) fn forwarded(&self) -> usize {
        self.cluster.as_ref().map_or(0, |m| m.forwarded.len())
    }

    /// Whether `request_id` waits in the owner's queue already.
    pub(super) fn is_forwarded(&self, request_id: &str) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|m| m.forwarded.contains_key(request_id))
    }

    /// A local generation enters the owner's queue; answered with the owner's verdict.
    pub(super) fn forward(
        &mut self,
        request_id: String,
        asked: Asked,
        reply: RpcReplyPort<Result<(), Failure>>,
    ) {
        let Asked {
            generation,
            front,
            avoid,
            api,
            route,
            ticket,
        } = asked;
        let now = self.args.clock.now();
        let deadline = now + self.budget(ticket.tier) + DEADLINE_GRACE;
        let refused = self.unroutable(api);
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        if m.forwarded.contains_key(&request_id) {
            let _ = reply.send(Ok(()));
            return;
        }
        if let Some(failure) = refused {
            // Every replica sees every node: no node, no need to ask.
            let _ = reply.send(Err(failure));
            return;
        }
        let item = QueueItem::Enqueue {
            request_id: request_id.clone(),
            front,
            avoid: avoid.clone(),
            api,
            route: route.clone(),
            waited_ms: 0,
            ticket,
        };
        m.forwarded.insert(
            request_id,
            Forwarded {
                generation,
                front,
                avoid,
                api,
                route,
                ticket,
                since: now,
                deadline,
                verdict: Some((reply, now)),
            },
        );
        // With no owner known yet it is sent when one is.
        self.tell_owner(item);
    }

    /// A forwarded generation left.
    pub(super) fn withdraw_forwarded(&mut self, request_id: &str) {
        if let Some(m) = self.cluster.as_mut()
            && m.forwarded.remove(request_id).is_some()
        {
            self.tell_owner(QueueItem::Withdraw {
                request_id: request_id.to_owned(),
            });
        }
    }

    /// Sends the owner every generation of this replica still waiting (it ignores those it
    /// holds already), oldest first and with how long each waited, so the owner keeps every
    /// replica's generations in the order they came.
    fn resend_forwarded(&mut self) {
        let now = self.args.clock.now();
        let Some(m) = self.cluster.as_ref() else {
            return;
        };
        let mut waiting: Vec<(&String, &Forwarded)> = m.forwarded.iter().collect();
        waiting.sort_by_key(|(_, f)| f.since);
        let again: Vec<QueueItem> = waiting
            .into_iter()
            .map(|(request_id, f)| f.enqueue(request_id, now))
            .collect();
        for item in again {
            self.tell_owner(item);
        }
    }

    /// Sends `item` to the owner, if one is known.
    pub(super) fn tell_owner(&mut self, item: QueueItem) {
        if let Some(outbox) = self.cluster.as_ref().and_then(|m| m.to_owner.as_ref()) {
            let _ = outbox.push(item);
        }
    }

    /// As the owner: sends `reply` to a follower.
    pub(super) fn tell_replica(&mut self, replica: &str, reply: QueueReply) {
        if let Some(f) = self
            .cluster
            .as_mut()
            .and_then(|m| m.followers.get_mut(replica))
        {
            let _ = f.outbox.push(reply);
        }
    }

    /// As the owner: dispatches a follower's generation; false when the follower is gone.
    pub(super) fn dispatch_remote(
        &mut self,
        replica: &str,
        request_id: String,
        node: &str,
    ) -> bool {
        let node_id = node.to_owned();
        let sent = self.send_numbered(replica, node, 0, |epoch, n| QueueReply::Dispatch {
            request_id,
            node_id,
            epoch,
            n,
        });
        let now = self.args.clock.now();
        if sent && let Some(n) = self.nodes.get_mut(node) {
            n.take(replica, now);
        }
        sent
    }

    /// As the owner: lends `slots` of `node` to a follower; false when it is gone (the
    /// caller counts them as lent only when sent).
    pub(super) fn grant_remote(&mut self, replica: &str, node: &str, slots: u32) -> bool {
        let node_id = node.to_owned();
        self.send_numbered(replica, node, slots, |epoch, n| QueueReply::Grant {
            node_id,
            slots,
            epoch,
            n,
        })
    }

    /// Sends a follower the next numbered reply (a dispatch, or a grant of `slots`), and
    /// keeps it as unreported until the follower's report has seen it.
    fn send_numbered(
        &mut self,
        replica: &str,
        node: &str,
        slots: u32,
        reply: impl FnOnce(u64, u64) -> QueueReply,
    ) -> bool {
        let Some(f) = self
            .cluster
            .as_mut()
            .and_then(|m| m.followers.get_mut(replica))
        else {
            return false;
        };
        if !f.outbox.push(reply(f.epoch, f.sent + 1)) {
            return false;
        }
        f.sent += 1;
        let now = self.args.clock.now();
        f.unreported
            .push_back((f.sent, node.to_owned(), slots, now));
        true
    }

    /// Periodic: forwarded generations past their deadline end; one with no verdict in time
    /// waits anyway, as admitted, while some node can run it (the owner died with its
    /// enqueue, or changes hands: the next owner gets it with the rest, and a late refusal
    /// still ends it) — refused for want of an owner, it would fail with two healthy nodes;
    /// as the owner, followers silent for a lease period are forgotten.
    pub(super) fn expire_forwarded(&mut self) {
        let now = self.args.clock.now();
        let model = self.args.model.clone();
        let routable: Vec<Api> = [Api::Chat, Api::Completions, Api::Embeddings]
            .into_iter()
            .filter(|api| self.unroutable(*api).is_none())
            .collect();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        for f in m.forwarded.values_mut() {
            let late = f
                .verdict
                .as_ref()
                .is_some_and(|(_, at)| now.saturating_duration_since(*at) > VERDICT_WAIT);
            if late
                && f.deadline > now
                && routable.contains(&f.api)
                && let Some((reply, _)) = f.verdict.take()
            {
                let _ = reply.send(Ok(()));
            }
        }
        let silent_after = m.cluster.lease_ttl + m.cluster.period();
        let silent: Vec<String> = m
            .followers
            .iter()
            .filter(|(_, f)| now.saturating_duration_since(f.heard) > silent_after)
            .map(|(r, _)| r.clone())
            .collect();
        let late: Vec<String> = m
            .forwarded
            .iter()
            .filter(|(_, f)| {
                f.deadline <= now
                    || f.verdict
                        .as_ref()
                        .is_some_and(|(_, at)| now.saturating_duration_since(*at) > VERDICT_WAIT)
            })
            .map(|(id, _)| id.clone())
            .collect();
        let late: Vec<(String, Forwarded)> = late
            .into_iter()
            .filter_map(|id| m.forwarded.remove(&id).map(|f| (id, f)))
            .collect();
        for (request_id, f) in late {
            match f.verdict {
                Some((reply, _)) => {
                    let failure = Failure::new(
                        ErrorCode::NoHealthyNode,
                        format!("The queue of {model} is changing hands; retry in a moment."),
                    )
                    .retry_after(1);
                    let _ = reply.send(Err(failure));
                }
                None => {
                    let _ = f.generation.cast(GenerationMsg::QueueTimeout);
                }
            }
            self.tell_owner(QueueItem::Withdraw { request_id });
        }
        for replica in silent {
            tracing::info!(model = %model, %replica, "a replica following this queue went silent; forgetting its work");
            self.forget_replica(&replica);
        }
    }

    /// The lease task's news.
    pub(super) fn role(&mut self, role: Role) {
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        match (m.role, role) {
            (Role::Owner { fence: a, .. }, Role::Owner { fence: b, .. }) if a == b => {
                m.role = role;
            }
            // A renewal heard after a newer owner was: out of date.
            (_, Role::Owner { fence, .. }) if fence < m.newest => {}
            (_, Role::Owner { fence, .. }) => {
                // Another replica owned it before: its followers report what runs on them
                // before this replica dispatches (a fresh cluster's first owner starts at
                // once).
                if m.newest > 0 {
                    m.hold_until = Some(self.args.clock.now() + m.cluster.period());
                }
                m.role = role;
                m.newest = m.newest.max(fence);
                self.take_over();
            }
            (Role::Owner { .. }, Role::Follower) => self.step_down(),
            (Role::Follower, Role::Follower) => {}
        }
    }

    /// This replica got the lease: its forwarded generations join the queue, and it counts
    /// only its own assignments until the followers report theirs.
    fn take_over(&mut self) {
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        tracing::info!(model = %self.args.model, "this replica owns the model's queue now");
        m.owner = None;
        m.to_owner = None;
        m.followers.clear();
        let forwarded = std::mem::take(&mut m.forwarded);
        self.drop_grants();
        let me = self.me.clone();
        for n in self.nodes.values_mut() {
            n.running.retain(|r, _| *r == me);
            n.granted.clear();
            n.recalled = None;
        }
        let now = self.args.clock.now();
        let mut forwarded: Vec<(String, Forwarded)> = forwarded.into_iter().collect();
        forwarded.sort_by_key(|(_, f)| f.since);
        for (request_id, f) in forwarded {
            let waiter = Waiter::Local(f.generation);
            match f.verdict {
                Some((reply, _)) => {
                    let join = Join {
                        front: f.front,
                        avoid: f.avoid,
                        api: f.api,
                        route: f.route,
                        waited: now.saturating_duration_since(f.since),
                        ticket: f.ticket,
                    };
                    let verdict = self.admit(request_id, waiter, join);
                    let _ = reply.send(verdict);
                }
                None => {
                    let entry = Waiting {
                        request_id,
                        waiter,
                        arrived: f.since,
                        deadline: f.deadline,
                        avoid: f.avoid,
                        api: f.api,
                        route: f.route,
                        passed: 0,
                        ticket: f.ticket,
                    };
                    self.line.push(entry, f.front);
                }
            }
        }
    }

    /// This replica lost the lease: its own waiting generations wait for the next owner;
    /// the others' are theirs to send again.
    fn step_down(&mut self) {
        let now = self.args.clock.now();
        let policy = self.args.config.policy.clone();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        tracing::info!(model = %self.args.model, "this replica no longer owns the model's queue");
        m.role = Role::Follower;
        m.followers.clear();
        m.owner = None;
        m.to_owner = None;
        for w in self.line.drain() {
            let deadline = now + policy.of(w.ticket.tier).budget;
            if let Waiter::Local(generation) = w.waiter {
                m.forwarded.insert(
                    w.request_id,
                    // In line by when it came, as the next owner places every replica's.
                    Forwarded {
                        generation,
                        front: false,
                        avoid: w.avoid,
                        api: w.api,
                        route: w.route,
                        ticket: w.ticket,
                        since: w.arrived,
                        deadline: w.deadline.min(deadline),
                        verdict: None,
                    },
                );
            }
        }
        let last = m.cluster.last_owner();
        let me = self.me.clone();
        for n in self.nodes.values_mut() {
            n.running.retain(|r, _| *r == me);
            n.granted.clear();
            n.recalled = None;
        }
        if let Some(owner) = last {
            self.owner_heard(owner);
        }
    }

    /// An owner announced itself: a follower that sees a new one sends it its waiting
    /// generations; every announcement gets a report of what runs here.
    pub(super) fn owner_heard(&mut self, owner: QueueOwner) {
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        if owner.fence < m.newest {
            return;
        }
        m.newest = owner.fence;
        if owner.replica == self.me {
            return;
        }
        if let Role::Owner { fence, .. } = m.role {
            if fence >= owner.fence {
                return;
            }
            // A newer owner: this replica's lease ran out unnoticed.
            self.step_down();
        }
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        if m.owner.as_ref() != Some(&owner) || m.to_owner.is_none() {
            let gone = m.myself.clone();
            let (fence, incarnation) = (owner.fence, owner.incarnation);
            let from = self.me.clone();
            m.to_owner = Some(Outbox::spawn(
                m.cluster.coordinator.clone(),
                to_queue(&self.args.model),
                OnFailure::GiveUp,
                move |_, items| {
                    serde_json::to_vec(&ToQueue {
                        from: from.clone(),
                        items,
                    })
                    .ok()
                },
                move || {
                    let _ = gone.cast(QueueMsg::OwnerGone(fence, incarnation));
                },
            ));
            m.owner = Some(owner.clone());
            // Grants were the previous owner's (or incarnation's) to count.
            self.drop_grants();
            self.resend_forwarded();
        }
        let running: BTreeMap<String, u32> = self
            .nodes
            .iter()
            .filter_map(|(id, n)| {
                let mine = n.running.get(&self.me).copied().unwrap_or(0);
                let mine = mine.saturating_sub(self.on_grant(id));
                (mine > 0).then(|| (id.clone(), mine))
            })
            .collect();
        let seen = self
            .cluster
            .as_ref()
            .and_then(|m| m.seen)
            .filter(|(fence, _, _)| *fence == owner.fence)
            .map(|(_, epoch, n)| (epoch, n));
        let held = self.held();
        self.tell_owner(QueueItem::Report {
            fence: owner.fence,
            incarnation: owner.incarnation,
            running,
            seen,
            held,
        });
    }

    /// As a follower: the owner's answers.
    pub(super) fn replies(&mut self, replies: FromQueue) {
        let model = self.args.model.clone();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        if replies.fence < m.newest {
            // An owner that lost its lease (partitioned from the coordinator, typically):
            // nothing it decided runs.
            metrics::counter!(QUEUE_FENCED_TOTAL, "model" => model).increment(1);
            return;
        }
        m.newest = replies.fence;
        if matches!(m.role, Role::Owner { .. }) {
            return;
        }
        for reply in replies.items {
            self.reply(reply, replies.fence, &model);
        }
    }

    fn reply(&mut self, reply: QueueReply, fence: u64, model: &str) {
        let now = self.args.clock.now();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        match reply {
            QueueReply::Verdict {
                request_id,
                refused,
            } => {
                let Some(f) = m.forwarded.get_mut(&request_id) else {
                    return;
                };
                match (f.verdict.take(), refused) {
                    (Some((reply, _)), None) => {
                        let _ = reply.send(Ok(()));
                    }
                    (Some((reply, _)), Some(failure)) => {
                        let _ = reply.send(Err(failure));
                        m.forwarded.remove(&request_id);
                    }
                    // Sent again to a new owner, which refused it: it cannot wait any more.
                    (None, Some(_)) => {
                        if let Some(f) = m.forwarded.remove(&request_id) {
                            let _ = f.generation.cast(GenerationMsg::QueueTimeout);
                        }
                    }
                    (None, None) => {}
                }
            }
            QueueReply::Resync => {
                // The owner's new record of this replica counts no grant.
                self.drop_grants();
                self.resend_forwarded();
            }
            QueueReply::Grant {
                node_id,
                slots,
                epoch,
                n,
            } => {
                m.seen = Some((fence, epoch, n));
                self.granted(node_id, slots);
            }
            QueueReply::Revoke { node_id } => self.revoke(&node_id),
            QueueReply::Dispatch {
                request_id,
                node_id,
                epoch,
                n,
            } => {
                m.seen = Some((fence, epoch, n));
                let forwarded = m.forwarded.remove(&request_id);
                let node = self.nodes.get_mut(&node_id);
                match (forwarded, node) {
                    (Some(f), Some(n)) => {
                        if let Some((reply, _)) = f.verdict {
                            let _ = reply.send(Ok(()));
                        }
                        // Counted now; a dispatch that does not arrive gives its slot back
                        // (here and to the owner).
                        n.take(&self.me, now);
                        let msg = GenerationMsg::Dispatch {
                            node: n.handle.clone(),
                            slot: Slot::new(self.myself.clone(), &node_id),
                        };
                        let _ = f.generation.cast(msg);
                    }
                    (Some(f), None) => {
                        // The node left this replica's view meanwhile: wait for another.
                        let mut again = f.enqueue(&request_id, now);
                        if let QueueItem::Enqueue { front, .. } = &mut again {
                            *front = true;
                        }
                        m.forwarded.insert(request_id, f);
                        self.tell_owner(QueueItem::Released { node_id });
                        self.tell_owner(again);
                    }
                    // It left meanwhile: the slot goes back.
                    (None, _) => self.tell_owner(QueueItem::Released { node_id }),
                }
            }
            QueueReply::Timeout { request_id } => {
                if let Some(f) = m.forwarded.remove(&request_id) {
                    match f.verdict {
                        Some((reply, _)) => {
                            let failure = Failure::new(
                                ErrorCode::CapacityExhausted,
                                format!("No node of {model} had room in time."),
                            )
                            .retry_after(5);
                            let _ = reply.send(Err(failure));
                        }
                        None => {
                            let _ = f.generation.cast(GenerationMsg::QueueTimeout);
                        }
                    }
                }
            }
        }
    }

    /// Nobody heard this replica's messages to the owner (fence, incarnation).
    pub(super) fn owner_gone(&mut self, fence: u64, incarnation: u64) {
        if let Some(m) = self.cluster.as_mut()
            && m.owner
                .as_ref()
                .is_some_and(|o| o.fence == fence && o.incarnation == incarnation)
        {
            m.owner = None;
            m.to_owner = None;
            self.drop_grants();
        }
    }

    /// As the owner: a follower is gone, and its generations with it.
    pub(super) fn forget_replica(&mut self, replica: &str) {
        if let Some(m) = self.cluster.as_mut() {
            m.followers.remove(replica);
        }
        self.departed.forget(replica);
        self.line
            .remove_if(|w| matches!(&w.waiter, Waiter::Remote(r) if r == replica));
        for n in self.nodes.values_mut() {
            n.running.remove(replica);
            n.granted.remove(replica);
        }
    }

    /// The actor stops: forwarded generations end as if their deadline passed.
    pub(super) fn stop_forwarded(&mut self) {
        if let Some(m) = self.cluster.as_mut() {
            for (_, f) in std::mem::take(&mut m.forwarded) {
                if f.verdict.is_none() {
                    let _ = f.generation.cast(GenerationMsg::QueueTimeout);
                }
            }
        }
    }
}
