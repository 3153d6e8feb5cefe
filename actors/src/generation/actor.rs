//! The [`GenerationActor`]: one request's lifecycle, from admission to its settled row.
//! This file holds the actor, its state and the forward path (admit, dispatch, stream);
//! `ending.rs` holds every way a generation ends.

use std::collections::BTreeMap;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use super::directory::Directory;
use super::ending::Claim;
use super::events::SendError;
use super::msg::{GenEvent, GenerationArgs, GenerationMsg, Timer};
use crate::error::{ErrorCode, Failure};
use crate::lifecycle::{Event, Refusal};
use crate::metric_names::{
    ACTIVE_STREAMS, QUEUE_WAIT_SECONDS, REQUESTS_TOTAL, SLOW_READERS_TOTAL, STALE_FRAMES_TOTAL,
    TTFT_SECONDS,
};
use crate::node::{NodeHandle, Violation, Work};
use crate::output::{Assembled, Piece};
use crate::ports::LedgerError;
use crate::tasks::TaskGuard;

/// Output kept for a lifecycle generation's result, at most.
const MAX_RETAINED_OUTPUT: usize = 1 << 20;

/// Where a generation is in its life.
#[derive(Debug)]
pub(super) enum Phase {
    /// Spawned, not yet admitted.
    New,
    /// Waiting in the model's queue.
    Queued,
    /// Assigned to a node under the current attempt.
    Running { node: NodeHandle },
    /// The node was lost before anything proved the attempt ran: waiting out its lease, so
    /// that it is fenced before anything else is decided.
    Fencing,
    /// The node was told to stop; waiting for its `done`.
    Cancelling,
    /// The node is gone or failed after accepting; waiting for a resent `done`.
    AwaitingDone,
}

/// Why the server is stopping a running generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// Cancelled: by its owner, by its client leaving, or for reading too slowly.
    Cancelled,
    /// Past a deadline.
    Timeout,
}

/// The actor's state.
#[derive(Debug)]
pub struct GenerationState {
    pub(super) args: GenerationArgs,
    pub(super) directory: Directory,
    pub(super) phase: Phase,
    /// Current attempt epoch; frames of other epochs are fenced.
    pub(super) attempt: u64,
    /// The node each attempt was dispatched to: a frame is believed only from its attempt's
    /// node (SPEC section 7, trust).
    pub(super) holders: BTreeMap<u64, String>,
    /// A lost or failed first attempt is retried once.
    pub(super) retried: bool,
    /// The current attempt is proven to have started (`accepted`, a chunk or `done`).
    pub(super) evidence: bool,
    /// Next expected chunk position of the current attempt.
    pub(super) next_seq: u64,
    /// Chunks received in the current attempt (the fallback usage when no `done` comes).
    pub(super) chunks: u64,
    /// The output so far, for a lifecycle generation's retained result.
    pub(super) output: String,
    /// Reasoning and tool calls of the retained output.
    pub(super) output_extra: Assembled,
    /// Bytes retained so far (text, reasoning, tool names and arguments), against
    /// `MAX_RETAINED_OUTPUT`.
    pub(super) retained_bytes: usize,
    /// The retained output reached its cap; later text is not kept.
    pub(super) output_full: bool,
    pub(super) stop: Option<Stop>,
    pub(super) client_gone: bool,
    /// The reader fell behind its bound: it gets no more deltas, only the end.
    pub(super) reader_behind: bool,
    /// A reader came back to this resumable generation ([`GenerationMsg::ClientBack`]):
    /// the cancel grace no longer cancels it.
    pub(super) reader_back: bool,
    /// The outcome was counted in `switchyard_requests_total` (once per generation).
    pub(super) counted: bool,
    /// The client has been sent its terminal event.
    pub(super) told_client: bool,
    /// The ledger row has reached a final state (or was never opened).
    pub(super) ledger_final: bool,
    /// Prompt plus completion tokens this generation settled (for tokens-per-day).
    pub(super) settled_tokens: Option<u64>,
    pub(super) admitted_at: Instant,
    pub(super) dispatched_at: Option<Instant>,
    pub(super) first_token_at: Option<Instant>,
    pub(super) last_token_at: Option<Instant>,
    pub(super) timers:
        Vec<ractor::concurrency::JoinHandle<Result<(), ractor::MessagingErr<GenerationMsg>>>>,
    _guard: TaskGuard,
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationActor;

impl Actor for GenerationActor {
    type Msg = GenerationMsg;
    type State = GenerationState;
    type Arguments = (GenerationArgs, Directory);

