//! One generation's control logic as a pure state machine: [`Core::step`] takes an input (a
//! message, a fired timer, or the answer of an I/O it asked for) and the time, and returns the
//! [`Effect`]s to carry out. No I/O, no clock, no ractor: the actor in `actor.rs` carries out
//! the effects. This file holds the state and routes inputs; `forward.rs` the forward path,
//! `ending.rs` every way it ends, `settle.rs` the row's settle, `effects.rs` the vocabulary.
//!
//! The contract with whoever carries the effects out: effects run in order, and the answer of
//! one (see [`Effect`]) is stepped at once, its effects carried out before the rest of the
//! batch, with no other input in between. An effect whose answer decides what comes next is
//! always the last of its batch.

mod effects;
mod ending;
mod forward;
mod settle;

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::events::SendError;
use super::msg::{GenEvent, Timeouts, Timer};
use crate::error::{ErrorCode, Failure};
use crate::lifecycle::Event;
use crate::node::Violation;
use crate::output::Assembled;
use crate::ports::UsageBounds;

pub(crate) use effects::{Effect, Input, Metric, Tally};
pub(super) use ending::Claim;
use settle::AfterSettle;

/// How many times one generation goes back to the queue after an assignment that never
/// reached a node (beside the one retry after a refusal or a lost node).
pub(crate) const MAX_UNDELIVERED: u8 = 3;

/// What the core needs of a node connection: who it is. The actor passes `NodeHandle`s; the
/// property tests pass plain ids.
pub(crate) trait NodeRef: Clone + std::fmt::Debug {
    /// The node's id, as the holders record keeps it.
    fn node_id(&self) -> &str;
}

/// Why the server is stopping a running generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Cancelled: by its owner, by its client leaving, or for reading too slowly.
    Cancelled,
    /// Past a deadline.
    Timeout,
    /// The node sent more output than the request allows ([`Config::output_bytes`]).
    OverBound,
}

/// The steps of admission, each waiting for its answer. The ledger row is opened beside them
/// (see [`Row::Reserving`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitting {
    /// The holders record (admitted, no attempt yet) is being written.
    RecordingHolders,
    /// The queue is being entered.
    Enqueueing,
}

/// The steps of a dispatch, each waiting for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dispatching {
    /// The new epoch is being recorded.
    RecordingEpoch,
    /// The new holder is being written to the coordinator.
    RecordingHolders,
    /// The assignment is being handed to the node's actor.
    Assigning,
}

/// Where a generation is in its life: the one state.
#[derive(Debug, Clone)]
pub(crate) enum Where<N> {
    /// Spawned, not yet admitted.
    New,
    /// Being admitted.
    Admitting(Admitting),
    /// Waiting in the model's queue.
    Queued {
        /// The node it asked the queue to avoid (kept for a re-enqueue).
        avoid: Option<String>,
    },
    /// Entering the queue again (a retry, or a restarted queue).
    Requeueing {
        /// The node it asks the queue to avoid.
        avoid: Option<String>,
    },
    /// The queue gave it `node`; the attempt is being recorded and sent.
    Dispatching {
        /// The chosen node.
        node: N,
        /// Which answer it waits for.
        step: Dispatching,
    },
    /// Assigned to `node` under the current attempt; nobody asked it to stop.
    Running {
        /// The node holding the current attempt.
        node: N,
    },
    /// The node was lost before anything proved the attempt ran: waiting out its lease, so
    /// that it is fenced before anything else is decided.
    Fencing {
        /// Why the server stops it, once the fence is over.
        stop: Option<Stop>,
    },
    /// The node was told to stop; waiting for its `done`.
    Cancelling {
        /// Why.
        stop: Stop,
    },
    /// The node is gone or failed after accepting; waiting for a resent `done`.
    AwaitingDone {
        /// Why the server stops it, if it does.
        stop: Option<Stop>,
    },
    /// Settling the row; retries are timers, the answers come back as inputs.
    Settling(settle::Settling<N>),
    /// A failure before any work is being recorded (`Reject`); what follows depends on it.
    Rejecting {
        /// The failure.
        failure: Failure,
        /// Whether the admission is answered (else the client is told).
        admission: bool,
    },
    /// Stopped.
    Ended {
        /// It stopped before any node could have heard of it (the safety net releases the
        /// row if the end could not).
        before_work: bool,
    },
}

