//! The HTTP surface: the route table only. Handlers live in a file per endpoint group;
//! `access_log.rs` is the layer every request passes first (request id, trace context,
//! access log), `request_id.rs` the types it leaves in the request's extensions.

pub mod access_log;
mod admin;
mod completions;
mod console;
mod embeddings;
mod generations;
pub use generations::{CANCEL_CHANNEL, CLIENT_BACK_CHANNEL, client_back};
mod costs;
pub mod error;
mod health;
mod lifecycle;
pub mod listener;
mod nodes_ws;
mod openai;
mod reports;

pub mod request_id;
pub mod sse;
pub mod ssrf;
mod usage;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post, put};
use switchyard_actors::error::ErrorCode;

use crate::server::AppState;

/// Every route of a replica.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/generations", post(generations::create))
        .route("/v1/generations/{id}", get(generations::get))
        .route("/v1/generations/{id}/events", get(generations::events))
        .route("/v1/generations/{id}/cancel", post(generations::cancel))
        .route("/v1/usage", get(usage::usage))
        .route("/v1/nodes/connect", get(nodes_ws::connect))
        .route(
            "/admin/teams",
            post(admin::create_team).get(admin::list_teams),
        )
        .route("/admin/keys", post(admin::create_key).get(admin::list_keys))
        .route("/admin/keys/{id}", delete(admin::revoke_key))
        .route(
            "/admin/credits",
            post(admin::add_credits).get(console::credits),
        )
        .route("/admin/usage", get(console::usage))
        .route("/admin/queues", get(console::queues))
        .route("/console", get(console::page))
        .route("/console/", get(console::page))
        .route("/console/{file}", get(console::file))
        .route(
            "/admin/nodes",
            post(admin::create_node).get(admin::list_nodes),
        )
        .route("/admin/nodes/{id}/token", delete(admin::revoke_node_token))
        .route("/admin/nodes/{id}/drain", post(admin::drain_node))
        .route("/admin/nodes/{id}/load_model", post(admin::load_model))
        .route("/admin/nodes/{id}/pool", put(costs::set_pool))
        .route("/admin/reports/drift", get(reports::drift))
        .route("/admin/reports/cost", get(costs::cost))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Enforced by the body extractors, so an oversized body gets the error envelope
        // (413 `request_too_large`), not a bare status.
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        // Outermost, and through `Router::layer` so it sees the matched route template; the
        // fallbacks go through it too.
        .layer(axum::middleware::from_fn(access_log::layer))
        .with_state(state)
}

async fn not_found() -> error::ApiError {
    error::ApiError::new(ErrorCode::NotFound, "No such route.")
}

/// 405 with the envelope (axum's own answer has an empty body).
async fn method_not_allowed(method: axum::http::Method) -> error::ApiError {
    error::ApiError::new(
        ErrorCode::InvalidRequest,
        format!("This route does not take {method}."),
    )
    .with_status(axum::http::StatusCode::METHOD_NOT_ALLOWED)
}
