//! Every way a generation ends: the node's `done`, an engine error, node loss (with the
//! lease that fences a silent attempt), the client leaving, a cancel, a deadline. Each path
//! settles or cancels the ledger row exactly once and moves the record (when there is one)
//! only through transitions its state machine allows.

use std::time::Duration;

use ractor::ActorRef;

use super::actor::{GenerationState, Phase, Stop};
use super::msg::{GenEvent, GenerationMsg, Timer, Usage};
use crate::error::{ErrorCode, Failure};
use crate::lifecycle::Refusal;
use crate::lifecycle::{Event, Outcome};
use crate::metric_names::{OUTPUT_TOKENS_PER_SECOND, STALE_FRAMES_TOTAL, USAGE_CLAMPED_TOTAL};
use crate::node::{NodeHandle, Violation};
use crate::ports::{
    EntryStatus, LedgerEntry, MAX_TOKEN_COUNT, ReviewReason, SettleOutcome, Settlement,
};

/// What the ledger holds for a generation's row after its settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settled {
    /// Final with these (prompt, completion) tokens billed, now or by an earlier settle.
    Billed(u64, u64),
    /// Final without billing (cancelled, or no such row).
    Unbilled,
    /// The ledger could not be reached: the row is still reserved.
    Unreachable,
}

/// A node's `done` as it reported it: a claim, billed only within the request's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Claim {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub finish_reason: String,
}

