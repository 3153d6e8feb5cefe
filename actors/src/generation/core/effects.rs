//! The core's vocabulary: the [`Input`]s it is stepped with (messages, fired timers, and the
//! answers of its own I/O) and the [`Effect`]s it returns for the actor to carry out.

use std::collections::BTreeMap;
use std::time::Duration;

use super::Claim;
use crate::error::{ErrorCode, Failure};
use crate::generation::events::SendError;
use crate::generation::msg::{GenEvent, Timer};
use crate::lifecycle::{Event, Refusal};
use crate::node::Violation;
use crate::output::Piece;
use crate::ports::{LedgerEntry, LedgerError, ReviewReason, SettleOutcome};

/// What the core is told.
#[derive(Debug)]
pub(crate) enum Input<N> {
    /// The HTTP layer asks to admit the request (answered by [`Effect::Reply`]).
    Admit,
    /// The queue picked a node and counted the assignment against it.
    Dispatch {
        /// The chosen node.
        node: N,
    },
    /// The queue's deadline passed.
    QueueTimeout,
    /// The node's engine took the attempt.
    Accepted {
        /// Epoch of the frame.
        attempt: u64,
        /// The connection it came on.
        from: N,
    },
    /// Generated text.
    Chunk {
        /// Epoch of the frame.
        attempt: u64,
        /// Position within the attempt.
        seq: u64,
        /// The output.
        delta: Piece,
        /// The connection it came on.
        from: N,
    },
    /// The node's final report.
    Done {
        /// Epoch of the frame.
        attempt: u64,
        /// What the node claims it used.
        claim: Claim,
        /// The connection it came on (acked from here).
        from: N,
    },
    /// The engine failed the attempt.
    EngineError {
        /// Epoch of the frame.
        attempt: u64,
        /// The agent's code.
        code: String,
        /// The engine's message.
        message: String,
        /// The connection it came on; `None` when the server never sent the work.
        from: Option<N>,
    },
    /// The connection carrying `attempt` closed.
    NodeLost {
        /// The attempt that was on it.
        attempt: u64,
    },
    /// The node actor of `node_id` crashed: a loss of the current attempt if it ran there.
    NodeGone {
        /// The node whose actor is gone.
        node_id: String,
    },
    /// The queue of `model` crashed and was restarted: a waiting generation enqueues again.
    QueueRestarted {
        /// The restarted queue's model.
        model: String,
    },
    /// The coordinator came back without its data: the holders record is written again.
    RecordAgain,
    /// The client's stream was dropped.
    ClientGone,
    /// A reader re-attached after the client left.
    ClientBack,
    /// The owner cancelled (the record already says so).
    Cancel,
    /// A deadline fired.
    Timer(Timer),
    /// Answer of [`Effect::Reserve`], which comes as a message (the row commits beside
    /// the rest of admission and the dispatch), never stepped at once.
    Reserved(Result<(), LedgerError>),
    /// Answer of [`Effect::RecordHolders`]: whether the record was written.
    HoldersRecorded(bool),
    /// Answer of [`Effect::Enqueue`].
    Enqueued(Result<(), Failure>),
    /// Answer of [`Effect::Record`] with `answer`: `None` when there is no record or the
    /// store could not be reached.
    Recorded(Option<Result<(), Refusal>>),
    /// Answer of [`Effect::Assign`]: false when the node's actor is gone (never sent).
    Assigned(bool),
    /// Answer of [`Effect::Tell`].
    Told(Result<(), SendError>),
    /// Answer of [`Effect::Settle`].
    Settled(Result<SettleOutcome, LedgerError>),
    /// Answer of [`Effect::LookUpRow`].
    RowLookedUp(Result<Option<LedgerEntry>, LedgerError>),
    /// Answer of [`Effect::CancelRow`]: whether the ledger answered.
    RowCancelled(bool),
    /// The actor stopped (for whatever reason): the safety net.
    Stopped,
}