/// Fixed facts of one generation.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// For logs only.
    pub request_id: String,
    /// The model (its queue's restarts concern it).
    pub model: String,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// The most a node may bill.
    pub bounds: UsageBounds,
    /// The gateway's prompt count (fallback usage once anything streamed).
    pub estimated_prompt_tokens: u64,
    /// The most output a node may send, in bytes as they arrive
    /// ([`crate::output::output_bound`]): past it nothing more is kept or relayed.
    pub output_bytes: u64,
    /// The generation has a lifecycle record: its output is kept.
    pub recorded: bool,
    /// Its client may come back to it (an Idempotency-Key, the Generations API), so a
    /// leaving client gets the grace. A record alone (a principal whose messages are
    /// metered) does not make it so: nobody can ask for that answer again.
    pub resumable: bool,
}

/// The current attempt's progress.
#[derive(Debug, Clone, Default)]
pub(crate) struct Attempt {
    /// Current epoch; frames of other epochs are fenced. 0 before the first dispatch.
    pub epoch: u64,
    /// The attempt is proven to have started (`accepted`, a chunk or `done`).
    pub evidence: bool,
    /// Next expected chunk position.
    pub next_seq: u64,
    /// Chunks received (the fallback usage when no `done` comes).
    pub chunks: u64,
    /// A chunk's `seq` skipped ahead: some output never arrived.
    pub gap: bool,
    /// Output bytes received ([`crate::output::Piece::size`]), against
    /// [`Config::output_bytes`].
    pub bytes: u64,
}

/// The client's reader, as far as the sender or the stream's drop guard said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reader {
    /// Reading.
    Reading,
    /// Fell behind the stream's bound once (the generation was cancelled for it).
    Behind,
    /// Left (its stream dropped, or the channel closed).
    Gone,
}

/// Where the ledger row stands for this generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Row {
    /// Never opened.
    Unopened,
    /// Being opened, beside the rest of admission and the dispatch: its answer comes as a
    /// message ([`Input::Reserved`]). Until it does, nothing reaches the client, the admission
    /// is not answered, the actor does not stop, and every input that could end or advance
    /// the attempt waits in [`Core::held`].
    Reserving,
    /// Reserved: this generation still has to finalise it.
    Reserved,
    /// Final, or left to the node's resent `done` and the sweeper: never touched again.
    Done,
}

/// Output kept for a lifecycle generation's result.
#[derive(Debug, Clone, Default)]
pub(crate) struct Retained {
    /// The text.
    pub text: String,
    /// Reasoning and tool calls.
    pub extra: Assembled,
    /// Bytes kept so far, against `forward::MAX_RETAINED_OUTPUT`.
    pub bytes: usize,
    /// The cap was reached: a retained result is a prefix, never one with a hole.
    pub full: bool,
}

