//! The HTTP surface: the route table only. Handlers live in a file per endpoint group.

pub mod error;
mod health;
mod nodes_ws;
mod openai;
pub mod sse;

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use tower_http::limit::RequestBodyLimitLayer;

use crate::server::AppState;

/// Every route of a replica.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/nodes/connect", get(nodes_ws::connect))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .layer(RequestBodyLimitLayer::new(state.config.max_body_bytes))
        .with_state(state)
}