/// What the core asks to be done. Answered at once (see [`Input`]): `RecordHolders`,
/// `Enqueue`, `Record` with `answer`, `Assign`, `Tell`, `Settle`, `LookUpRow`, `CancelRow`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Effect<N> {
    /// Answer the admission.
    Reply(Result<(), Failure>),
    /// Open the ledger row in the background; the answer comes later as [`Input::Reserved`].
    Reserve,
    /// Write which node holds each attempt to the coordinator (before any node hears of it).
    RecordHolders(BTreeMap<u64, String>),
    /// Enter the model's queue.
    Enqueue {
        /// At the front (a retry, a restarted queue).
        front: bool,
        /// A node not to use while another serves the model.
        avoid: Option<String>,
    },
    /// Leave the model's queue.
    Withdraw,
    /// Apply an event to the generation's record (if it has one).
    Record {
        /// The transition.
        event: Event,
        /// Whether its answer is wanted (then it ends its batch).
        answer: bool,
    },
    /// Send attempt `attempt` to `node`.
    Assign {
        /// The chosen node.
        node: N,
        /// The new epoch.
        attempt: u64,
    },
    /// Tell `node` to stop `attempt`.
    CancelOnNode {
        /// The node running it.
        node: N,
        /// The epoch to stop.
        attempt: u64,
    },
    /// Let `node` forget its `done` of `attempt`.
    Ack {
        /// The node that sent it.
        node: N,
        /// Its epoch.
        attempt: u64,
    },
    /// Report a frame `node` had no right to send.
    Violation {
        /// The sender.
        node: N,
        /// What it did.
        kind: Violation,
    },
    /// Give the queue back the slot it counted against this node.
    ReleaseSlot(String),
    /// Settle the row with a claim (the ledger bills it within the row's bounds).
    Settle {
        /// Prompt tokens claimed.
        prompt_tokens: u64,
        /// Completion tokens claimed.
        completion_tokens: u64,
        /// Mark the row for review.
        review: Option<ReviewReason>,
        /// The node that held the settled attempt (the per-node drift report).
        node_id: Option<String>,
    },
    /// Read where the row stands.
    LookUpRow,
    /// Cancel the row (no GPU work billed).
    CancelRow,
    /// Hand an event to the client's sender (which journals it and, if it can, delivers it).
    Tell(GenEvent),
    /// Count the outcome in `switchyard_requests_total` (once per generation).
    Count(Tally),
    /// A metric sample.
    Metric(Metric),
    /// Fire `timer` after `after`.
    ArmTimer {
        /// Which deadline.
        timer: Timer,
        /// From now.
        after: Duration,
    },
    /// Stop the actor (exactly once).
    Stop,
}

/// Metric samples, named in `metric_names.rs`; the actor adds the model label.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Metric {
    /// `STALE_FRAMES_TOTAL` with this reason.
    StaleFrame(&'static str),
    /// `QUEUE_WAIT_SECONDS`.
    QueueWait(f64),
    /// `TTFT_SECONDS`.
    Ttft(f64),
    /// `OUTPUT_TOKENS_PER_SECOND`.
    OutputRate(f64),
    /// `SLOW_READERS_TOTAL`.
    SlowReader,
    /// `USAGE_CLAMPED_TOTAL`.
    UsageClamped,
    /// `ACTIVE_STREAMS` up (admitted) or down (ended).
    ActiveStreams(bool),
    /// `SETTLED_TOKENS_TOTAL`: what a settle of this generation billed.
    SettledTokens {
        /// Prompt tokens billed.
        prompt: u64,
        /// Completion tokens billed.
        completion: u64,
    },
}

/// How a generation's outcome is counted in `switchyard_requests_total`'s `code` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tally {
    /// Completed.
    Ok,
    /// Cancelled by its owner.
    Cancelled,
    /// Its client left.
    ClientGone,
    /// Its reader fell behind the stream's bound.
    SlowReader,
    /// Failed with this code.
    Failed(ErrorCode),
}

impl Tally {
    /// The label's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Cancelled => "cancelled",
            Self::ClientGone => "client_gone",
            Self::SlowReader => "slow_reader",
            Self::Failed(code) => code.as_str(),
        }
    }
}