/// The state of one generation.
#[derive(Debug)]
pub(crate) struct Core<N> {
    /// Fixed facts.
    pub cfg: Config,
    /// Where it is.
    pub at: Where<N>,
    /// The current attempt.
    pub attempt: Attempt,
    /// The node each attempt was dispatched to: a frame is believed only from its attempt's
    /// node (SPEC section 7, trust).
    pub holders: BTreeMap<u64, String>,
    /// A lost or refused first attempt is retried once.
    pub retried: bool,
    /// Attempts that never reached a node (`not_sent`), re-enqueued without spending the
    /// retry, up to [`MAX_UNDELIVERED`].
    pub undelivered: u8,
    /// The client's reader.
    pub reader: Reader,
    /// The serial of the cancel grace running now, if any (a `ClientBack` ends it; a timer
    /// of an older grace does nothing).
    pub grace: Option<u64>,
    /// Graces started so far (their serials).
    pub graces: u64,
    /// The terminal event was handed to the sender: no delta follows it.
    pub told: bool,
    /// The outcome was counted (once per generation).
    pub counted: bool,
    /// The ledger row.
    pub row: Row,
    /// Prompt plus completion tokens this generation settled (for tokens-per-day).
    pub settled_tokens: Option<u64>,
    /// `ACTIVE_STREAMS` was raised for it (lowered once when it stops).
    pub active: bool,
    /// When it entered the queue.
    pub admitted_at: Instant,
    /// When it was last dispatched.
    pub dispatched_at: Option<Instant>,
    /// Its first token (TTFT; `FirstToken` does nothing once it came).
    pub first_token_at: Option<Instant>,
    /// Its latest token (output rate).
    pub last_token_at: Option<Instant>,
    /// Output kept for the record.
    pub retained: Retained,
    /// Inputs that arrived while the row was [`Row::Reserving`], in order: stepped once it is
    /// reserved (see [`Core::next_held`]), dropped if it is refused.
    pub held: std::collections::VecDeque<Input<N>>,
    /// The admission's answer, decided while the row was still being opened: given once the
    /// row has answered, so a client is admitted only on a committed row and refused only
    /// once nothing of it stays reserved.
    pub reply_waits: Option<Result<(), Failure>>,
}

/// What the client is told when its node sent more than the request allows.
fn over_bound() -> Failure {
    Failure::new(
        ErrorCode::ModelBackendError,
        "The engine's answer exceeded the size its request allows; the generation was stopped.",
    )
}

/// The effects of one step.
type Fx<N> = Vec<Effect<N>>;

/// Whether `input` waits while the row is being opened: everything from the node, the client,
/// the owner and the clock. The answers of the core's own I/O never wait (they are stepped
/// at once), nor does a dispatch: the work goes to the node while the row commits, so the
/// engine's prefill overlaps the reservation.
fn waits_for_row<N>(input: &Input<N>) -> bool {
    matches!(
        input,
        Input::QueueTimeout
            | Input::QueueRestarted { .. }
            | Input::Accepted { .. }
            | Input::Chunk { .. }
            | Input::Done { .. }
            | Input::EngineError { .. }
            | Input::NodeLost { .. }
            | Input::NodeGone { .. }
            | Input::ClientGone
            | Input::ClientBack
            | Input::Cancel
            | Input::Timer(_)
    )
}

impl<N: NodeRef> Core<N> {
    /// A generation spawned at `now`.
    pub(crate) fn new(cfg: Config, now: Instant) -> Self {
        Self {
            cfg,
            at: Where::New,
            attempt: Attempt::default(),
            holders: BTreeMap::new(),
            retried: false,
            undelivered: 0,
            reader: Reader::Reading,
            grace: None,
            graces: 0,
            told: false,
            counted: false,
            row: Row::Unopened,
            settled_tokens: None,
            active: false,
            admitted_at: now,
            dispatched_at: None,
            first_token_at: None,
            last_token_at: None,
            retained: Retained::default(),
            held: std::collections::VecDeque::new(),
            reply_waits: None,
        }
    }

    /// The next held input to step, once the row is reserved: the actor steps it (and carries
    /// out its effects) before any new message, so held inputs keep their order.
    pub(crate) fn next_held(&mut self) -> Option<Input<N>> {
        if self.row == Row::Reserving {
            return None;
        }
        self.held.pop_front()
    }