    async fn pre_start(
        &self,
        myself: ActorRef<GenerationMsg>,
        (args, directory): (GenerationArgs, Directory),
    ) -> Result<GenerationState, ActorProcessingErr> {
        directory.insert(&args.request_id, myself);
        let now = args.clock.now();
        Ok(GenerationState {
            args,
            directory,
            phase: Phase::New,
            attempt: 0,
            holders: BTreeMap::new(),
            retried: false,
            evidence: false,
            next_seq: 0,
            chunks: 0,
            output: String::new(),
            output_extra: Assembled::default(),
            retained_bytes: 0,
            output_full: false,
            stop: None,
            client_gone: false,
            reader_behind: false,
            reader_back: false,
            counted: false,
            told_client: false,
            ledger_final: true,
            settled_tokens: None,
            admitted_at: now,
            dispatched_at: None,
            first_token_at: None,
            last_token_at: None,
            timers: Vec::new(),
            _guard: TaskGuard::new("generation"),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<GenerationMsg>,
        msg: GenerationMsg,
        state: &mut GenerationState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            GenerationMsg::Admit(reply) => {
                let verdict = state.admit(&myself).await;
                let admitted = verdict.is_ok();
                let _ = reply.send(verdict);
                if !admitted {
                    myself.stop(None);
                }
            }
            GenerationMsg::Dispatch { node } => state.dispatch(&myself, node).await,
            GenerationMsg::QueueTimeout => {
                if matches!(state.phase, Phase::Queued) {
                    let failure = Failure::new(
                        ErrorCode::CapacityExhausted,
                        "No capacity freed up for this model within the queue deadline.",
                    )
                    .retry_after(5);
                    state.finish_without_work(&myself, failure).await;
                }
            }
            GenerationMsg::Accepted { attempt, from } => {
                if !state.vouch(&from, attempt) {
                    return Ok(());
                }
                if state.frame_is_current(attempt) {
                    state.prove_started().await;
                } else {
                    metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
                }
            }
            GenerationMsg::Chunk {
                attempt,
                seq,
                delta,
                from,
            } => {
                if state.vouch(&from, attempt) {
                    state.chunk(&myself, attempt, seq, delta, &from).await;
                }
            }
            GenerationMsg::Done {
                attempt,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                finish_reason,
                from,
            } => {
                if state.vouch(&from, attempt) {
                    let claim = Claim {
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        finish_reason,
                    };
                    state.done(&myself, attempt, claim, &from).await;
                }
            }
            GenerationMsg::EngineError {
                attempt,
                code,
                message,
                from,
            } => {
                if from.as_ref().is_some_and(|n| !state.vouch(n, attempt)) {
                    return Ok(());
                }
                if state.frame_is_current(attempt) {
                    state.engine_error(&myself, &code, &message).await;
                } else {
                    metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
                }
            }
            GenerationMsg::NodeLost { attempt } => {
                if attempt == state.attempt {
                    state.node_lost(&myself).await;
                }
            }
            GenerationMsg::ClientGone => state.client_gone(&myself).await,
            // Only a generation someone can come back to (it has a record) is kept alive.
            GenerationMsg::ClientBack => state.reader_back |= state.args.lifecycle.is_some(),
            GenerationMsg::Timer(Timer::CancelGrace) if state.reader_back => {}
            GenerationMsg::Cancel => state.cancel(&myself).await,
            GenerationMsg::Timer(timer) => state.timer(&myself, timer).await,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<GenerationMsg>,
        state: &mut GenerationState,
    ) -> Result<(), ActorProcessingErr> {
        for t in state.timers.drain(..) {
            t.abort();
        }
        if !state.ledger_final {
            match state.phase {
                // Stopped before any GPU work: release the reservation rather than leak it.
                Phase::New | Phase::Queued => {
                    let _ = state
                        .args
                        .ledger
                        .cancel(&state.args.reservation.request_id)
                        .await;
                }
                // Stopped (a replica shutting down) while a node may still be working: the
                // row stays reserved for the node's `done`, which it resends to whichever
                // replica it reconnects to; the record is expired by the sweeper.
                _ => {
                    tracing::info!(request_id = %state.args.request_id, "stopped mid-flight; the row awaits the node's done")
                }
            }
        }
        if !state.told_client {
            state.tell(GenEvent::Failed(Failure::new(
                ErrorCode::ModelBackendError,
                "The generation ended unexpectedly.",
            )));
        }
        if state.dispatched_at.is_some() || matches!(state.phase, Phase::Queued) {
            metrics::gauge!(ACTIVE_STREAMS).decrement(1.0);
        }
        state
            .directory
            .remove(&state.args.request_id, myself.get_id());
        if let Some(hook) = state.args.on_end.take() {
            hook.run(state.settled_tokens);
        }
        Ok(())
    }
}

impl GenerationState {
    pub(super) fn model(&self) -> String {
        self.args.model.clone()
    }

    /// Whether `from` holds `attempt` of this generation. A frame from any other node (a
    /// request it was never assigned, an epoch never dispatched to it) is refused and
    /// reported to its node, which counts the violation; it changes nothing here and is never
    /// acked.
    pub(super) fn vouch(&self, from: &NodeHandle, attempt: u64) -> bool {
        if self
            .holders
            .get(&attempt)
            .is_some_and(|node| node == from.node_id())
        {
            return true;
        }
        from.violation(Violation::ForeignRequest, Some(&self.args.request_id));
        false
    }

    /// A frame of the current attempt, while that attempt may be running.
    pub(super) fn frame_is_current(&self, attempt: u64) -> bool {
        attempt == self.attempt
            && matches!(
                self.phase,
                Phase::Running { .. } | Phase::Cancelling | Phase::AwaitingDone
            )
    }

    /// Sends an event to the client. A closed channel means the client left; a reader
    /// further behind than the stream's bound is treated as gone (and cancelled by the
    /// caller, see [`Self::slow_reader`]). A resumable generation (one with a record) hands
    /// every event to its sender even then, so its journal has them all; each way of losing
    /// the reader is reported once.
    pub(super) fn tell(&mut self, event: GenEvent) -> Option<SendError> {
        let terminal = !matches!(event, GenEvent::Delta(_));
        // The client's stream is deltas and then one end: text that arrives after the end
        // (a chunk racing a deadline) is not sent.
        if !terminal && self.told_client {
            return None;
        }
        if terminal {
            self.told_client = true;
        }
        let resumable = self.args.lifecycle.is_some();
        if !resumable && (self.client_gone || (self.reader_behind && !terminal)) {
            return None;
        }
        let now = self.args.clock.now();
        match self.args.events.send(event, now) {
            Ok(()) => None,
            Err(SendError::Overflow) if self.reader_behind => None,
            Err(SendError::Overflow) => {
                self.reader_behind = true;
                Some(SendError::Overflow)
            }
            Err(SendError::Closed) if self.client_gone => None,
            Err(SendError::Closed) => {
                self.client_gone = true;
                Some(SendError::Closed)
            }
        }
    }

    /// Counts the generation's outcome in `switchyard_requests_total`, once.
    pub(super) fn count(&mut self, code: &str) {
        if !self.counted {
            self.counted = true;
            metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => code.to_owned())
                .increment(1);
        }
    }

    /// Tells the client about a failure once and counts the outcome.
    pub(super) fn fail_client(&mut self, failure: Failure) {
        if !self.told_client {
            self.count(failure.code.as_str());
            self.tell(GenEvent::Failed(failure));
        }
    }

    pub(super) fn arm(&mut self, myself: &ActorRef<GenerationMsg>, after: Duration, timer: Timer) {
        self.timers
            .push(myself.send_after(after, move || GenerationMsg::Timer(timer)));
    }

    /// Applies `event` to the generation's record, if it has one. `None` when it has none
    /// or the store could not be reached (the sweeper reconciles it later).
    pub(super) async fn record(&self, event: Event) -> Option<Result<(), Refusal>> {
        let store = self.args.lifecycle.as_ref()?;
        let now = self.args.clock.wall().timestamp_millis();
        match store
            .apply_generation(&self.args.request_id, &event, now)
            .await
        {
            Ok(applied) => {
                if let Err(refusal) = &applied.result {
                    tracing::debug!(request_id = %self.args.request_id, %refusal, "record refused a transition");
                }
                Some(applied.result.map(|_| ()))
            }
            Err(e) => {
                tracing::warn!(request_id = %self.args.request_id, error = %e, "could not record a transition");
                None
            }
        }
    }

    async fn admit(&mut self, myself: &ActorRef<GenerationMsg>) -> Result<(), Failure> {
        let refused = match self.args.ledger.reserve(&self.args.reservation).await {
            Ok(()) => {
                self.ledger_final = false;
                None
            }
            Err(LedgerError::InsufficientBalance) => Some(Failure::new(
                ErrorCode::InsufficientBalance,
                "The team's balance cannot cover this request.",
            )),
            Err(LedgerError::Duplicate) => Some(Failure::new(
                ErrorCode::InvalidRequest,
                "Duplicate request id.",
            )),
            Err(LedgerError::Unavailable(_)) => Some(
                Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The ledger is unreachable; the request was not admitted.",
                )
                .retry_after(1),
            ),
        };
        if let Some(failure) = refused {
            self.reject_record(&failure).await;
            self.count(failure.code.as_str());
            self.told_client = true;
            return Err(failure);
        }
        // Known from admission on, so a `done` for it from a node it was never dispatched to
        // is refused wherever it arrives.
        if !self.record_holders().await {
            let failure = Failure::new(
                ErrorCode::QuotaServiceUnavailable,
                "The request could not be recorded; it was not admitted.",
            )
            .retry_after(1);
            self.cancel_row().await;
            self.reject_record(&failure).await;
            self.count(failure.code.as_str());
            self.told_client = true;
            return Err(failure);
        }
        let queue = self.args.queue.clone();
        if let Err(failure) = queue
            .enqueue(
                &self.args.request_id,
                myself.clone(),
                false,
                None,
                self.args.api,
            )
            .await
        {
            self.cancel_row().await;
            self.reject_record(&failure).await;
            self.count(failure.code.as_str());
            self.told_client = true;
            return Err(failure);
        }
        self.phase = Phase::Queued;
        self.admitted_at = self.args.clock.now();
        metrics::gauge!(ACTIVE_STREAMS).increment(1.0);
        let total = self.args.timeouts.total;
        self.arm(myself, total, Timer::Total);
        Ok(())
    }

