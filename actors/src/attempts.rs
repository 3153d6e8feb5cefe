//! Which node holds each attempt of a generation, kept in the coordinator under
//! `attempts:{request_id}` (one field per attempt epoch, naming its node, and an `admitted`
//! field written at admission). The generation writes it when it is admitted and again before
//! each `assign` leaves, and sends no work it could not record; a node connection reads it
//! when a `done` arrives for a generation that is not live on its replica, so that only the
//! node that held an attempt can settle its row (SPEC section 7, trust).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::ports::{CoordError, Coordinator};

/// Who held an attempt, as far as the record knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// This node was assigned the attempt.
    Node(String),
    /// The generation is recorded, but never dispatched this attempt.
    NotAssigned,
    /// No record: it expired, or the coordinator lost it (an in-process one restarted).
    Unrecorded,
}

fn key(request_id: &str) -> String {
    format!("attempts:{request_id}")
}

/// Present from admission on: a generation admitted but not yet dispatched (or dispatched
/// elsewhere) is known, so a `done` for it from any node reads as [`Holder::NotAssigned`].
const ADMITTED: &str = "admitted";

/// Records `request_id` as admitted with every attempt dispatched so far and its node, for
/// `ttl` (the longest a `done` may still arrive).
pub async fn record(
    coordinator: &dyn Coordinator,
    request_id: &str,
    holders: &BTreeMap<u64, String>,
    ttl: Duration,
) -> Result<(), CoordError> {
    let fields = holders
        .iter()
        .map(|(attempt, node)| (attempt.to_string(), node.clone()))
        .chain(std::iter::once((ADMITTED.to_owned(), "1".to_owned())))
        .collect();
    coordinator.put_hash(&key(request_id), &fields, ttl).await
}

/// The node that held `attempt` of `request_id`.
pub async fn holder(
    coordinator: &dyn Coordinator,
    request_id: &str,
    attempt: u64,
) -> Result<Holder, CoordError> {
    let record = coordinator.get_hash(&key(request_id)).await?;
    Ok(match record {
        None => Holder::Unrecorded,
        Some(mut r) => match r.remove(&attempt.to_string()) {
            Some(node) => Holder::Node(node),
            None => Holder::NotAssigned,
        },
    })
}