    /// Takes one input at `now` and says what to do.
    pub(crate) fn step(&mut self, input: Input<N>, now: Instant) -> Fx<N> {
        let mut fx = Vec::new();
        if matches!(self.at, Where::Ended { .. }) && !matches!(input, Input::Stopped) {
            // Stopped: answers of the last effects only matter for the row, and a dispatch that
            // raced the end gives its slot back (the actor may still wait for its row).
            match input {
                Input::RowCancelled(ok) => self.row_cancelled(ok),
                Input::Reserved(r) => self.reserved(r, &mut fx),
                Input::Dispatch { node } => {
                    fx.push(Effect::ReleaseSlot(node.node_id().to_owned()));
                }
                _ => {}
            }
            return fx;
        }
        if self.row == Row::Reserving && waits_for_row(&input) {
            // A frame is vouched for as it arrives (its node must hold its attempt now), and
            // again when it is stepped.
            let stranger = match &input {
                Input::Accepted { attempt, from }
                | Input::Chunk { attempt, from, .. }
                | Input::Done { attempt, from, .. }
                | Input::EngineError {
                    attempt,
                    from: Some(from),
                    ..
                } => !self.vouch(from, *attempt, &mut fx),
                _ => false,
            };
            if !stranger {
                self.held.push_back(input);
            }
            return fx;
        }
        match input {
            Input::Admit => self.admit(&mut fx),
            Input::Reserved(r) => self.reserved(r, &mut fx),
            Input::HoldersRecorded(ok) => self.holders_recorded(ok, now, &mut fx),
            Input::Enqueued(r) => self.enqueued(r, now, &mut fx),
            Input::Dispatch { node } => self.dispatch(node, &mut fx),
            Input::Recorded(r) => self.recorded(r, &mut fx),
            Input::Assigned(sent) => self.assigned(sent, &mut fx),
            Input::QueueTimeout => {
                if matches!(self.at, Where::Queued { .. }) {
                    let failure = Failure::new(
                        ErrorCode::CapacityExhausted,
                        "No capacity freed up for this model within the queue deadline.",
                    )
                    .retry_after(5);
                    self.finish_without_work(failure, &mut fx);
                }
            }
            Input::QueueRestarted { model } => {
                if model == self.cfg.model
                    && let Where::Queued { avoid } = &self.at
                {
                    let avoid = avoid.clone();
                    fx.push(Effect::Enqueue {
                        front: true,
                        avoid: avoid.clone(),
                    });
                    self.at = Where::Requeueing { avoid };
                }
            }
            Input::Accepted { attempt, from } => {
                if self.vouch(&from, attempt, &mut fx) {
                    if self.frame_is_current(attempt) {
                        self.prove_started(&mut fx);
                    } else {
                        fx.push(Effect::Metric(Metric::StaleFrame("old_attempt")));
                    }
                }
            }
            Input::Chunk {
                attempt,
                seq,
                delta,
                from,
            } => {
                if self.vouch(&from, attempt, &mut fx) {
                    self.chunk(attempt, seq, delta, from, now, &mut fx);
                }
            }
            Input::Done {
                attempt,
                claim,
                from,
            } => {
                if self.vouch(&from, attempt, &mut fx) {
                    self.done(attempt, claim, from, &mut fx);
                }
            }
            Input::EngineError {
                attempt,
                code,
                message,
                from,
            } => {
                if let Some(node) = &from
                    && !self.vouch(node, attempt, &mut fx)
                {
                    return fx;
                }
                if self.frame_is_current(attempt) {
                    self.engine_error(&code, &message, &mut fx);
                } else {
                    fx.push(Effect::Metric(Metric::StaleFrame("old_attempt")));
                }
            }
            Input::NodeLost { attempt } => {
                if attempt == self.attempt.epoch {
                    self.node_lost(&mut fx);
                }
            }
            Input::NodeGone { node_id } => {
                if self
                    .holders
                    .get(&self.attempt.epoch)
                    .is_some_and(|n| *n == node_id)
                {
                    self.node_lost(&mut fx);
                }
            }
            Input::ClientGone => self.client_gone(&mut fx),
            Input::ClientBack => self.client_back(),
            Input::RecordAgain => self.record_again(&mut fx),
            Input::Cancel => self.cancel(&mut fx),
            Input::Timer(timer) => self.timer(timer, &mut fx),
            Input::Told(r) => self.told(r, &mut fx),
            Input::Settled(r) => self.settled(r, &mut fx),
            Input::RowLookedUp(r) => self.row_looked_up(r, &mut fx),
            Input::RowCancelled(ok) => self.row_cancelled(ok),
            Input::Stopped => self.stopped(&mut fx),
        }
        fx
    }

