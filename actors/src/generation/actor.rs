//! The [`GenerationActor`]: one request's lifecycle, from admission to its settled row.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::time::Instant;

use super::directory::Directory;
use super::msg::{GenEvent, GenerationArgs, GenerationMsg, Timer, Usage};
use crate::error::{ErrorCode, Failure};
use crate::metric_names::{
    ACTIVE_STREAMS, OUTPUT_TOKENS_PER_SECOND, QUEUE_WAIT_SECONDS, REQUESTS_TOTAL,
    STALE_FRAMES_TOTAL, TTFT_SECONDS,
};
use crate::node::NodeHandle;
use crate::ports::{LedgerError, SettleOutcome, Settlement};
use crate::tasks::TaskGuard;

/// Where a generation is in its life.
#[derive(Debug)]
enum Phase {
    /// Spawned, not yet admitted.
    New,
    /// Waiting in the model's queue.
    Queued,
    /// Assigned to a node under the current attempt.
    Running { node: NodeHandle, accepted: bool },
    /// The node was told to stop; waiting for its `done`.
    Cancelling,
    /// The node is gone or failed after accepting; waiting for a resent `done`.
    AwaitingDone,
}

/// The actor's state.
#[derive(Debug)]
pub struct GenerationState {
    args: GenerationArgs,
    directory: Directory,
    phase: Phase,
    /// Current attempt epoch; frames of other epochs are fenced.
    attempt: u64,
    /// A lost or failed first attempt is retried once.
    retried: bool,
    /// Next expected chunk position of the current attempt.
    next_seq: u64,
    /// Chunks received in the current attempt (the fallback usage when no `done` comes).
    chunks: u64,
    client_gone: bool,
    /// The client has been sent its terminal event.
    told_client: bool,
    /// The ledger row has reached a final state (or was never opened).
    ledger_final: bool,
    /// Prompt plus completion tokens this generation settled (for tokens-per-day).
    settled_tokens: Option<u64>,
    admitted_at: Instant,
    dispatched_at: Option<Instant>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    timers: Vec<ractor::concurrency::JoinHandle<Result<(), ractor::MessagingErr<GenerationMsg>>>>,
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
            attempt: 1,
            retried: false,
            next_seq: 0,
            chunks: 0,
            client_gone: false,
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
            GenerationMsg::Accepted { attempt } => {
                if let Phase::Running { accepted, .. } = &mut state.phase
                    && attempt == state.attempt
                {
                    *accepted = true;
                }
            }
            GenerationMsg::Chunk {
                attempt,
                seq,
                delta,
            } => state.chunk(attempt, seq, delta),
            GenerationMsg::Done {
                attempt,
                prompt_tokens,
                completion_tokens,
                finish_reason,
                node,
            } => {
                if attempt != state.attempt {
                    // An older attempt's report: the node may forget it; it is not billed.
                    metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
                    node.ack(&state.args.request_id, attempt);
                    return Ok(());
                }
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                };
                state.done(&myself, usage, &node).await;
            }
            GenerationMsg::EngineError {
                attempt,
                code,
                message,
            } => {
                if attempt == state.attempt {
                    state.engine_error(&myself, &code, &message).await;
                }
            }
            GenerationMsg::NodeLost { attempt } => {
                if attempt == state.attempt {
                    state.node_lost(&myself).await;
                }
            }
            GenerationMsg::ClientGone => state.client_gone(&myself).await,
            GenerationMsg::Timer(timer) => state.timer(&myself, timer).await,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<GenerationMsg>,
        state: &mut GenerationState,
    ) -> Result<(), ActorProcessingErr> {
        for t in state.timers.drain(..) {
            t.abort();
        }
        if !state.ledger_final {
            match state.phase {
                // Stopped before any GPU work: release the reservation rather than leak it.
                Phase::New | Phase::Queued => {
                    let _ = state.args.ledger.cancel(&state.args.request_id).await;
                }
                // Stopped (a replica shutting down) while a node may still be working: the
                // row stays reserved for the node's `done`, which it resends to whichever
                // replica it reconnects to.
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
        state.directory.remove(&state.args.request_id);
        if let Some(hook) = state.args.on_end.take() {
            (hook.0)(state.settled_tokens);
        }
        Ok(())
    }
}

impl GenerationState {
    fn model(&self) -> String {
        self.args.model.clone()
    }

    /// Sends an event to the client; a closed channel means the client left.
    fn tell(&mut self, event: GenEvent) {
        let terminal = !matches!(event, GenEvent::Delta(_));
        if self.client_gone {
            return;
        }
        if self.args.events.send(event).is_err() {
            self.client_gone = true;
        }
        if terminal {
            self.told_client = true;
        }
    }

    /// Tells the client about a failure once and counts the outcome.
    fn fail_client(&mut self, failure: Failure) {
        if !self.told_client {
            metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => failure.code.as_str())
                .increment(1);
            self.tell(GenEvent::Failed(failure));
            self.told_client = true;
        }
    }

    fn arm(&mut self, myself: &ActorRef<GenerationMsg>, after: Duration, timer: Timer) {
        self.timers
            .push(myself.send_after(after, move || GenerationMsg::Timer(timer)));
    }

    async fn admit(&mut self, myself: &ActorRef<GenerationMsg>) -> Result<(), Failure> {
        match self.args.ledger.reserve(&self.args.reservation).await {
            Ok(()) => self.ledger_final = false,
            Err(LedgerError::InsufficientBalance) => {
                return Err(Failure::new(
                    ErrorCode::InsufficientBalance,
                    "The team's balance cannot cover this request.",
                ));
            }
            Err(LedgerError::Duplicate) => {
                return Err(Failure::new(
                    ErrorCode::InvalidRequest,
                    "Duplicate request id.",
                ));
            }
            Err(LedgerError::Unavailable(_)) => {
                return Err(Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The ledger is unreachable; the request was not admitted.",
                )
                .retry_after(1));
            }
        }
        let queue = self.args.queue.clone();
        if let Err(failure) = queue
            .enqueue(&self.args.request_id, myself.clone(), false)
            .await
        {
            self.cancel_row().await;
            metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => failure.code.as_str())
                .increment(1);
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
        if !matches!(self.phase, Phase::Queued) || self.client_gone {
            // The queue counted this assignment against the node: give the slot back.
            self.args.queue.released(node.node_id());
            return;
        }
        let now = self.args.clock.now();
        if self.dispatched_at.is_none() {
            let waited = now.saturating_duration_since(self.admitted_at);
            metrics::histogram!(QUEUE_WAIT_SECONDS, "model" => self.model())
                .record(waited.as_secs_f64());
        }
        self.dispatched_at = Some(now);
        let body = self.args.body.clone();
        if !node.assign(
            &self.args.request_id,
            self.attempt,
            &self.args.model,
            body,
            myself.clone(),
        ) {
            self.args.queue.released(node.node_id());
            self.phase = Phase::Running {
                node,
                accepted: false,
            };
            self.node_lost(myself).await;
            return;
        }
        tracing::debug!(request_id = %self.args.request_id, node_id = node.node_id(), attempt = self.attempt, "dispatched");
        self.phase = Phase::Running {
            node,
            accepted: false,
        };
        let first = self.args.timeouts.first_token;
        self.arm(myself, first, Timer::FirstToken);
    }

    fn chunk(&mut self, attempt: u64, seq: u64, delta: String) {
        if attempt != self.attempt
            || !matches!(self.phase, Phase::Running { .. } | Phase::Cancelling)
        {
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
            return;
        }
        if seq < self.next_seq {
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "duplicate").increment(1);
            return;
        }
        if seq > self.next_seq {
            tracing::warn!(request_id = %self.args.request_id, expected = self.next_seq, got = seq, "gap in chunk sequence");
        }
        self.next_seq = seq + 1;
        self.chunks += 1;
        let now = self.args.clock.now();
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
            let ttft = now.saturating_duration_since(self.admitted_at);
            metrics::histogram!(TTFT_SECONDS, "model" => self.model()).record(ttft.as_secs_f64());
        }
        self.last_token_at = Some(now);
        self.tell(GenEvent::Delta(delta));
    }

    async fn done(&mut self, myself: &ActorRef<GenerationMsg>, usage: Usage, node: &NodeHandle) {
        let settled = self
            .settle(usage.prompt_tokens, usage.completion_tokens)
            .await;
        if settled {
            node.ack(&self.args.request_id, self.attempt);
        }
        match usage.finish_reason.as_str() {
            // After our own cancel the client was already told; otherwise the node stopped on
            // its own (its agent shut down): a backend failure.
            "abort" => self.fail_client(Failure::new(
                ErrorCode::ModelBackendError,
                "The node stopped the generation.",
            )),
            "error" => self.fail_client(Failure::new(
                ErrorCode::ModelBackendError,
                "The engine failed mid-stream.",
            )),
            _ => {
                if !self.told_client {
                    self.record_rate(usage.completion_tokens);
                    metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => "ok")
                        .increment(1);
                    self.tell(GenEvent::Finished(usage));
                    self.told_client = true;
                }
            }
        }
        myself.stop(None);
    }

    fn record_rate(&self, completion_tokens: u64) {
        if let (Some(first), Some(last)) = (self.first_token_at, self.last_token_at) {
            let secs = last.saturating_duration_since(first).as_secs_f64();
            if completion_tokens > 1 && secs > 0.0 {
                let rate = (completion_tokens - 1) as f64 / secs;
                metrics::histogram!(OUTPUT_TOKENS_PER_SECOND, "model" => self.model()).record(rate);
            }
        }
    }

    async fn engine_error(&mut self, myself: &ActorRef<GenerationMsg>, code: &str, message: &str) {
        let accepted = match &self.phase {
            Phase::Running { accepted, .. } => *accepted,
            _ => return,
        };
        tracing::warn!(request_id = %self.args.request_id, code, "engine error");
        if accepted {
            // The node sends `done` with the usage so far after this error.
            self.fail_client(Failure::new(
                ErrorCode::ModelBackendError,
                "The engine failed mid-stream.",
            ));
            self.phase = Phase::AwaitingDone;
            let wait = self.args.timeouts.settle_wait;
            self.arm(myself, wait, Timer::SettleWait);
            return;
        }
        let retryable = matches!(code, "model_loading" | "draining" | "model_backend_error");
        if retryable && self.chunks == 0 && !self.retried {
            self.retry(myself).await;
            return;
        }
        let failure = match code {
            "invalid_request" => Failure::new(
                ErrorCode::InvalidRequest,
                message.chars().take(500).collect::<String>(),
            ),
            "model_loading" => {
                Failure::new(ErrorCode::ModelLoading, "The model is loading.").retry_after(10)
            }
            _ => Failure::new(
                ErrorCode::ModelBackendError,
                "The engine refused the request.",
            ),
        };
        self.finish_without_work(myself, failure).await;
    }

    /// Retries once on another node, before anything was streamed.
    async fn retry(&mut self, myself: &ActorRef<GenerationMsg>) {
        self.retried = true;
        self.attempt += 1;
        self.next_seq = 0;
        self.chunks = 0;
        self.phase = Phase::Queued;
        tracing::info!(request_id = %self.args.request_id, attempt = self.attempt, "retrying on another node");
        let queue = self.args.queue.clone();
        if let Err(failure) = queue
            .enqueue(&self.args.request_id, myself.clone(), true)
            .await
        {
            self.finish_without_work(myself, failure).await;
        }
    }

    async fn node_lost(&mut self, myself: &ActorRef<GenerationMsg>) {
        match &self.phase {
            Phase::Running { .. } if self.chunks == 0 && !self.retried && !self.client_gone => {
                self.retry(myself).await;
            }
            Phase::Running { .. } | Phase::Cancelling => {
                self.fail_client(Failure::new(
                    ErrorCode::ModelBackendError,
                    "The node serving this request was lost.",
                ));
                // The node may reconnect and resend its `done` with exact usage.
                self.phase = Phase::AwaitingDone;
                let wait = self.args.timeouts.settle_wait;
                self.arm(myself, wait, Timer::SettleWait);
            }
            _ => {}
        }
    }

    async fn client_gone(&mut self, myself: &ActorRef<GenerationMsg>) {
        self.client_gone = true;
        match &self.phase {
            Phase::New | Phase::Queued => {
                self.args.queue.withdraw(&self.args.request_id);
                metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => "client_gone")
                    .increment(1);
                self.told_client = true;
                self.cancel_row().await;
                myself.stop(None);
            }
            Phase::Running { .. } => {
                let grace = self.args.timeouts.cancel_grace;
                self.arm(myself, grace, Timer::CancelGrace);
            }
            Phase::Cancelling | Phase::AwaitingDone => {}
        }
    }

    async fn timer(&mut self, myself: &ActorRef<GenerationMsg>, timer: Timer) {
        match timer {
            Timer::CancelGrace => {
                if matches!(self.phase, Phase::Running { .. }) {
                    self.told_client = true;
                    metrics::counter!(REQUESTS_TOTAL, "model" => self.model(), "code" => "client_gone").increment(1);
                    self.cancel_on_node(myself);
                }
            }
            Timer::FirstToken if self.first_token_at.is_none() => self.time_out(myself).await,
            Timer::FirstToken => {}
            Timer::Total => self.time_out(myself).await,
            Timer::SettleWait => {
                // No `done` came: settle from what was received.
                let prompt = self.args.reservation.estimated_prompt_tokens;
                let chunks = self.chunks;
                tracing::warn!(request_id = %self.args.request_id, "no done from the node; settling from received chunks");
                self.settle(prompt, chunks).await;
                myself.stop(None);
            }
        }
    }

    async fn time_out(&mut self, myself: &ActorRef<GenerationMsg>) {
        let failure = Failure::new(
            ErrorCode::GenerationTimeout,
            "The generation did not finish within its deadline.",
        );
        match self.phase {
            Phase::New | Phase::Queued => {
                self.args.queue.withdraw(&self.args.request_id);
                self.finish_without_work(myself, failure).await;
            }
            Phase::Running { .. } => {
                self.fail_client(failure);
                self.cancel_on_node(myself);
            }
            Phase::Cancelling | Phase::AwaitingDone => {}
        }
    }

    /// Tells the node to stop and waits for its `done` with the usage so far.
    fn cancel_on_node(&mut self, myself: &ActorRef<GenerationMsg>) {
        if let Phase::Running { node, .. } = std::mem::replace(&mut self.phase, Phase::AwaitingDone)
        {
            node.cancel(&self.args.request_id, self.attempt);
            self.phase = Phase::Cancelling;
        }
        let wait = self.args.timeouts.settle_wait;
        self.arm(myself, wait, Timer::SettleWait);
    }

    /// Ends a generation that did no GPU work: the row is cancelled, not billed.
    async fn finish_without_work(&mut self, myself: &ActorRef<GenerationMsg>, failure: Failure) {
        self.fail_client(failure);
        self.cancel_row().await;
        myself.stop(None);
    }

    async fn cancel_row(&mut self) {
        if self.ledger_final {
            return;
        }
        match self.args.ledger.cancel(&self.args.request_id).await {
            Ok(_) => self.ledger_final = true,
            Err(e) => {
                tracing::error!(request_id = %self.args.request_id, error = %e, "could not cancel the ledger row")
            }
        }
    }

    /// Settles the row with exact usage, retrying briefly; true once the row is final.
    async fn settle(&mut self, prompt_tokens: u64, completion_tokens: u64) -> bool {
        if self.ledger_final {
            return true;
        }
        let settlement = Settlement {
            request_id: self.args.request_id.clone(),
            prompt_tokens,
            completion_tokens,
        };
        for backoff_ms in [0u64, 100, 500, 2000] {
            if backoff_ms > 0 {
                tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
            }
            match self.args.ledger.settle(&settlement).await {
                Ok(SettleOutcome::Applied) => {
                    self.ledger_final = true;
                    self.settled_tokens = Some(prompt_tokens.saturating_add(completion_tokens));
                    return true;
                }
                Ok(SettleOutcome::AlreadyFinal) => {
                    self.ledger_final = true;
                    return true;
                }
                Ok(SettleOutcome::Unknown) => {
                    tracing::error!(request_id = %self.args.request_id, "settling a row that does not exist");
                    self.ledger_final = true;
                    return true;
                }
                Err(e) => {
                    tracing::warn!(request_id = %self.args.request_id, error = %e, "settle failed; retrying")
                }
            }
        }
        // Left reserved: the node keeps its `done` unacked and the sweeper settles it later.
        self.ledger_final = true;
        false
    }
}
