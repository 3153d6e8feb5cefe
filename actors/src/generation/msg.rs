//! Messages, arguments and events of the [`super::GenerationActor`].

use std::sync::Arc;
use std::time::Duration;

use ractor::RpcReplyPort;

use super::events::EventSender;
use crate::error::Failure;
use crate::lifecycle::GenerationStore;
use crate::model_queue::{ModelQueueHandle, RouteKey};
use crate::node::NodeHandle;
use crate::output::Piece;
use crate::ports::{Clock, Ledger, Reservation};
use crate::protocol::Api;

/// Deadlines of one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From dispatch to the first token; then `generation_timeout`.
    pub first_token: Duration,
    /// From admission to the end; then `generation_timeout`.
    pub total: Duration,
    /// After the client leaves, how long the stream may still finish on its own before the
    /// node is told to cancel.
    pub cancel_grace: Duration,
    /// After a cancel or a lost node, how long to wait for the node's `done` (exact usage)
    /// before settling from what was received. Also the bound after which a silent node's
    /// attempt counts as fenced when it was cancelled or had already streamed.
    pub settle_wait: Duration,
    /// Each attempt's lease: a node that has heard nothing from the server for this long
    /// stops the attempt, so once it passed after the node was lost, the attempt is fenced
    /// and may be dispatched again.
    pub lease: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            first_token: Duration::from_secs(60),
            total: Duration::from_secs(600),
            cancel_grace: Duration::from_secs(2),
            settle_wait: Duration::from_secs(20),
            lease: Duration::from_secs(5),
        }
    }
}

/// Usage of a finished generation, as billed: the engine's counts within the request's
/// bounds (what the ledger recorded, never more).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens billed.
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// The engine's finish reason (`stop`, `length`, `tool_calls`, …).
    pub finish_reason: String,
    /// Prompt tokens the engine served from its prefix cache, when it said (never more than
    /// `prompt_tokens`).
    pub cached_tokens: Option<u64>,
}

/// What the HTTP layer receives, in order: deltas, then exactly one terminal event.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// A piece of output.
    Delta(Piece),
    /// The generation completed; its row is settled with this usage.
    Finished(Usage),
    /// The generation was cancelled and the node confirmed the stop (or was fenced); the
    /// usage is what it produced until then.
    Cancelled(Usage),
    /// The generation failed.
    Failed(Failure),
}

/// Runs once when the generation ends, whatever the path (releases a concurrency slot,
/// counts tokens per day); it gets the tokens settled by this generation, if any. Dropped
/// without running — a generation that could not even be spawned — it runs with `None`, so
/// what it gives back is never leaked.
pub struct EndHook(Option<Box<dyn FnOnce(Option<u64>) + Send + Sync>>);

impl EndHook {
    /// A hook running `f`.
    pub fn new(f: impl FnOnce(Option<u64>) + Send + Sync + 'static) -> Self {
        Self(Some(Box::new(f)))
    }

    /// Runs it with the tokens settled, if any.
    pub fn run(mut self, settled: Option<u64>) {
        if let Some(f) = self.0.take() {
            f(settled);
        }
    }
}

impl Drop for EndHook {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(None);
        }
    }
}

impl std::fmt::Debug for EndHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndHook")
    }
}

/// Everything a generation needs.
#[derive(Debug)]
pub struct GenerationArgs {
    /// Unique id (`chatcmpl-…` / `gen_…`): frames, the directory and the generation's
    /// record use it. The ledger row's key is the reservation's `request_id`: the same,
    /// except for a rejected generation admitted again under its key, whose new row needs
    /// a new key.
    pub request_id: String,
    /// Resolved model name, as the engines serve it.
    pub model: String,
    /// The OpenAI body to forward (model already resolved).
    pub body: serde_json::Value,
    /// The engine API it runs on.
    pub api: Api,
    /// An embedding model's vector length, when configured: bounds its answer
    /// ([`crate::output::output_bound`]).
    pub embedding_dimensions: Option<u32>,
    /// The client's request id, passed to the engine.
    pub x_request_id: Option<String>,
    /// The W3C trace context, passed to the engine.
    pub traceparent: Option<String>,
    /// The ledger row to open at admission (its `request_id` keys the row).
    pub reservation: Reservation,
    /// The model's queue.
    pub queue: ModelQueueHandle,
    /// Its prompt's blocks and session, for the queue's node choice.
    pub route: Option<Arc<RouteKey>>,
    /// The ledger.
    pub ledger: Arc<dyn Ledger>,
    /// Where events for the client go.
    pub events: EventSender,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Time source.
    pub clock: Arc<dyn Clock>,
    /// Called when the generation ends.
    pub on_end: Option<EndHook>,
    /// The generation's record (`request_id` is its id) when it was admitted through the
    /// lifecycle (the Generations API, or an Idempotency-Key).
    pub lifecycle: Option<Arc<dyn GenerationStore>>,
    /// Its client may come back to it (see [`crate::ports::admission::Ready::resumable`]).
    pub resumable: bool,
    /// The service tier it runs at.
    pub tier: crate::tier::Tier,
    /// Where the record of which node holds each attempt goes (see `crate::attempts`), so a
    /// `done` that outlives the generation is accepted only from its node, and one arriving
    /// on another replica is sent here. `None` in tests that do not need it.
    pub attempts: Option<crate::attempts::Recorder>,
}

