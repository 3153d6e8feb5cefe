//! This replica's view of the cluster's nodes (see `switchyard_actors::cluster`): it hears
//! every owner's announcements and keeps one proxy node actor per node whose socket is on
//! another replica, so this replica's queues route to every node of the cluster; it hands
//! the frames relayed to this replica to those proxies, and tells a local connection when
//! a newer connection of its node appeared elsewhere.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use switchyard_actors::cluster::{Announcement, FromNode, NODES_CHANNEL, NodeNews, to_replica};
use switchyard_actors::node::{Link, NodeArgs, NodeHandle, NodeMsg, NodeTrust};
use switchyard_actors::tasks::TaskGuard;

use crate::server::AppState;

/// The proxies of nodes owned by other replicas, by node id, with their connection's token.
#[derive(Debug, Default)]
pub struct Proxies(Mutex<BTreeMap<String, (u64, NodeHandle)>>);

impl Proxies {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (u64, NodeHandle)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The live proxy of `node_id`, if its owner is another replica.
    pub fn get(&self, node_id: &str) -> Option<NodeHandle> {
        self.lock()
            .get(node_id)
            .filter(|(_, h)| h.is_alive())
            .map(|(_, h)| h.clone())
    }

    /// Node ids with a live proxy, and their owner's connection token.
    pub fn fences(&self) -> BTreeMap<String, u64> {
        self.lock()
            .iter()
            .filter(|(_, (_, h))| h.is_alive())
            .map(|(id, (fence, _))| (id.clone(), *fence))
            .collect()
    }

    fn stop_all(&self) {
        for (_, (_, h)) in std::mem::take(&mut *self.lock()) {
            h.stop();
        }
    }
}

/// The node actor arguments of this replica, for a node's socket here or a proxy.
pub fn node_args(
    state: &AppState,
    node_id: &str,
    models: &[String],
    protocol: u32,
    link: Link,
) -> NodeArgs {
    NodeArgs {
        node_id: node_id.to_owned(),
        models: models.to_vec(),
        link,
        queues: models
            .iter()
            .filter_map(|m| state.queues.get(m).map(|q| (m.clone(), q.clone())))
            .collect(),
        directory: state.launcher.generations.directory().clone(),
        ledger: state.store.clone(),
        lifecycle: Some(state.store.clone()),
        coordinator: state.coordinator.clone(),
        replica_id: state.replica_id.clone(),
        heartbeat_timeout: Duration::from_secs(state.config.nodes.heartbeat_timeout_secs),
        clock: state.clock.clone(),
        trust: NodeTrust {
            max_violations: state.config.trust.max_violations,
            window: Duration::from_secs(state.config.trust.violation_window_secs),
        },
        protocol,
    }
}

/// A live node actor for `node_id` on this replica — its socket, or its proxy — to send an
/// operator's command through (`drain`, `load_model` reach the node wherever its socket is).
pub fn reach(state: &AppState, node_id: &str) -> Option<NodeHandle> {
    let local = state
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(node_id)
        .cloned();
    local.or_else(|| state.proxies.get(node_id))
}