    async fn dispatch(&mut self, myself: &ActorRef<GenerationMsg>, node: NodeHandle) {
        if !matches!(self.phase, Phase::Queued) || self.client_gone || self.stop.is_some() {
            // The queue counted this assignment against the node: give the slot back.
            self.args.queue.released(node.node_id());
            return;
        }
        let attempt = self.attempt + 1;
        // The epoch is recorded before any node hears of it, so a stale one can be fenced;
        // work whose epoch could not be recorded is not sent.
        let recorded = self.record(Event::Dispatch { attempt }).await;
        if recorded.is_none() && self.args.lifecycle.is_some() {
            self.args.queue.released(node.node_id());
            let failure = Failure::new(
                ErrorCode::QuotaServiceUnavailable,
                "The generation's record could not be updated; nothing was run.",
            )
            .retry_after(1);
            self.finish_without_work(myself, failure).await;
            return;
        }
        if let Some(Err(refusal)) = recorded {
            self.args.queue.released(node.node_id());
            match refusal {
                // Cancelled meanwhile through another replica.
                Refusal::NotAllowed(_) => {
                    self.stop = Some(Stop::Cancelled);
                    self.end_cancelled_without_work(myself).await;
                }
                // Ended elsewhere (the sweeper): nothing to run.
                Refusal::Final | Refusal::Stale => {
                    self.told_client = true;
                    self.cancel_row().await;
                    myself.stop(None);
                }
            }
            return;
        }
        self.attempt = attempt;
        self.evidence = false;
        self.next_seq = 0;
        self.chunks = 0;
        self.holders.insert(attempt, node.node_id().to_owned());
        if !self.record_holders().await {
            // Work whose node is not on record is not sent: a `done` for it could not be told
            // apart from another node's.
            self.args.queue.released(node.node_id());
            self.record(Event::Refuse { attempt }).await;
            let failure = Failure::new(
                ErrorCode::QuotaServiceUnavailable,
                "The request's dispatch could not be recorded; nothing was run.",
            )
            .retry_after(1);
            self.finish_without_work(myself, failure).await;
            return;
        }
        let now = self.args.clock.now();
        if self.dispatched_at.is_none() {
            let waited = now.saturating_duration_since(self.admitted_at);
            metrics::histogram!(QUEUE_WAIT_SECONDS, "model" => self.model())
                .record(waited.as_secs_f64());
        }
        self.dispatched_at = Some(now);
        let work = Work {
            model: self.args.model.clone(),
            body: self.args.body.clone(),
            api: self.args.api,
            x_request_id: self.args.x_request_id.clone(),
            traceparent: self.args.traceparent.clone(),
        };
        let lease_ms = u64::try_from(self.args.timeouts.lease.as_millis()).ok();
        if !node.assign(
            &self.args.request_id,
            self.attempt,
            work,
            lease_ms,
            myself.clone(),
        ) {
            // Never sent: proven not started.
            self.args.queue.released(node.node_id());
            self.phase = Phase::Running { node };
            self.engine_error(myself, "not_sent", "the node's connection is gone")
                .await;
            return;
        }
        tracing::debug!(request_id = %self.args.request_id, node_id = node.node_id(), attempt = self.attempt, "dispatched");
        self.phase = Phase::Running { node };
        let first = self.args.timeouts.first_token;
        self.arm(myself, first, Timer::FirstToken);
    }