    /// Whether `from` holds `attempt` of this generation. A frame from any other node (a
    /// request it was never assigned, an epoch never dispatched to it) is refused and
    /// reported to its node, which counts the violation; it changes nothing here and is never
    /// acked. Once the row is being settled nothing is looked at any more.
    fn vouch(&self, from: &N, attempt: u64, fx: &mut Fx<N>) -> bool {
        if matches!(self.at, Where::Settling(_)) {
            return false;
        }
        if self
            .holders
            .get(&attempt)
            .is_some_and(|node| node == from.node_id())
        {
            return true;
        }
        fx.push(Effect::Violation {
            node: from.clone(),
            kind: Violation::ForeignRequest,
        });
        false
    }

    /// A frame of the current attempt, while that attempt may be running.
    fn frame_is_current(&self, attempt: u64) -> bool {
        attempt == self.attempt.epoch
            && matches!(
                self.at,
                Where::Running { .. } | Where::Cancelling { .. } | Where::AwaitingDone { .. }
            )
    }

    /// Hands an event to the client's sender. Every delta goes, even to a reader that left or
    /// fell behind (the sender journals it for a resumed stream), but none after the end.
    /// The client's stream is deltas and then one end: text that arrives after the end (a
    /// chunk racing a deadline) is not sent, nor is a second end (a cancel after a timeout was
    /// told, confirmed by the node's `abort`).
    fn tell(&mut self, event: GenEvent, fx: &mut Fx<N>) {
        if self.told {
            return;
        }
        if !matches!(event, GenEvent::Delta(_)) {
            self.told = true;
        }
        fx.push(Effect::Tell(event));
    }

    /// What the sender said: a closed channel means the client left; the first overflow of
    /// a reader still there cancels the generation (see [`Self::slow_reader`]).
    fn told(&mut self, result: Result<(), SendError>, fx: &mut Fx<N>) {
        match result {
            Ok(()) => {}
            Err(SendError::Closed) => self.reader = Reader::Gone,
            // A reader that left also stops reading: its overflow is no slow reader.
            Err(SendError::Overflow) if self.reader == Reader::Reading => {
                self.reader = Reader::Behind;
                self.slow_reader(fx);
            }
            Err(SendError::Overflow) => {}
        }
    }

    /// Counts the generation's outcome, once.
    fn count(&mut self, tally: Tally, fx: &mut Fx<N>) {
        if !self.counted {
            self.counted = true;
            fx.push(Effect::Count(tally));
        }
    }

    /// Tells the client about a failure once and counts the outcome.
    fn fail_client(&mut self, failure: Failure, fx: &mut Fx<N>) {
        if !self.told {
            self.count(Tally::Failed(failure.code), fx);
            self.tell(GenEvent::Failed(failure), fx);
        }
    }

    fn record(&self, event: Event, fx: &mut Fx<N>) {
        fx.push(Effect::Record {
            event,
            answer: false,
        });
    }

    fn arm(&self, timer: Timer, after: Duration, fx: &mut Fx<N>) {
        fx.push(Effect::ArmTimer { timer, after });
    }

    /// The reader fell behind its bound: cancel the generation now, as if it had left,
    /// without the grace period (it is still connected, only too slow).
    fn slow_reader(&mut self, fx: &mut Fx<N>) {
        fx.push(Effect::Metric(Metric::SlowReader));
        tracing::info!(request_id = %self.cfg.request_id, "reader fell behind the stream bound; cancelling");
        self.record(Event::RequestCancel, fx);
        self.count(Tally::SlowReader, fx);
        self.cancel_on_node(Stop::Cancelled, fx);
    }