impl GenerationArgs {
    /// What it is to its model's queue: its tier, the team paying, and its work in tokens
    /// (the measured prompt and the most output it may make).
    pub fn ticket(&self) -> crate::model_queue::Ticket {
        crate::model_queue::Ticket {
            tier: self.tier,
            team: self.reservation.team_id,
            cost: self
                .reservation
                .estimated_prompt_tokens
                .saturating_add(self.reservation.max_tokens),
        }
    }
}

/// Deadlines a generation arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Timer {
    /// No first token yet.
    FirstToken,
    /// The whole request took too long.
    Total,
    /// The client's grace after leaving is over: the grace with this serial (a client that
    /// came back and left again runs a new one; the older timer does nothing).
    CancelGrace(u64),
    /// Waited long enough for the node's `done`.
    SettleWait,
    /// The lost node's lease on this attempt has run out: the attempt is fenced.
    Lease(u64),
    /// Time to try the settle that failed again (its backoff is over).
    SettleRetry,
}

/// What a [`super::GenerationActor`] handles.
#[derive(Debug)]
pub enum GenerationMsg {
    /// Reserve the ledger row and enter the model's queue; the reply says whether the request
    /// was admitted (before any response header is sent), once the row has committed.
    Admit(RpcReplyPort<Result<(), Failure>>),
    /// The ledger's answer to the reservation the actor started at admission.
    Reserved(Result<(), crate::ports::LedgerError>),
    /// The queue picked a node (it already counted the assignment against the node).
    Dispatch {
        /// The chosen node.
        node: NodeHandle,
        /// The node's slot the queue counted: given back when dropped (the dispatch refused,
        /// or lost with a generation that stopped), handed over with the assignment.
        slot: crate::model_queue::Slot,
    },
    /// The queue deadline passed.
    QueueTimeout,
    /// The node's engine took the assignment.
    Accepted {
        /// Epoch of the frame.
        attempt: u64,
        /// The connection it came on: only the node holding the attempt is believed.
        from: NodeHandle,
    },
    /// Generated text.
    Chunk {
        /// Epoch of the frame.
        attempt: u64,
        /// Position within the attempt.
        seq: u64,
        /// The output, read and checked by the node's actor.
        delta: Piece,
        /// The connection it came on.
        from: NodeHandle,
    },
    /// The node's final report, with exact usage.
    Done {
        /// Epoch of the frame.
        attempt: u64,
        /// Prompt tokens.
        prompt_tokens: u64,
        /// Completion tokens.
        completion_tokens: u64,
        /// Prompt tokens served from the engine's cache, when it said.
        cached_tokens: Option<u64>,
        /// `chunk`s the attempt sent, when the node said.
        chunks: Option<u64>,
        /// `stop`, `length`, `tool_calls`, `abort`, `error`, …
        finish_reason: String,
        /// The connection it came on, to ack it.
        from: NodeHandle,
    },
    /// The engine failed the assignment.
    EngineError {
        /// Epoch of the frame.
        attempt: u64,
        /// The agent's code (`model_loading`, `invalid_request`, …).
        code: String,
        /// The engine's message.
        message: String,
        /// The connection it came on; `None` when the server itself never sent the work.
        from: Option<NodeHandle>,
    },
    /// The node carrying `attempt` is gone.
    NodeLost {
        /// The attempt that was on it.
        attempt: u64,
    },
    /// The client went away.
    ClientGone,
    /// A reader re-attached after the client left (a resumed stream): while the cancel grace
    /// still runs the generation goes on (the grace no longer cancels); once the cancel was
    /// sent it changes nothing.
    ClientBack,
    /// The model's queue crashed and was restarted: a generation waiting in that model's
    /// queue enqueues itself again (at the front); anything else ignores it.
    QueueRestarted {
        /// The restarted queue's model.
        model: String,
    },
    /// The node actor of `node_id` crashed: if the current attempt runs there, this is
    /// `NodeLost { attempt: current }`; else it is ignored.
    NodeGone {
        /// The crashed node actor's node.
        node_id: String,
    },
    /// The coordinator lost its data (Redis restarted empty): a generation past admission
    /// writes its holders record again, so that its node's `done` still finds it.
    RecordAgain,
    /// The owner asked to cancel (its record already says so).
    Cancel,
    /// A deadline fired.
    Timer(Timer),
}
