//! The admission a generation runs before it exists for anyone: idempotency, the principal's
//! limits, the lifecycle record, measuring and pricing. The server implements [`AdmissionJob`]
//! (`src/admission/`); a generation only sees what it hands back, [`Admit`].

use std::fmt::Debug;
use std::sync::Arc;

use async_trait::async_trait;

use super::Reservation;
use crate::error::Failure;
use crate::generation::EndHook;
use crate::lifecycle::{GenerationRecord, GenerationStore};
use crate::model_queue::{ModelQueueHandle, RouteKey};

/// Where a principal stands against its per-key limits after admission: what the client is
/// told with every answer (`x-ratelimit-*`), refusals included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitState {
    /// `(limit, remaining, reset in ms)` of the requests-per-minute window, when the
    /// principal has one.
    pub requests: Option<(u32, u32, u64)>,
    /// `(limit, remaining, reset in ms)` of tokens per UTC day (reset: the next midnight),
    /// when the principal has one.
    pub tokens: Option<(u64, u64, u64)>,
}

/// A generation admitted and ready to run: what admission decided that the generation needs.
#[derive(Debug)]
pub struct Ready {
    /// The generation's id (its record's, when it has one): a readmitted key keeps the id of
    /// its first admission.
    pub request_id: String,
    /// The model version it runs on: the one stored with a readmitted request, which may no
    /// longer be the one its alias names.
    pub model: String,
    /// The body the engine gets (its `model` is [`Self::model`]).
    pub body: serde_json::Value,
    /// The ledger row to open, priced and bounded by the measured prompt.
    pub reservation: Reservation,
    /// An embedding model's vector length, when configured (bounds its answer).
    pub embedding_dimensions: Option<u32>,
    /// The queue of [`Self::model`].
    pub queue: ModelQueueHandle,
    /// The measured prompt's blocks, for the queue's node choice (`None` when the prompt
    /// was not tokenized: too long to be worth it, or an API without one).
    pub route: Option<Arc<RouteKey>>,
    /// The lifecycle store, when the generation has a record (an Idempotency-Key, or a
    /// principal whose messages are metered).
    pub lifecycle: Option<Arc<dyn GenerationStore>>,
    /// Its client may come back to it: it sent an Idempotency-Key, or asked through the
    /// Generations API. A record made only to meter a principal's messages is not resumable:
    /// its client leaving stops the node at once.
    pub resumable: bool,
    /// The service tier it runs at: the one it asked for, when its principal may use it.
    pub tier: crate::tier::Tier,
    /// Gives the principal's stream place back (and counts its tokens) when the generation
    /// ends; dropping it unrun gives the place back.
    pub on_end: Option<EndHook>,
    /// The limits' state, for the answer's headers.
    pub limits: LimitState,
}

/// What admission produced.
#[derive(Debug)]
pub enum Admit {
    /// Run a generation with these pieces.
    Ready(Box<Ready>),
    /// The Idempotency-Key names a generation with the same request: answer from its record,
    /// never run it again.
    Existing(Box<GenerationRecord>),
}

/// The admission of one request, run once. Its refusals are the implementation's own typed
/// error, so the caller can render each one fully (limits, headers); every one of them is
/// also a [`Failure`], which is all a generation running the job needs to report.
#[async_trait]
pub trait AdmissionJob: Send + Debug {
    /// Why admission refused.
    type Error: std::error::Error + Into<Failure> + Send + 'static;

    /// Admits the request: the pieces of a generation to run, or the record to answer from.
    async fn run(self: Box<Self>) -> Result<Admit, Self::Error>;
}