impl GenerationState {
    /// The node's final report for `attempt`.
    pub(super) async fn done(
        &mut self,
        myself: &ActorRef<GenerationMsg>,
        attempt: u64,
        claim: Claim,
        node: &NodeHandle,
    ) {
        if attempt == self.attempt && matches!(self.phase, Phase::Fencing) {
            // The lost node came back and confirmed it stopped: the attempt cannot continue,
            // which is what the lease was waiting to establish. Its partial work was never
            // delivered and is not billed.
            node.ack(&self.args.request_id, attempt);
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "fenced_attempt").increment(1);
            self.lease_over(myself).await;
            return;
        }
        if !self.frame_is_current(attempt) {
            // An older (fenced) attempt's report: the node may forget it; it is not billed.
            metrics::counter!(STALE_FRAMES_TOTAL, "reason" => "old_attempt").increment(1);
            node.ack(&self.args.request_id, attempt);
            return;
        }
        // Billed within the request's bounds; the ledger applies the same rule to the same
        // claim, so the client is told exactly what the ledger records.
        let billed = self
            .args
            .reservation
            .bounds
            .bill(claim.prompt_tokens, claim.completion_tokens);
        let unrepresentable =
            claim.prompt_tokens > MAX_TOKEN_COUNT || claim.completion_tokens > MAX_TOKEN_COUNT;
        let mut review = None;
        if unrepresentable {
            node.violation(Violation::UsageOutOfRange, Some(&self.args.request_id));
            review = Some(ReviewReason::UsageUnrepresentable);
        } else if claim.completion_tokens > billed.completion_tokens {
            // Engines stop at max_tokens: more is never true (the prompt bound, by contrast,
            // also catches a tokenizer that differs from the engine's, so it is no violation).
            node.violation(Violation::CompletionOverBound, Some(&self.args.request_id));
        }
        if billed.clamped {
            metrics::counter!(USAGE_CLAMPED_TOTAL, "model" => self.model()).increment(1);
            tracing::warn!(
                request_id = %self.args.request_id,
                node_id = node.node_id(),
                claimed_prompt = claim.prompt_tokens,
                claimed_completion = claim.completion_tokens,
                billed_prompt = billed.prompt_tokens,
                billed_completion = billed.completion_tokens,
                "usage report beyond the request's bounds; clamped and marked for review"
            );
        }
        // What the client and the record are told is what the ledger holds after the settle.
        let (usage, failure) = match self
            .settle(claim.prompt_tokens, claim.completion_tokens, review)
            .await
        {
            Settled::Billed(prompt_tokens, completion_tokens) => {
                node.ack(&self.args.request_id, self.attempt);
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens,
                    finish_reason: claim.finish_reason,
                    // A part of what was billed, never more.
                    cached_tokens: claim.cached_tokens.map(|c| c.min(prompt_tokens)),
                };
                (usage, None)
            }
            Settled::Unbilled => {
                node.ack(&self.args.request_id, self.attempt);
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation's reservation ended before its usage arrived; nothing was billed.",
                );
                (self.nothing_billed(claim.finish_reason), Some(failure))
            }
            // Left reserved and unacked: the node sends its done again after a reconnect.
            Settled::Unreachable => {
                let failure = Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The answer is complete, but its usage could not be recorded yet; it is billed once recorded.",
                )
                .retry_after(1);
                (self.nothing_billed(claim.finish_reason), Some(failure))
            }
        };
        let outcome = match (usage.finish_reason.as_str(), self.stop) {
            _ if failure.is_some() => Outcome::Failed(
                failure
                    .as_ref()
                    .map_or("model_backend_error", |f| f.code.as_str())
                    .into(),
            ),
            _ if unrepresentable => Outcome::Failed("model_backend_error".into()),
            ("abort", Some(Stop::Cancelled)) => Outcome::Cancelled,
            ("abort", Some(Stop::Timeout)) => Outcome::Failed("generation_timeout".into()),
            ("abort" | "error", _) => Outcome::Failed("model_backend_error".into()),
            _ => Outcome::Completed,
        };
        self.finish_record(true, outcome.clone(), &usage).await;
        match outcome {
            Outcome::Cancelled => {
                self.count("cancelled");
                self.tell(GenEvent::Cancelled(usage));
            }
            Outcome::Failed(_) if failure.is_some() => {
                if let Some(failure) = failure {
                    self.fail_client(failure);
                }
            }
            // After our own stop the client was already told; otherwise the node stopped on
            // its own (its agent shut down) or the engine failed: a backend failure.
            Outcome::Failed(_) if unrepresentable => self.fail_client(Failure::new(
                ErrorCode::ModelBackendError,
                "The node's usage report could not be true; the generation ended and was billed at most what the request allowed.",
            )),
            Outcome::Failed(_) => self.fail_client(Failure::new(
                ErrorCode::ModelBackendError,
                "The engine stopped the generation.",
            )),
            Outcome::Completed => {
                if !self.told_client {
                    self.record_rate(usage.completion_tokens);
                    self.count("ok");
                    self.tell(GenEvent::Finished(usage));
                }
            }
        }
        myself.stop(None);
    }

    /// Zero usage, as a record shows a generation that billed nothing.
    fn nothing_billed(&self, finish_reason: String) -> Usage {
        Usage {
            prompt_tokens: 0,
            completion_tokens: 0,
            finish_reason,
            cached_tokens: None,
        }
    }

    /// Moves the record to its end. From the node: its `done` of the current attempt; from
    /// the server: only once nothing can be running (refused or fenced).
    async fn finish_record(&mut self, from_node: bool, outcome: Outcome, usage: &Usage) {
        if self.args.lifecycle.is_none() {
            return;
        }
        // Kept as streamed, NUL included: every store holds any text.
        let output = Some(std::mem::take(&mut self.output));
        let output_extra = std::mem::take(&mut self.output_extra).extra_json();
        let attempt = self.attempt;
        self.record(Event::Finish {
            attempt,
            from_node,
            outcome,
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            output,
            output_extra,
            finish_reason: from_node.then(|| usage.finish_reason.clone()),
        })
        .await;
    }

    pub(super) fn record_rate(&self, completion_tokens: u64) {
        if let (Some(first), Some(last)) = (self.first_token_at, self.last_token_at) {
            let secs = last.saturating_duration_since(first).as_secs_f64();
            if completion_tokens > 1 && secs > 0.0 {
                let rate = (completion_tokens - 1) as f64 / secs;
                metrics::histogram!(OUTPUT_TOKENS_PER_SECOND, "model" => self.model()).record(rate);
            }
        }
    }

    pub(super) async fn engine_error(
        &mut self,
        myself: &ActorRef<GenerationMsg>,
        code: &str,
        message: &str,
    ) {
        if matches!(self.phase, Phase::Cancelling) && !self.evidence {
            // The node refused the attempt while the server was stopping it: it never
            // started, so there is nothing to wait for and no message to spend.
            let attempt = self.attempt;
            self.record(Event::Refuse { attempt }).await;
            match self.stop {
                Some(Stop::Timeout) => {
                    let failure = Failure::new(
                        ErrorCode::GenerationTimeout,
                        "The generation did not finish within its deadline.",
                    );
                    self.finish_without_work(myself, failure).await;
                }
                _ => self.end_cancelled_without_work(myself).await,
            }
            return;
        }
        if !matches!(self.phase, Phase::Running { .. }) {
            return;
        }
        tracing::warn!(request_id = %self.args.request_id, code, "engine error");
        if self.evidence {
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
        // Refused before starting: proven never started.
        let attempt = self.attempt;
        self.record(Event::Refuse { attempt }).await;
        let retryable = matches!(
            code,
            "model_loading"
                | "draining"
                | "model_backend_error"
                | "engine_unreachable"
                | "model_not_found"
                | "not_sent"
        );
        if retryable && !self.retried && self.stop.is_none() && !self.client_gone {
            self.retry(myself).await;
            return;
        }
        if self.stop == Some(Stop::Cancelled) {
            self.end_cancelled_without_work(myself).await;
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

    /// Retries once on another node; the previous attempt is refused or fenced.
    async fn retry(&mut self, myself: &ActorRef<GenerationMsg>) {
        self.retried = true;
        self.phase = Phase::Queued;
        tracing::info!(request_id = %self.args.request_id, attempt = self.attempt + 1, "retrying on another node");
        let queue = self.args.queue.clone();
        // Not back to the node that just failed it, while another one serves the model.
        let failed = self.holders.get(&self.attempt).cloned();
        if let Err(failure) = queue
            .enqueue(
                &self.args.request_id,
                myself.clone(),
                true,
                failed,
                self.args.api,
            )
            .await
        {
            self.finish_without_work(myself, failure).await;
        }
    }

    pub(super) async fn node_lost(&mut self, myself: &ActorRef<GenerationMsg>) {
        match &self.phase {
            Phase::Running { .. } if self.chunks == 0 => {
                // Nothing streamed, but the node may have started (its `accepted` may be
                // lost): wait out the attempt's lease before deciding anything, so that a
                // second attempt never runs beside the first.
                self.phase = Phase::Fencing;
                // The node counts its lease from the last thing it heard, which may be a
                // little after the loss was noticed here: wait half a lease more.
                let lease = self.args.timeouts.lease;
                let attempt = self.attempt;
                self.arm(myself, lease + lease / 2, Timer::Lease(attempt));
            }
            Phase::Running { .. } | Phase::Cancelling => {
                if self.stop.is_none() {
                    self.fail_client(Failure::new(
                        ErrorCode::ModelBackendError,
                        "The node serving this request was lost.",
                    ));
                }
                // The node may reconnect and resend its `done` with exact usage.
                self.phase = Phase::AwaitingDone;
                let wait = self.args.timeouts.settle_wait;
                self.arm(myself, wait, Timer::SettleWait);
            }
            _ => {}
        }
    }

    /// The lost node's lease ran out (or it confirmed the stop): the attempt is fenced.
    async fn lease_over(&mut self, myself: &ActorRef<GenerationMsg>) {
        if !matches!(self.phase, Phase::Fencing) {
            return;
        }
        let attempt = self.attempt;
        self.record(Event::LeaseExpired { attempt }).await;
        if self.client_gone && self.stop.is_none() {
            // It left during its grace, before the node was lost: nobody reads the answer.
            self.record(Event::RequestCancel).await;
            self.stop = Some(Stop::Cancelled);
        }
        if self.stop == Some(Stop::Cancelled) {
            self.end_cancelled_without_work(myself).await;
        } else if self.stop == Some(Stop::Timeout) {
            let failure = Failure::new(
                ErrorCode::GenerationTimeout,
                "The generation did not finish within its deadline.",
            );
            self.end_fenced(myself, failure).await;
        } else if !self.retried {
            self.retry(myself).await;
        } else {
            let failure = Failure::new(
                ErrorCode::ModelBackendError,
                "The node serving this request was lost.",
            );
            self.end_fenced(myself, failure).await;
        }
    }

    /// Ends a fenced generation that may have run but produced nothing for its client.
    async fn end_fenced(&mut self, myself: &ActorRef<GenerationMsg>, failure: Failure) {
        let usage = self.fallback_usage();
        self.finish_record(false, Outcome::Failed(failure.code.as_str().into()), &usage)
            .await;
        self.fail_client(failure);
        self.cancel_row().await;
        myself.stop(None);
    }

    pub(super) async fn client_gone(&mut self, myself: &ActorRef<GenerationMsg>) {
        self.client_gone = true;
        match &self.phase {
            Phase::New | Phase::Queued => {
                self.args.queue.withdraw(&self.args.request_id);
                self.count("client_gone");
                self.record(Event::RequestCancel).await;
                self.stop = Some(Stop::Cancelled);
                self.end_cancelled_without_work(myself).await;
            }
            // Nobody can come back to a generation without a record (a chat completion
            // without Idempotency-Key): every token from now on would be billed for nothing, so
            // the node stops at once. One with a record may finish within the grace, and its
            // answer is kept for the client's retry.
            Phase::Running { .. } if self.args.lifecycle.is_none() => {
                self.timer(myself, Timer::CancelGrace).await;
            }
            Phase::Running { .. } => {
                let grace = self.args.timeouts.cancel_grace;
                self.arm(myself, grace, Timer::CancelGrace);
            }
            // Nothing reads the answer any more: the fence ends it as cancelled.
            Phase::Fencing if self.stop.is_none() => {
                self.count("client_gone");
                self.record(Event::RequestCancel).await;
                self.stop = Some(Stop::Cancelled);
            }
            Phase::Fencing | Phase::Cancelling | Phase::AwaitingDone => {}
        }
    }

    /// The owner cancelled (the record already says so).
    pub(super) async fn cancel(&mut self, myself: &ActorRef<GenerationMsg>) {
        if self.stop == Some(Stop::Cancelled) {
            return;
        }
        self.stop = Some(Stop::Cancelled);
        match &self.phase {
            Phase::New | Phase::Queued => {
                self.args.queue.withdraw(&self.args.request_id);
                self.end_cancelled_without_work(myself).await;
            }
            Phase::Running { .. } => self.cancel_on_node(myself),
            // The lease decides; the stop is remembered.
            Phase::Fencing | Phase::Cancelling | Phase::AwaitingDone => {}
        }
    }

    /// Cancelled while nothing runs (queued, refused or fenced): the row is released.
    pub(super) async fn end_cancelled_without_work(&mut self, myself: &ActorRef<GenerationMsg>) {
        let usage = self.fallback_usage();
        self.finish_record(false, Outcome::Cancelled, &usage).await;
        if !self.told_client {
            self.count("cancelled");
            self.tell(GenEvent::Cancelled(usage));
        }
        self.cancel_row().await;
        myself.stop(None);
    }

    /// Usage when no `done` came: the gateway's prompt count once anything streamed, and a
    /// token per chunk received, within the request's bounds.
    fn fallback_usage(&self) -> Usage {
        let prompt = if self.chunks > 0 {
            self.args.reservation.estimated_prompt_tokens
        } else {
            0
        };
        let billed = self.args.reservation.bounds.bill(prompt, self.chunks);
        Usage {
            prompt_tokens: billed.prompt_tokens,
            completion_tokens: billed.completion_tokens,
            finish_reason: "abort".into(),
            cached_tokens: None,
        }
    }

    pub(super) async fn timer(&mut self, myself: &ActorRef<GenerationMsg>, timer: Timer) {
        match timer {
            Timer::CancelGrace => {
                if matches!(self.phase, Phase::Running { .. }) {
                    self.told_client = true;
                    self.count("client_gone");
                    self.record(Event::RequestCancel).await;
                    self.stop = Some(Stop::Cancelled);
                    self.cancel_on_node(myself);
                }
            }
            Timer::FirstToken if self.first_token_at.is_none() => self.time_out(myself).await,
            Timer::FirstToken => {}
            Timer::Total => self.time_out(myself).await,
            Timer::Lease(attempt) if attempt == self.attempt => self.lease_over(myself).await,
            Timer::Lease(_) => {}
            Timer::SettleWait => {
                // No `done` came: the attempt is fenced; settle from what was received.
                let estimate = self.fallback_usage();
                tracing::warn!(request_id = %self.args.request_id, "no done from the node; settling from received chunks");
                let attempt = self.attempt;
                self.record(Event::LeaseExpired { attempt }).await;
                let settled = self
                    .settle(estimate.prompt_tokens, estimate.completion_tokens, None)
                    .await;
                // Told and recorded as the ledger holds it.
                let usage = match settled {
                    Settled::Billed(prompt_tokens, completion_tokens) => Usage {
                        prompt_tokens,
                        completion_tokens,
                        finish_reason: estimate.finish_reason,
                        cached_tokens: None,
                    },
                    Settled::Unbilled | Settled::Unreachable => {
                        self.nothing_billed(estimate.finish_reason)
                    }
                };
                let outcome = match self.stop {
                    Some(Stop::Cancelled) => Outcome::Cancelled,
                    Some(Stop::Timeout) => Outcome::Failed("generation_timeout".into()),
                    None => Outcome::Failed("model_backend_error".into()),
                };
                self.finish_record(false, outcome.clone(), &usage).await;
                if outcome == Outcome::Cancelled && !self.told_client {
                    self.tell(GenEvent::Cancelled(usage));
                }
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
                self.stop.get_or_insert(Stop::Timeout);
                self.cancel_on_node(myself);
            }
            Phase::Fencing => {
                self.stop.get_or_insert(Stop::Timeout);
            }
            Phase::Cancelling | Phase::AwaitingDone => {}
        }
    }

    /// Tells the node to stop and waits for its `done` with the usage so far.
    pub(super) fn cancel_on_node(&mut self, myself: &ActorRef<GenerationMsg>) {
        if let Phase::Running { node } = std::mem::replace(&mut self.phase, Phase::AwaitingDone) {
            node.cancel(&self.args.request_id, self.attempt);
            self.phase = Phase::Cancelling;
        }
        let wait = self.args.timeouts.settle_wait;
        self.arm(myself, wait, Timer::SettleWait);
    }

    /// Ends a generation that did no GPU work: the row is cancelled, not billed, and the
    /// record rejected (its message released; the same key may try again).
    pub(super) async fn finish_without_work(
        &mut self,
        myself: &ActorRef<GenerationMsg>,
        failure: Failure,
    ) {
        self.reject_record(&failure).await;
        self.fail_client(failure);
        self.cancel_row().await;
        myself.stop(None);
    }

    /// Records a failure before anything ran. When an attempt may have run (it was fenced, or
    /// accepted and then lost) the message is spent and the record fails instead: it is never
    /// offered to the same key again.
    pub(super) async fn reject_record(&mut self, failure: &Failure) {
        let code = failure.code.as_str().to_owned();
        let reject = Event::Reject { code: code.clone() };
        if let Some(Err(Refusal::NotAllowed(_))) = self.record(reject).await {
            let usage = self.fallback_usage();
            self.finish_record(false, Outcome::Failed(code), &usage)
                .await;
        }
    }

    pub(super) async fn cancel_row(&mut self) {
        if self.ledger_final {
            return;
        }
        match self
            .args
            .ledger
            .cancel(&self.args.reservation.request_id)
            .await
        {
            Ok(_) => self.ledger_final = true,
            Err(e) => {
                tracing::error!(request_id = %self.args.request_id, error = %e, "could not cancel the ledger row")
            }
        }
    }

    /// Settles the row with the node's claim (the ledger bills it within the row's bounds),
    /// retrying briefly, and says what the ledger holds afterwards.
    pub(super) async fn settle(
        &mut self,
        prompt_tokens: u64,
        completion_tokens: u64,
        review: Option<ReviewReason>,
    ) -> Settled {
        let id = self.args.reservation.request_id.clone();
        let settlement = Settlement {
            request_id: id.clone(),
            prompt_tokens,
            completion_tokens,
            review,
        };
        let mut outcome = None;
        if !self.ledger_final {
            for backoff_ms in [0u64, 100, 500, 2000] {
                if backoff_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
                }
                match self.args.ledger.settle(&settlement).await {
                    Ok(o) => {
                        outcome = Some(o);
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(request_id = %self.args.request_id, error = %e, "settle failed; retrying")
                    }
                }
            }
        }
        // Final or not, this generation does not touch the row again: a row left reserved
        // waits for the node's resent done, or the sweeper.
        self.ledger_final = true;
        match outcome {
            Some(SettleOutcome::Applied) => {
                let billed = self
                    .args
                    .reservation
                    .bounds
                    .bill(prompt_tokens, completion_tokens);
                self.settled_tokens = Some(
                    billed
                        .prompt_tokens
                        .saturating_add(billed.completion_tokens),
                );
                Settled::Billed(billed.prompt_tokens, billed.completion_tokens)
            }
            // Final already (an earlier settle whose answer was lost, a sweep): what it holds.
            Some(SettleOutcome::AlreadyFinal) | None => match self.args.ledger.entry(&id).await {
                Ok(Some(LedgerEntry {
                    status:
                        EntryStatus::Settled {
                            prompt_tokens,
                            completion_tokens,
                        },
                    ..
                })) => Settled::Billed(prompt_tokens, completion_tokens),
                Ok(Some(LedgerEntry {
                    status: EntryStatus::Cancelled,
                    ..
                })) => Settled::Unbilled,
                Ok(_) | Err(_) if outcome.is_none() => Settled::Unreachable,
                Ok(_) | Err(_) => Settled::Unbilled,
            },
            Some(SettleOutcome::Unknown) => {
                tracing::error!(request_id = %self.args.request_id, "settling a row that does not exist");
                Settled::Unbilled
            }
        }
    }
}