    /// Writes that this generation was admitted and which node holds each attempt to the
    /// coordinator, before the node hears of the newest one, so that a `done` arriving where
    /// this actor is not live is accepted only from its node. False when it could not be
    /// written: then nothing is sent.
    async fn record_holders(&self) -> bool {
        let Some(coordinator) = &self.args.coordinator else {
            return true;
        };
        let t = &self.args.timeouts;
        // The longest a `done` may arrive: the whole request, the wait for its usage, and the
        // sweeper's margin (the row is swept after that anyway).
        let ttl = t.total + t.settle_wait + Duration::from_secs(60);
        if let Err(e) = crate::attempts::record(
            coordinator.as_ref(),
            &self.args.request_id,
            &self.holders,
            ttl,
        )
        .await
        {
            tracing::warn!(request_id = %self.args.request_id, error = %e, "could not record the attempt's node; not sending it");
            return false;
        }
        true
    }

    /// The current attempt proved it started: the message is consumed (once).
    pub(super) async fn prove_started(&mut self) {
        if !self.evidence {
            self.evidence = true;
            let attempt = self.attempt;
            self.record(Event::Accept { attempt }).await;
        }
    }

    async fn chunk(
        &mut self,
        myself: &ActorRef<GenerationMsg>,
        attempt: u64,
        seq: u64,
        delta: Piece,
        from: &NodeHandle,
    ) {
        if !self.frame_is_current(attempt) {
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
            return;
        }
        if seq < self.next_seq {
            // The agent sends each chunk once, in order: a `seq` going backwards is a lie.
            from.violation(Violation::SeqRegression, Some(&self.args.request_id));
            return;
        }
        if seq > self.next_seq {
            tracing::warn!(request_id = %self.args.request_id, expected = self.next_seq, got = seq, "gap in chunk sequence");
        }
        self.prove_started().await;
        self.next_seq = seq.saturating_add(1);
        self.chunks += 1;
        let now = self.args.clock.now();
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
            let ttft = now.saturating_duration_since(self.admitted_at);
            metrics::histogram!(TTFT_SECONDS, "model" => self.model()).record(ttft.as_secs_f64());
        }
        self.last_token_at = Some(now);
        if self.args.lifecycle.is_some() && !self.output_full {
            // What is kept: the text, reasoning and tool calls (never the logprobs).
            let calls: usize = delta
                .tool_calls
                .iter()
                .filter_map(|c| c.function.as_ref())
                .map(|f| {
                    f.name.as_ref().map_or(0, String::len)
                        + f.arguments.as_ref().map_or(0, String::len)
                })
                .sum();
            let adds = delta.text.len() + delta.reasoning.len() + calls;
            if self.retained_bytes + adds <= MAX_RETAINED_OUTPUT {
                self.retained_bytes += adds;
                self.output.push_str(&delta.text);
                if !delta.tool_calls.is_empty() || !delta.reasoning.is_empty() {
                    self.output_extra.push(&Piece {
                        text: String::new(),
                        raw: None,
                        logprobs: None,
                        ..delta.clone()
                    });
                }
            } else {
                // A retained result is a prefix of the answer, never one with a hole.
                self.output_full = true;
            }
        }
        if self.tell(GenEvent::Delta(delta)) == Some(SendError::Overflow) {
            self.slow_reader(myself).await;
        }
    }

    /// The reader fell behind its bound: cancel the generation now, as if it had left,
    /// without the grace period (it is still connected, only too slow).
    async fn slow_reader(&mut self, myself: &ActorRef<GenerationMsg>) {
        metrics::counter!(SLOW_READERS_TOTAL, "model" => self.model()).increment(1);
        tracing::info!(request_id = %self.args.request_id, "reader fell behind the stream bound; cancelling");
        self.record(Event::RequestCancel).await;
        self.stop = Some(Stop::Cancelled);
        self.count("slow_reader");
        self.cancel_on_node(myself);
    }
}
