//! Which node holds each attempt of a generation, and on which replica the generation runs,
//! kept in the coordinator under `attempts:{request_id}` (one field per attempt epoch, naming
//! its node; a `replica` field; an `admitted` field written at admission). The generation
//! writes it when it is admitted and again before each `assign` leaves, and sends no work it
//! could not record. A node connection reads it when a `done` arrives for a generation that
//! is not live on its replica: only the node that held an attempt can settle its row (SPEC
//! section 7, trust), and while the generation's replica still listens the `done` goes there,
//! since only the live generation knows whether it fenced that attempt.

use std::collections::BTreeMap;
use std::sync::Arc;
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

/// What the record says about one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// The node that held it.
    pub holder: Holder,
    /// The replica the generation runs on (absent in records without one).
    pub replica: Option<String>,
}

/// Where a replica's generations record their attempts.
#[derive(Debug, Clone)]
pub struct Recorder {
    /// The coordinator holding the records.
    pub coordinator: Arc<dyn Coordinator>,
    /// The replica the generations run on.
    pub replica_id: String,
}

fn key(request_id: &str) -> String {
    format!("attempts:{request_id}")
}

/// Present from admission on: a generation admitted but not yet dispatched (or dispatched
/// elsewhere) is known, so a `done` for it from any node reads as [`Holder::NotAssigned`].
const ADMITTED: &str = "admitted";

/// The field naming the generation's replica.
const REPLICA: &str = "replica";

impl Recorder {
    /// Records `request_id` as admitted on this replica with every attempt dispatched so far
    /// and its node, for `ttl` (the longest a `done` may still arrive).
    pub async fn record(
        &self,
        request_id: &str,
        holders: &BTreeMap<u64, String>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        let fields = holders
            .iter()
            .map(|(attempt, node)| (attempt.to_string(), node.clone()))
            .chain([
                (ADMITTED.to_owned(), "1".to_owned()),
                (REPLICA.to_owned(), self.replica_id.clone()),
            ])
            .collect();
        self.coordinator
            .put_hash(&key(request_id), &fields, ttl)
            .await
    }
}

/// What the record says about `attempt` of `request_id`.
pub async fn lookup(
    coordinator: &dyn Coordinator,
    request_id: &str,
    attempt: u64,
) -> Result<Attempt, CoordError> {
    let record = coordinator.get_hash(&key(request_id)).await?;
    Ok(match record {
        None => Attempt {
            holder: Holder::Unrecorded,
            replica: None,
        },
        Some(mut r) => Attempt {
            holder: match r.remove(&attempt.to_string()) {
                Some(node) => Holder::Node(node),
                None => Holder::NotAssigned,
            },
            replica: r.remove(REPLICA),
        },
    })
}
