//! A replica's view of the cluster's nodes: it hears every owner's announcements and keeps
//! one proxy node actor per node whose socket is on another replica, so this replica's
//! queues route to every node of the cluster; it hands the frames relayed to this replica
//! to those proxies, and tells a local connection when a newer connection of its node
//! appeared elsewhere. The server's node sockets and a simulated cluster's links both
//! register here ([`NodeView::connected`]), so both run this one view.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Announcement, FromNode, NODES_CHANNEL, NodeNews, to_replica};
use crate::generation::Directory;
use crate::lifecycle::GenerationStore;
use crate::model_queue::ModelQueueHandle;
use crate::node::{Link, NodeArgs, NodeHandle, NodeMsg, NodeTrust};
use crate::ports::{Clock, CoordError, Coordinator, Ledger, NodeAccounting};
use crate::supervision::Nodes;
use crate::tasks::TaskGuard;

/// What every node actor of one replica shares, socket or proxy.
#[derive(Debug, Clone)]
pub struct NodeShared {
    /// This replica.
    pub replica_id: String,
    /// The replica's queues, by model.
    pub queues: BTreeMap<String, ModelQueueHandle>,
    /// The replica's generations.
    pub directory: Directory,
    /// Where a node's `done` settles.
    pub ledger: Arc<dyn Ledger>,
    /// Generation records, when the replica keeps them.
    pub lifecycle: Option<Arc<dyn GenerationStore>>,
    /// Cluster coordination.
    pub coordinator: Arc<dyn Coordinator>,
    /// A node silent this long is lost.
    pub heartbeat_timeout: Duration,
    /// Time.
    pub clock: Arc<dyn Clock>,
    /// How many protocol violations a node may commit.
    pub trust: NodeTrust,
    /// Where node sockets' heartbeats are accounted per node and day.
    pub accounting: Option<Arc<dyn NodeAccounting>>,
    /// Assignments of each model one node may carry at once (the queues' `node_capacity`).
    pub capacity: BTreeMap<String, u32>,
}

impl NodeShared {
    /// The node actor arguments of this replica, for a node's socket here or a proxy.
    pub fn args(&self, node_id: &str, models: &[String], protocol: u32, link: Link) -> NodeArgs {
        NodeArgs {
            node_id: node_id.to_owned(),
            models: models.to_vec(),
            link,
            queues: models
                .iter()
                .filter_map(|m| self.queues.get(m).map(|q| (m.clone(), q.clone())))
                .collect(),
            directory: self.directory.clone(),
            ledger: self.ledger.clone(),
            lifecycle: self.lifecycle.clone(),
            coordinator: self.coordinator.clone(),
            replica_id: self.replica_id.clone(),
            heartbeat_timeout: self.heartbeat_timeout,
            clock: self.clock.clone(),
            trust: self.trust,
            protocol,
            gpus: 0,
            accounting: self.accounting.clone(),
            capacity: models
                .iter()
                .filter_map(|m| self.capacity.get(m).map(|c| (m.clone(), *c)))
                .collect(),
        }
    }
}

/// This replica's node actors: those of sockets here and the proxies of the others.
#[derive(Debug)]
pub struct NodeView {
    shared: NodeShared,
    supervisor: Nodes,
    local: Mutex<BTreeMap<String, NodeHandle>>,
    proxies: Proxies,
}

impl NodeView {
    /// A view with no node yet; [`spawn_view`] makes it hear the cluster.
    pub fn new(shared: NodeShared, supervisor: Nodes) -> Self {
        Self {
            shared,
            supervisor,
            local: Mutex::default(),
            proxies: Proxies::default(),
        }
    }

    /// What the replica's node actors share.
    pub fn shared(&self) -> &NodeShared {
        &self.shared
    }

    fn local(&self) -> MutexGuard<'_, BTreeMap<String, NodeHandle>> {
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A node registered on this replica with `gpus` GPUs: starts its actor, linked to its
    /// socket's `outbound` frames. A node that reconnects replaces its old connection here,
    /// whose work counts as lost.
    pub async fn connected(
        &self,
        node_id: &str,
        models: &[String],
        protocol: u32,
        gpus: u32,
        outbound: tokio::sync::mpsc::Sender<crate::protocol::ServerFrame>,
    ) -> Result<NodeHandle, crate::supervision::NodeStartError> {
        let mut args = self
            .shared
            .args(node_id, models, protocol, Link::Socket(outbound));
        args.gpus = gpus;
        let node = self.supervisor.start(args).await?;
        let previous = self.local().insert(node_id.to_owned(), node.clone());
        if let Some(old) = previous {
            old.stop();
        }
        Ok(node)
    }