    /// Tells the node to stop and waits for its `done` with the usage so far. Already
    /// stopping, only the reason and the wait change.
    fn cancel_on_node(&mut self, stop: Stop, fx: &mut Fx<N>) {
        match &self.at {
            Where::Running { node } => {
                fx.push(Effect::CancelOnNode {
                    node: node.clone(),
                    attempt: self.attempt.epoch,
                });
                self.at = Where::Cancelling { stop };
            }
            Where::Cancelling { .. } | Where::AwaitingDone { .. } => {
                self.at = Where::AwaitingDone { stop: Some(stop) };
            }
            _ => return,
        }
        self.arm(Timer::SettleWait, self.cfg.timeouts.settle_wait, fx);
    }

    /// Stops the actor, once.
    fn end(&mut self, fx: &mut Fx<N>) {
        let before_work = matches!(
            self.at,
            Where::New
                | Where::Admitting(_)
                | Where::Queued { .. }
                | Where::Requeueing { .. }
                | Where::Rejecting { .. }
                | Where::Dispatching {
                    step: Dispatching::RecordingEpoch | Dispatching::RecordingHolders,
                    ..
                }
        );
        self.at = Where::Ended { before_work };
        // A row still being opened is waited for: its answer decides whether there is a row
        // to release (see `reserved`), and an actor gone before it would leave it to the sweeper.
        if self.row != Row::Reserving {
            fx.push(Effect::Stop);
        }
    }

    /// The actor stopped: whatever the path, the row is not leaked when nothing ran, the
    /// client hears an end, and the active-streams gauge comes down.
    fn stopped(&mut self, fx: &mut Fx<N>) {
        let before_work = match &self.at {
            Where::Ended { before_work } => *before_work,
            Where::New | Where::Admitting(_) | Where::Queued { .. } | Where::Requeueing { .. } => {
                true
            }
            Where::Dispatching { step, .. } => *step != Dispatching::Assigning,
            _ => false,
        };
        if self.row == Row::Reserving {
            // Stopped from outside while the row was being opened: if it commits, nothing
            // ever ran for it unless the work was sent, and then the node's resent `done`
            // settles it; otherwise the sweeper releases it.
            tracing::info!(request_id = %self.cfg.request_id, "stopped while its row was being opened");
        }
        if self.row == Row::Reserved {
            if before_work {
                // Stopped before any GPU work: release the reservation rather than leak it.
                fx.push(Effect::CancelRow);
            } else {
                // Stopped (a replica shutting down) while a node may still be working: the
                // row stays reserved for the node's `done`, which it resends to whichever
                // replica it reconnects to; the record is expired by the sweeper.
                tracing::info!(request_id = %self.cfg.request_id, "stopped mid-flight; the row awaits the node's done");
            }
        }
        let unexpected = || {
            Failure::new(
                ErrorCode::ModelBackendError,
                "The generation ended unexpectedly.",
            )
        };
        match self.reply_waits.take() {
            // The admission waited for a row that never answered: it is refused, never
            // admitted on a row that did not commit.
            Some(Ok(())) => {
                self.told = true;
                fx.push(Effect::Reply(Err(unexpected())));
            }
            Some(Err(refusal)) => fx.push(Effect::Reply(Err(refusal))),
            None if !self.told => self.tell(GenEvent::Failed(unexpected()), fx),
            None => {}
        }
        if std::mem::take(&mut self.active) {
            fx.push(Effect::Metric(Metric::ActiveStreams(false)));
        }
        self.at = Where::Ended { before_work };
    }

    /// Prompt plus completion tokens this generation settled, for the end hook.
    pub(crate) fn settled_tokens(&self) -> Option<u64> {
        self.settled_tokens
    }
}
