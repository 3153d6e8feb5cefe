//! A node lost versus a node stopped on purpose (`switchyard_nodes_lost_total{node}`): a node
//! whose socket closes, or whose heartbeats stop, without its having drained counts 1 on the
//! replica that held its socket; one that said `draining` (its agent's SIGTERM) or was drained
//! by an operator and then left counts 0. Every node's series exists, at 0, from its
//! registration on, so Prometheus's `increase()` sees the first loss.

use std::time::Duration;

use serde_json::json;
use switchyard::store::hash_secret;

use crate::common::{http, metrics_page};
use crate::harness::{PgFleet, Ws, fake_node_serving, metric, pg_fleet, recv, send, until};

const LARGE: &str = "llama-3.3-70b-instruct";
const LOST: &str = "switchyard_nodes_lost_total";

/// A registered scripted node serving the large model (which no request here asks for).
async fn node(f: &PgFleet, id: &str) -> Ws {
    let token = format!("nt-{id}");
    f.store
        .create_node(id, "onprem", &hash_secret(&token))
        .await
        .unwrap();
    let mut ws = fake_node_serving(f, id, &token, LARGE).await;
    send(
        &mut ws,
        json!({"type": "heartbeat", "queue_depth": 0, "running": 0, "kv_cache_usage": 0.0,
               "gpu_util": 0.0, "models": [LARGE]}),
    )
    .await;
    ws
}

/// The node's `switchyard_nodes_lost_total` line, if the page has one.
async fn lost_line(f: &PgFleet, id: &str) -> Option<String> {
    let page = metrics_page(&http(), &f.server.base_url()).await;
    let prefix = format!("{LOST}{{node=\"{id}\"}} ");
    page.lines()
        .find(|l| l.starts_with(&prefix))
        .map(str::to_owned)
}

async fn lost(f: &PgFleet, id: &str) -> f64 {
    metric(f, LOST, &format!("node=\"{id}\"")).await
}

async fn close(mut ws: Ws) {
    ws.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_socket_counts_as_lost_unless_the_node_drained() {
    let f = pg_fleet(&[], 1.0, |_| {}).await;
    let gone = node(&f, "gone-1").await;
    let sigterm = node(&f, "sigterm-1").await;
    let mut drained = node(&f, "drained-1").await;
    for id in ["gone-1", "sigterm-1", "drained-1"] {
        let line = lost_line(&f, id).await;
        assert_eq!(
            line.as_deref(),
            Some(format!("{LOST}{{node=\"{id}\"}} 0").as_str()),
            "exported at 0 from registration"
        );
    }

    // The agent's SIGTERM: it says `draining`, finishes, and its socket closes.
    let mut sigterm = sigterm;
    send(&mut sigterm, json!({"type": "draining"})).await;
    close(sigterm).await;
    // An operator's drain: the node hears it, then leaves.
    let resp = http()
        .post(f.url("/admin/nodes/drained-1/drain"))
        .bearer_auth(&f.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 202);
    assert_eq!(recv(&mut drained).await["type"], "drain");
    close(drained).await;
    // No drain: lost.
    close(gone).await;

    until(Duration::from_secs(10), "gone-1 counted lost", || async {
        lost(&f, "gone-1").await == 1.0
    })
    .await;
    until(
        Duration::from_secs(10),
        "every socket's actor stopped",
        || async { f.server.state().view.local_count() == 0 },
    )
    .await;
    // Out of the view once their `ConnectionLost` is queued: give the actors a moment to read it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(lost(&f, "sigterm-1").await, 0.0, "drained itself");
    assert_eq!(lost(&f, "drained-1").await, 0.0, "drained by an operator");
    assert_eq!(lost(&f, "gone-1").await, 1.0, "counted once");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_heartbeats_count_as_lost_unless_the_node_drained() {
    let f = pg_fleet(&[], 1.0, |c| c.server.nodes.heartbeat_timeout_secs = 1).await;
    let _silent = node(&f, "silent-1").await;
    let mut draining = node(&f, "quiet-draining-1").await;
    send(&mut draining, json!({"type": "draining"})).await;

    until(Duration::from_secs(10), "silent-1 counted lost", || async {
        lost(&f, "silent-1").await == 1.0
    })
    .await;
    until(Duration::from_secs(10), "both dropped", || async {
        f.server.state().view.local_count() == 0
    })
    .await;
    assert_eq!(lost(&f, "quiet-draining-1").await, 0.0, "it had drained");
    f.stop().await;
}
