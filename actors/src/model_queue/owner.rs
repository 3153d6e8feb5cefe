//! As a model queue's owner: what the followers ask (their enqueues, withdrawals,
//! releases, returned grants and reports), and squaring a follower's report with what was
//! dispatched and lent to it since.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::actor::{Join, QueueState, Waiter};
use super::cluster::Role;
use super::follow::Follower;
use super::msg::QueueMsg;
use crate::cluster::{FromQueue, OnFailure, Outbox, QueueItem, QueueReply, ToQueue, from_queue};

impl QueueState {
    /// As the owner: what a follower asked.
    pub(super) fn remote(&mut self, asked: ToQueue) {
        let now = self.args.clock.now();
        let model = self.args.model.clone();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        let Role::Owner { fence, .. } = m.role else {
            // It sends again to whoever owns the queue once it hears of them.
            return;
        };
        let from = asked.from;
        if from == self.me {
            return;
        }
        let incarnation = m.incarnation;
        if !m.followers.contains_key(&from) {
            m.records += 1;
        }
        let epoch = (incarnation << 32) | (m.records & 0xffff_ffff);
        m.cluster.peer_heard(now);
        let follower = m.followers.entry(from.clone()).or_insert_with(|| {
            let gone = m.myself.clone();
            let replica = from.clone();
            let outbox = Outbox::spawn(
                m.cluster.coordinator.clone(),
                from_queue(&model, &from),
                OnFailure::GiveUp,
                move |_, items| serde_json::to_vec(&FromQueue { fence, items }).ok(),
                move || {
                    let _ = gone.cast(QueueMsg::ReplicaGone(replica));
                },
            );
            // Whatever it sent an earlier record of it is gone: it sends it again.
            let _ = outbox.push(QueueReply::Resync);
            Follower {
                outbox,
                epoch,
                sent: 0,
                unreported: VecDeque::new(),
                heard: now,
            }
        });
        follower.heard = now;
        for item in asked.items {
            match item {
                QueueItem::Enqueue {
                    request_id,
                    front,
                    avoid,
                    api,
                    route,
                    waited_ms,
                    ticket,
                } => {
                    let waiter = Waiter::Remote(from.clone());
                    let join = Join {
                        front,
                        avoid,
                        api,
                        route,
                        waited: Duration::from_millis(waited_ms),
                        ticket,
                    };
                    let verdict = self.admit(request_id.clone(), waiter, join);
                    self.tell_replica(
                        &from,
                        QueueReply::Verdict {
                            request_id,
                            refused: verdict.err(),
                        },
                    );
                }
                QueueItem::Withdraw { request_id } => {
                    self.line.remove_if(|w| {
                        w.request_id == request_id
                            && matches!(&w.waiter, Waiter::Remote(r) if *r == from)
                    });
                }
                QueueItem::Released { node_id } => self.give_back(&node_id, &from),
                QueueItem::Return { node_id, slots } => self.returned(&from, &node_id, slots),
                QueueItem::Report {
                    fence: f,
                    incarnation: i,
                    running,
                    seen,
                    held,
                } if f == fence && i == incarnation => {
                    self.reconcile(&from, &running, &held, seen);
                }
                QueueItem::Report { .. } => {}
            }
        }
    }

    /// A follower's report: what runs there now and the grants it holds, plus what was
    /// dispatched and lent to it since.
    fn reconcile(
        &mut self,
        from: &str,
        running: &BTreeMap<String, u32>,
        held: &BTreeMap<String, u32>,
        seen: Option<(u64, u64)>,
    ) {
        let now = self.args.clock.now();
        let Some(m) = self.cluster.as_mut() else {
            return;
        };
        // A follower reports every lease period what it received before: a message sent two
        // periods before this report and still unseen never arrived (a restarted follower's
        // queue subscribed after it), and what it said is not the follower's to count.
        let lost_before = now.checked_sub(m.cluster.lease_ttl * 2);
        let Some(f) = m.followers.get_mut(from) else {
            return;
        };
        // A report that saw none of this record's dispatches includes none of them.
        let seen = seen
            .filter(|(epoch, _)| *epoch == f.epoch)
            .map_or(0, |(_, n)| n);
        f.unreported
            .retain(|(n, _, _, at)| *n > seen && lost_before.is_none_or(|t| *at > t));
        let unreported: Vec<(String, u32)> = f
            .unreported
            .iter()
            .map(|(_, node, slots, _)| (node.clone(), *slots))
            .collect();
        for (id, n) in &mut self.nodes {
            let later = unreported
                .iter()
                .filter(|(u, slots)| u == id && *slots == 0)
                .count();
            let count = running
                .get(id)
                .copied()
                .unwrap_or(0)
                .saturating_add(u32::try_from(later).unwrap_or(u32::MAX));
            n.running.insert(from.to_owned(), count);
            let lent = unreported
                .iter()
                .filter(|(u, _)| u == id)
                .fold(held.get(id).copied().unwrap_or(0), |a, (_, slots)| {
                    a.saturating_add(*slots)
                });
            if lent > 0 {
                n.granted.insert(from.to_owned(), lent);
            } else {
                n.granted.remove(from);
            }
        }
    }
}
