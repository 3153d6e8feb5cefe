//! Probes and metrics: `/healthz` (the process lives), `/readyz` (the database and the
//! coordinator answer, and no actor subsystem was given up on by its supervisor), `/metrics`
//! (Prometheus text, SPEC section 10 names).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use switchyard_actors::metric_names::{LEDGER_OPEN_RESERVATIONS, NODES};

use crate::server::AppState;

pub async fn healthz() -> &'static str {
    "ok"
}

pub async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let db = tokio::time::timeout(Duration::from_secs(2), state.store.ping()).await;
    let coord =
        tokio::time::timeout(Duration::from_secs(2), state.coordinator.get_hash("readyz")).await;
    match (db, coord) {
        // A subsystem the supervision tree gave up on refuses every request typed: take the
        // replica out of the load balancer so it is replaced rather than sent traffic.
        (Ok(Ok(())), Ok(Ok(_)))
            if !state.shutdown.is_cancelled() && state.supervision.down().is_empty() =>
        {
            (StatusCode::OK, "ready").into_response()
        }
        _ => (StatusCode::SERVICE_UNAVAILABLE, "not ready").into_response(),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    if let Ok(open) = state.store.open_reservations().await {
        metrics::gauge!(LEDGER_OPEN_RESERVATIONS).set(open as f64);
    }
    let connected = state.view.local_count();
    metrics::gauge!(NODES, "state" => "connected").set(connected as f64);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}
