//! The cluster (SPEC sections 2, 7, 9): several replicas on one PostgreSQL and one Redis,
//! nodes dialing whichever replica they were given. Every replica routes to every node — a
//! node held by another replica through its proxy, over Redis pub/sub — and ownership of a
//! node moves with its connection.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

#[path = "cluster/drills.rs"]
mod drills;
#[path = "cluster/fair.rs"]
mod fair;
#[path = "cluster/nodes.rs"]
mod nodes;
#[path = "cluster/owners.rs"]
mod owners;
#[path = "coord/proxy.rs"]
#[allow(dead_code)]
mod proxy;
#[path = "cluster/relay.rs"]
mod relay;
#[path = "cluster/routing.rs"]
mod routing;
#[path = "cluster/storm.rs"]
mod storm;

use std::time::Duration;

use serde_json::{Value, json};
use switchyard::demo::{Fleet, FleetConfig};

use common::{clean_redis, drop_pg, fresh_pg, http, redis_url};

/// A cluster of `replicas` replicas with `nodes` simulated nodes of `small` spread over
/// them, on a fresh database and Redis prefix.
#[derive(Debug)]
pub struct Cluster {
    pub fleet: Fleet,
    /// What it was started with (to add nodes).
    pub config: FleetConfig,
    pub db_name: String,
    pub prefix: String,
}

pub async fn cluster(
    replicas: usize,
    nodes: u32,
    time_scale: f64,
    tweak: impl FnOnce(&mut FleetConfig),
) -> Cluster {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swcl:{:08x}:", rand::random::<u32>());
    let mut config = FleetConfig {
        nodes: vec![("small".to_owned(), nodes)],
        time_scale,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        replicas,
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    tweak(&mut config);
    let fleet = Fleet::start(config.clone(), &db_url).await.unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    let c = Cluster {
        fleet,
        config,
        db_name,
        prefix,
    };
    c.wait_routing(nodes as usize).await;
    c
}

impl Cluster {
    pub async fn stop(self) {
        self.fleet.shutdown(Duration::from_secs(1)).await;
        drop_pg(&self.db_name).await;
        clean_redis(&self.prefix).await;
    }

    /// The base URL of replica `i`.
    pub fn url(&self, i: usize, path: &str) -> String {
        let replicas = self.fleet.replicas();
        format!("{}{path}", replicas[i % replicas.len()].base_url())
    }

    /// Nodes replica `i` routes to: its own sockets and its proxies.
    pub fn routable(&self, i: usize) -> usize {
        let replicas = self.fleet.replicas();
        let state = replicas[i].state();
        state.view.local_count() + state.view.proxies().fences().len()
    }

    /// Waits until every replica routes to `n` nodes.
    pub async fn wait_routing(&self, n: usize) {
        let replicas = self.fleet.replicas().len();
        common::wait_for(
            Duration::from_secs(10),
            "every replica routes to every node",
            || async move { (0..replicas).all(|i| self.routable(i) == n) },
        )
        .await;
        self.wait_queue_owner().await;
    }

    /// Waits until no ledger row is still reserved.
    pub async fn wait_reservations_closed(&self) {
        let store = self.fleet.store.clone();
        common::wait_for(
            Duration::from_secs(30),
            "every reservation to close",
            || {
                let store = store.clone();
                async move { store.open_reservations().await.unwrap() == 0 }
            },
        )
        .await;
    }

    /// Every replica knows the same owner of each model's queue; the owner of `small`'s.
    pub async fn wait_queue_owner(&self) -> String {
        let small = self
            .config
            .server
            .resolve_model("small")
            .unwrap()
            .name
            .clone();
        let owner = std::sync::Mutex::new(None);
        common::wait_for(Duration::from_secs(10), "one known owner per queue", || {
            let (owner, small) = (&owner, &small);
            async move {
                let mut seen = std::collections::BTreeMap::new();
                for r in self.fleet.replicas() {
                    for (model, q) in &r.state().queues {
                        let o = q.stats().await.and_then(|s| s.owner);
                        seen.entry(model.clone())
                            .or_insert_with(std::collections::BTreeSet::new)
                            .insert(o);
                    }
                }
                *owner.lock().unwrap() = seen[small].first().cloned().flatten();
                seen.values()
                    .all(|o| o.len() == 1 && o.first().is_some_and(Option::is_some))
            }
        })
        .await;
        owner.into_inner().unwrap().unwrap_or_default()
    }

    /// A streamed chat completion of up to `max_tokens` through replica `i`, answered 200:
    /// the whole body.
    pub async fn chat_through(&self, i: usize, max_tokens: u32) -> String {
        let resp = http()
            .post(self.url(i, "/v1/chat/completions"))
            .bearer_auth(&self.fleet.api_key)
            .json(&chat(max_tokens))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap()
    }

    /// `GET /admin/nodes` on replica `i`.
    pub async fn admin_nodes(&self, i: usize) -> Vec<Value> {
        let body: Value = http()
            .get(self.url(i, "/admin/nodes"))
            .bearer_auth(&self.fleet.admin_token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        body["data"].as_array().unwrap().clone()
    }
}

/// Whether a streamed body carries an error event (not merely the word in its text).
pub fn has_error_event(body: &str) -> bool {
    common::sse_data(body).iter().any(|data| {
        serde_json::from_str::<Value>(data).is_ok_and(|event| event.get("error").is_some())
    })
}

/// A `switchyard serve` process on `port` named `replica`, in the cluster of `prefix`, with
/// an owner lease of 1 s and `extra` arguments (`--config FILE`).
pub fn serve_process(
    db_url: &str,
    prefix: &str,
    port: u16,
    admin: &str,
    replica: &str,
    extra: &[&str],
) -> Process {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("serve")
        .args(extra)
        .env("DATABASE_URL", db_url)
        .env("REDIS_URL", redis_url())
        .env("SWITCHYARD_REDIS_PREFIX", prefix)
        .env("SWITCHYARD_LISTEN", format!("127.0.0.1:{port}"))
        .env("SWITCHYARD_ADMIN_TOKEN", admin)
        .env("SWITCHYARD_REPLICA_ID", replica)
        .env("SWITCHYARD_OWNER_LEASE_SECS", "1")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start switchyard serve");
    Process(child)
}

/// A child process killed when dropped, so a failing test leaves no replica behind holding
/// database connections.
#[derive(Debug)]
pub struct Process(pub std::process::Child);

impl Process {
    /// Kills it with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free local port.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Waits until `base` answers `/healthz`.
pub async fn wait_serving(base: &str) {
    let url = format!("{base}/healthz");
    common::wait_for(Duration::from_secs(30), "a replica to serve", || {
        let url = url.clone();
        async move {
            http()
                .get(url)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
}

/// A streamed chat completion of up to `max_tokens` at `url`: the whole body.
pub async fn stream_body(url: &str, key: &str, max_tokens: u32) -> String {
    let resp = http()
        .post(url)
        .bearer_auth(key)
        .json(&chat(max_tokens))
        .send()
        .await
        .unwrap();
    resp.text().await.unwrap()
}

pub fn chat(max_tokens: u32) -> Value {
    json!({
        "model": "small",
        "messages": [{"role": "user", "content": "Tell me about railway switchyards."}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}