    /// The socket of `node` closed: its actor learns it, and it leaves the view unless a
    /// newer connection of the node replaced it.
    pub fn disconnected(&self, node: &NodeHandle) {
        node.connection_lost();
        let mut local = self.local();
        if local
            .get(node.node_id())
            .is_some_and(|n| n.same_actor(node))
        {
            local.remove(node.node_id());
        }
    }

    /// Takes the local connection of `node_id` out of the view (a revoked credential); the
    /// caller stops it.
    pub fn remove_local(&self, node_id: &str) -> Option<NodeHandle> {
        self.local().remove(node_id)
    }

    /// The nodes whose sockets are on this replica.
    pub fn local_nodes(&self) -> Vec<NodeHandle> {
        self.local().values().cloned().collect()
    }

    /// Whether `node_id`'s socket is on this replica.
    pub fn is_local(&self, node_id: &str) -> bool {
        self.local().contains_key(node_id)
    }

    /// How many nodes have their socket on this replica.
    pub fn local_count(&self) -> usize {
        self.local().len()
    }

    /// A live node actor for `node_id` on this replica — its socket, or its proxy — to send
    /// an operator's command through (`drain`, `load_model` reach the node wherever its
    /// socket is).
    pub fn reach(&self, node_id: &str) -> Option<NodeHandle> {
        let local = self.local().get(node_id).cloned();
        local.or_else(|| self.proxies.get(node_id))
    }

    /// The proxies of nodes owned by other replicas.
    pub fn proxies(&self) -> &Proxies {
        &self.proxies
    }
}

/// The proxies of nodes owned by other replicas, by node id, with their connection's token.
#[derive(Debug, Default)]
pub struct Proxies(Mutex<BTreeMap<String, (u64, NodeHandle)>>);

impl Proxies {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, (u64, NodeHandle)>> {
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

/// Listens to the cluster until the replica shuts down: subscribes to node news and to this
/// replica's relay channel, says hello (owners announce their nodes at once), and keeps the
/// proxies. A lost subscription is renewed with backoff; its proxies end meanwhile (their
/// frames are lost, so their work is treated as on a lost node) and come back with the
/// next announcements.
pub async fn spawn_view(state: &Arc<NodeView>, stop: CancellationToken) {
    let state = state.clone();
    tokio::spawn(async move {
        let _guard = TaskGuard::new("cluster_view");
        let mut pause = Duration::from_millis(100);
        loop {
            let subscribed = async {
                let news = state.shared.coordinator.subscribe(NODES_CHANNEL).await?;
                let relayed = state
                    .shared
                    .coordinator
                    .subscribe(&to_replica(&state.shared.replica_id))
                    .await?;
                Ok::<_, CoordError>((news, relayed))
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

async fn hello(state: &NodeView) {
    let hello = NodeNews::Hello {
        replica: state.shared.replica_id.clone(),
    };
    if let Ok(payload) = serde_json::to_vec(&hello)
        && let Err(e) = state
            .shared
            .coordinator
            .publish(NODES_CHANNEL, payload)
            .await
    {
        tracing::warn!(error = %e, "could not say hello to the cluster");
    }
}

async fn on_news(state: &NodeView, payload: &[u8]) {
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
        NodeNews::Hello { replica } if replica != state.shared.replica_id => {
            for node in state.local_nodes() {
                node.send(NodeMsg::Announce);
            }
        }
        NodeNews::Hello { .. } => {}
    }
}

async fn on_announcement(state: &NodeView, node: Announcement) {
    // A local connection of the node learns of a newer one elsewhere and ends.
    let local = state.local().get(&node.node_id).cloned();
    if node.owner == state.shared.replica_id {
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
        .filter(|m| state.shared.queues.contains_key(*m))
        .cloned()
        .collect();
    if known.is_empty() {
        return;
    }
    let link = Link::Remote {
        owner: node.owner.clone(),
        fence: node.fence,
    };
    let args = state
        .shared
        .args(&node.node_id, &known, node.protocol, link);
    match state.supervisor.start(args).await {
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

fn on_relayed(state: &NodeView, payload: &[u8]) {
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
                crate::metric_names::STALE_FRAMES_TOTAL,
                "reason" => "no_proxy"
            )
            .increment(1);
        }
    }
}