/// Listens to the cluster until the replica shuts down: subscribes to node news and to this
/// replica's relay channel, says hello (owners announce their nodes at once), and keeps the
/// proxies. A lost subscription is renewed with backoff; its proxies end meanwhile (their
/// frames are lost, so their work is treated as on a lost node) and come back with the
/// next announcements.
pub async fn spawn_view(state: &Arc<AppState>) {
    let state = state.clone();
    tokio::spawn(async move {
        let _guard = TaskGuard::new("cluster_view");
        let stop = state.shutdown.clone();
        let mut pause = Duration::from_millis(100);
        loop {
            let subscribed = async {
                let news = state.coordinator.subscribe(NODES_CHANNEL).await?;
                let relayed = state
                    .coordinator
                    .subscribe(&to_replica(&state.replica_id))
                    .await?;
                Ok::<_, switchyard_actors::ports::CoordError>((news, relayed))
            }
            .await;
            match subscribed {
                Ok((mut news, mut relayed)) => {
                    pause = Duration::from_millis(100);
                    hello(&state).await;
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => {
                                state.proxies.stop_all();
                                return;
                            }
                            msg = news.recv() => match msg {
                                Some(payload) => on_news(&state, &payload).await,
                                None => break,
                            },
                            msg = relayed.recv() => match msg {
                                Some(payload) => on_relayed(&state, &payload),
                                None => break,
                            },
                        }
                    }
                    tracing::warn!("lost the cluster's node channels; subscribing again");
                    state.proxies.stop_all();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot hear the cluster's node channels; retrying");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
}

async fn hello(state: &AppState) {
    let hello = NodeNews::Hello {
        replica: state.replica_id.clone(),
    };
    if let Ok(payload) = serde_json::to_vec(&hello)
        && let Err(e) = state.coordinator.publish(NODES_CHANNEL, payload).await
    {
        tracing::warn!(error = %e, "could not say hello to the cluster");
    }
}

async fn on_news(state: &AppState, payload: &[u8]) {
    let Ok(news) = serde_json::from_slice::<NodeNews>(payload) else {
        tracing::warn!(
            bytes = payload.len(),
            "unreadable node news from the cluster"
        );
        return;
    };
    match news {
        NodeNews::Node(node) => on_announcement(state, node).await,
        NodeNews::Down { node_id, fence } => {
            let gone = {
                let mut proxies = state.proxies.lock();
                match proxies.get(&node_id) {
                    Some((f, _)) if *f == fence => proxies.remove(&node_id),
                    _ => None,
                }
            };
            if let Some((_, proxy)) = gone {
                proxy.stop();
            }
        }
        NodeNews::Hello { replica } if replica != state.replica_id => {
            let local: Vec<NodeHandle> = state
                .nodes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .cloned()
                .collect();
            for node in local {
                node.send(NodeMsg::Announce);
            }
        }
        NodeNews::Hello { .. } => {}
    }
}

async fn on_announcement(state: &AppState, node: Announcement) {
    // A local connection of the node learns of a newer one elsewhere and ends.
    let local = state
        .nodes
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&node.node_id)
        .cloned();
    if node.owner == state.replica_id {
        // Our own, or the node moved here: no proxy.
        let moved = state.proxies.lock().remove(&node.node_id);
        if let Some((_, proxy)) = moved {
            proxy.stop();
        }
        return;
    }
    if let Some(local) = local {
        local.send(NodeMsg::News(node.clone()));
    }
    let current = state.proxies.lock().get(&node.node_id).cloned();
    match current {
        Some((fence, proxy)) if fence == node.fence && proxy.is_alive() => {
            proxy.send(NodeMsg::News(node));
            return;
        }
        // An announcement older than the proxy: out of date.
        Some((fence, proxy)) if fence > node.fence && proxy.is_alive() => return,
        Some((_, proxy)) => proxy.stop(),
        None => {}
    }
    let known: Vec<String> = node
        .models
        .iter()
        .filter(|m| state.queues.contains_key(*m))
        .cloned()
        .collect();
    if known.is_empty() {
        return;
    }
    let link = Link::Remote {
        owner: node.owner.clone(),
        fence: node.fence,
    };
    let args = node_args(state, &node.node_id, &known, node.protocol, link);
    match state.supervision.nodes.start(args).await {
        Ok(proxy) => {
            tracing::info!(node_id = %node.node_id, owner = %node.owner, "routing to a node owned by another replica");
            proxy.send(NodeMsg::News(node.clone()));
            state
                .proxies
                .lock()
                .insert(node.node_id.clone(), (node.fence, proxy));
        }
        Err(e) => {
            tracing::warn!(node_id = %node.node_id, error = %e, "could not start a node's proxy")
        }
    }
}

fn on_relayed(state: &AppState, payload: &[u8]) {
    let Ok(batch) = serde_json::from_slice::<FromNode>(payload) else {
        tracing::warn!(bytes = payload.len(), "unreadable relayed frames");
        return;
    };
    let proxy = state
        .proxies
        .lock()
        .get(&batch.node_id)
        .filter(|(fence, _)| *fence == batch.fence)
        .map(|(_, h)| h.clone());
    match proxy {
        Some(proxy) => proxy.send(NodeMsg::Relayed(batch)),
        None => {
            tracing::debug!(node_id = %batch.node_id, "relayed frames for a connection this replica no longer routes to");
            metrics::counter!(
                switchyard_actors::metric_names::STALE_FRAMES_TOTAL,
                "reason" => "no_proxy"
            )
            .increment(1);
        }
    }
}
