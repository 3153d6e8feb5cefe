//! Every way a generation ends, as steps of the pure core: the node's `done`, an engine error,
//! node loss (with the lease that fences a silent attempt), the client leaving or coming
//! back, a cancel, a deadline. Each path settles or cancels the row at most once and moves the
//! record only through transitions its state machine allows; settle retries are timers.

use super::settle::DoneReport;
use super::{
    AfterSettle, Core, Effect, Fx, MAX_UNDELIVERED, Metric, NodeRef, Reader, Row, Stop, Tally,
    Where,
};
use crate::error::{ErrorCode, Failure};
use crate::generation::msg::{GenEvent, Timer, Usage};
use crate::lifecycle::{Event, Outcome, Refusal};
use crate::node::Violation;
use crate::ports::{MAX_TOKEN_COUNT, ReviewReason};

/// A node's `done` as it reported it: a claim, billed only within the request's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Prompt tokens claimed.
    pub prompt_tokens: u64,
    /// Completion tokens claimed.
    pub completion_tokens: u64,
    /// Prompt tokens served from the engine's cache, when it said.
    pub cached_tokens: Option<u64>,
    /// `chunk`s the attempt sent, when the node said.
    pub chunks: Option<u64>,
    /// The engine's finish reason.
    pub finish_reason: String,
}

impl<N: NodeRef> Core<N> {
    /// The node's final report for `attempt`.
    pub(super) fn done(&mut self, attempt: u64, claim: Claim, from: N, fx: &mut Fx<N>) {
        if attempt == self.attempt.epoch && matches!(self.at, Where::Fencing { .. }) {
            // The lost node came back and confirmed it stopped: the attempt cannot continue,
            // which is what the lease was waiting to establish. Its partial work was never
            // delivered and is not billed.
            fx.push(Effect::Ack {
                node: from,
                attempt,
            });
            fx.push(Effect::Metric(Metric::StaleFrame("fenced_attempt")));
            self.lease_over(fx);
            return;
        }
        if !self.frame_is_current(attempt) {
            // An older (fenced) attempt's report: the node may forget it; it is not billed.
            fx.push(Effect::Metric(Metric::StaleFrame("old_attempt")));
            fx.push(Effect::Ack {
                node: from,
                attempt,
            });
            return;
        }
        let stop = self.stop();
        // A chunk the node sent that never came (the connection that carried it died with
        // its replica, and the `done` came again on a new one), or a gap seen on the way.
        let lost_output = self.attempt.gap
            || claim
                .chunks
                .is_some_and(|sent| sent > self.attempt.next_seq);
        if lost_output {
            tracing::warn!(request_id = %self.cfg.request_id, received = self.attempt.next_seq, sent = ?claim.chunks, "output chunks were lost on the way from the node");
        }
        // Billed within the request's bounds; the ledger applies the same rule to the same
        // claim, so the client is told exactly what the ledger records.
        let billed = self
            .cfg
            .bounds
            .bill(claim.prompt_tokens, claim.completion_tokens);
        let unrepresentable =
            claim.prompt_tokens > MAX_TOKEN_COUNT || claim.completion_tokens > MAX_TOKEN_COUNT;
        let mut review = None;
        if unrepresentable {
            fx.push(Effect::Violation {
                node: from.clone(),
                kind: Violation::UsageOutOfRange,
            });
            review = Some(ReviewReason::UsageUnrepresentable);
        } else if claim.completion_tokens > billed.completion_tokens {
            // Engines stop at max_tokens: more is never true (the prompt bound, by contrast,
            // also catches a tokenizer that differs from the engine's, so it is no violation).
            fx.push(Effect::Violation {
                node: from.clone(),
                kind: Violation::CompletionOverBound,
            });
        }
        if billed.clamped {
            fx.push(Effect::Metric(Metric::UsageClamped));
            tracing::warn!(
                request_id = %self.cfg.request_id,
                node_id = from.node_id(),
                claimed_prompt = claim.prompt_tokens,
                claimed_completion = claim.completion_tokens,
                billed_prompt = billed.prompt_tokens,
                billed_completion = billed.completion_tokens,
                "usage report beyond the request's bounds; clamped and marked for review"
            );
        }
        self.settle(
            claim.prompt_tokens,
            claim.completion_tokens,
            review,
            AfterSettle::Done(DoneReport {
                from,
                finish_reason: claim.finish_reason,
                cached_tokens: claim.cached_tokens,
                unrepresentable,
                lost_output,
                stop,
            }),
            fx,
        );
    }

    /// Why the server is stopping the current attempt, if it is.
    fn stop(&self) -> Option<Stop> {
        match &self.at {
            Where::Fencing { stop } | Where::AwaitingDone { stop } => *stop,
            Where::Cancelling { stop } => Some(*stop),
            _ => None,
        }
    }

    /// Moves the record to its end. From the node: its `done` of the current attempt; from
    /// the server: only once nothing can be running (refused or fenced).
    pub(super) fn finish_record(
        &mut self,
        from_node: bool,
        outcome: Outcome,
        usage: &Usage,
        fx: &mut Fx<N>,
    ) {
        if !self.cfg.recorded {
            return;
        }
        let retained = std::mem::take(&mut self.retained);
        self.record(
            Event::Finish {
                attempt: self.attempt.epoch,
                from_node,
                outcome,
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
                // Kept as streamed, NUL included: every store holds any text.
                output: Some(retained.text),
                output_extra: retained.extra.extra_json(),
                finish_reason: from_node.then(|| usage.finish_reason.clone()),
            },
            fx,
        );
    }

    pub(super) fn record_rate(&self, completion_tokens: u64, fx: &mut Fx<N>) {
        if let (Some(first), Some(last)) = (self.first_token_at, self.last_token_at) {
            let secs = last.saturating_duration_since(first).as_secs_f64();
            if completion_tokens > 1 && secs > 0.0 {
                let rate = (completion_tokens - 1) as f64 / secs;
                fx.push(Effect::Metric(Metric::OutputRate(rate)));
            }
        }
    }

    pub(super) fn engine_error(&mut self, code: &str, message: &str, fx: &mut Fx<N>) {
        if let Where::Cancelling { stop } = self.at
            && !self.attempt.evidence
        {
            // The node refused the attempt while the server was stopping it: it never
            // started, so there is nothing to wait for and no message to spend.
            self.record(
                Event::Refuse {
                    attempt: self.attempt.epoch,
                },
                fx,
            );
            match stop {
                Stop::Timeout => self.finish_without_work(timeout(), fx),
                Stop::OverBound => self.finish_without_work(super::over_bound(), fx),
                Stop::Cancelled => self.end_cancelled_without_work(fx),
            }
            return;
        }
        if !matches!(self.at, Where::Running { .. }) {
            return;
        }
        tracing::warn!(request_id = %self.cfg.request_id, code, "engine error");
        if self.attempt.evidence {
            // The node sends `done` with the usage so far after this error.
            self.fail_client(
                Failure::new(
                    ErrorCode::ModelBackendError,
                    "The engine failed mid-stream.",
                ),
                fx,
            );
            self.at = Where::AwaitingDone { stop: None };
            self.arm(Timer::SettleWait, self.cfg.timeouts.settle_wait, fx);
            return;
        }
        // Refused before starting: proven never started.
        self.record(
            Event::Refuse {
                attempt: self.attempt.epoch,
            },
            fx,
        );
        let retryable = matches!(
            code,
            "model_loading"
                | "draining"
                | "model_backend_error"
                | "engine_unreachable"
                | "model_not_found"
                | "not_sent"
        );
        if self.reader != Reader::Gone {
            // Never reached any node (its connection, or the replica that held it, went
            // away between the queue's choice and the send): no engine refused it, so it
            // does not spend the one retry. A replica dying takes every node whose socket it
            // held, so the next choice may be one of those too.
            if code == "not_sent" && self.undelivered < MAX_UNDELIVERED {
                self.undelivered += 1;
                self.requeue(fx);
                return;
            }
            if retryable && !self.retried {
                self.retry(fx);
                return;
            }
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
        self.finish_without_work(failure, fx);
    }

    /// Retries once on another node; the previous attempt is refused or fenced.
    fn retry(&mut self, fx: &mut Fx<N>) {
        self.retried = true;
        self.requeue(fx);
    }

    /// Back to the front of the queue for another node.
    fn requeue(&mut self, fx: &mut Fx<N>) {
        tracing::info!(request_id = %self.cfg.request_id, attempt = self.attempt.epoch + 1, "retrying on another node");
        // Not back to the node that just failed it, while another one serves the model.
        let avoid = self.holders.get(&self.attempt.epoch).cloned();
        fx.push(Effect::Enqueue {
            front: true,
            avoid: avoid.clone(),
        });
        self.at = Where::Requeueing { avoid };
    }

    pub(super) fn node_lost(&mut self, fx: &mut Fx<N>) {
        match &self.at {
            Where::Running { .. } if self.attempt.chunks == 0 => {
                // Nothing streamed, but the node may have started (its `accepted` may be
                // lost): wait out the attempt's lease before deciding anything, so that a
                // second attempt never runs beside the first.
                self.at = Where::Fencing { stop: None };
                // The node counts its lease from the last thing it heard, which may be a
                // little after the loss was noticed here: wait half a lease more.
                let lease = self.cfg.timeouts.lease;
                self.arm(Timer::Lease(self.attempt.epoch), lease + lease / 2, fx);
            }
            Where::Running { .. } | Where::Cancelling { .. } => {
                let stop = self.stop();
                if stop.is_none() {
                    self.fail_client(
                        Failure::new(
                            ErrorCode::ModelBackendError,
                            "The node serving this request was lost.",
                        ),
                        fx,
                    );
                }
                // The node may reconnect and resend its `done` with exact usage.
                self.at = Where::AwaitingDone { stop };
                self.arm(Timer::SettleWait, self.cfg.timeouts.settle_wait, fx);
            }
            _ => {}
        }
    }

    /// The lost node's lease ran out (or it confirmed the stop): the attempt is fenced.
    fn lease_over(&mut self, fx: &mut Fx<N>) {
        let Where::Fencing { mut stop } = self.at else {
            return;
        };
        self.record(
            Event::LeaseExpired {
                attempt: self.attempt.epoch,
            },
            fx,
        );
        if self.reader == Reader::Gone && stop.is_none() {
            // It left during its grace, before the node was lost: nobody reads the answer.
            self.record(Event::RequestCancel, fx);
            stop = Some(Stop::Cancelled);
        }
        match stop {
            Some(Stop::Cancelled) => self.end_cancelled_without_work(fx),
            Some(Stop::Timeout) => self.end_fenced(timeout(), fx),
            Some(Stop::OverBound) => self.end_fenced(super::over_bound(), fx),
            None if !self.retried => self.retry(fx),
            None => self.end_fenced(
                Failure::new(
                    ErrorCode::ModelBackendError,
                    "The node serving this request was lost.",
                ),
                fx,
            ),
        }
    }

    /// Ends a fenced generation that may have run but produced nothing for its client.
    fn end_fenced(&mut self, failure: Failure, fx: &mut Fx<N>) {
        let usage = self.fallback_usage();
        self.finish_record(
            false,
            Outcome::Failed(failure.code.as_str().into()),
            &usage,
            fx,
        );
        self.fail_client(failure, fx);
        self.cancel_row(fx);
        self.end(fx);
    }

    pub(super) fn client_gone(&mut self, fx: &mut Fx<N>) {
        self.reader = Reader::Gone;
        match &self.at {
            Where::New | Where::Queued { .. } => {
                fx.push(Effect::Withdraw);
                self.count(Tally::ClientGone, fx);
                self.record(Event::RequestCancel, fx);
                self.end_cancelled_without_work(fx);
            }
            // Nobody can come back to a generation that is not resumable (a chat completion
            // without Idempotency-Key, recorded or not): every token from now on would be
            // billed for nothing, so the node stops at once. A resumable one may finish
            // within the grace, and its answer is kept for the client's retry.
            Where::Running { .. } if !self.cfg.resumable => self.grace_over(fx),
            Where::Running { .. } if self.grace.is_none() => {
                self.graces += 1;
                self.grace = Some(self.graces);
                self.arm(
                    Timer::CancelGrace(self.graces),
                    self.cfg.timeouts.cancel_grace,
                    fx,
                );
            }
            // Nothing reads the answer any more: the fence ends it as cancelled.
            Where::Fencing { stop: None } => {
                self.count(Tally::ClientGone, fx);
                self.record(Event::RequestCancel, fx);
                self.at = Where::Fencing {
                    stop: Some(Stop::Cancelled),
                };
            }
            _ => {}
        }
    }

    /// A reader re-attached: within the grace the generation goes on as if it never left;
    /// once the cancel went out nothing changes.
    pub(super) fn client_back(&mut self) {
        if matches!(self.at, Where::Running { .. }) {
            self.grace = None;
            self.reader = Reader::Reading;
        }
    }

    /// The client's grace after leaving is over: the node is told to stop. The terminal event
    /// still goes to the sender, for a stream resumed later.
    fn grace_over(&mut self, fx: &mut Fx<N>) {
        if matches!(self.at, Where::Running { .. }) {
            self.grace = None;
            self.count(Tally::ClientGone, fx);
            self.record(Event::RequestCancel, fx);
            self.cancel_on_node(Stop::Cancelled, fx);
        }
    }

    /// The owner cancelled (the record already says so).
    pub(super) fn cancel(&mut self, fx: &mut Fx<N>) {
        match &self.at {
            Where::New | Where::Queued { .. } => {
                fx.push(Effect::Withdraw);
                self.end_cancelled_without_work(fx);
            }
            Where::Running { .. } => self.cancel_on_node(Stop::Cancelled, fx),
            // The lease or the node's `done` decides; the stop is remembered.
            Where::Fencing { .. } => {
                self.at = Where::Fencing {
                    stop: Some(Stop::Cancelled),
                }
            }
            // A node that broke its bound stays the reason it ended.
            Where::Cancelling {
                stop: Stop::OverBound,
            }
            | Where::AwaitingDone {
                stop: Some(Stop::OverBound),
            } => {}
            Where::Cancelling { .. } => {
                self.at = Where::Cancelling {
                    stop: Stop::Cancelled,
                }
            }
            Where::AwaitingDone { .. } => {
                self.at = Where::AwaitingDone {
                    stop: Some(Stop::Cancelled),
                }
            }
            _ => {}
        }
    }

    /// Cancelled while nothing runs (queued, refused or fenced): the row is released.
    pub(super) fn end_cancelled_without_work(&mut self, fx: &mut Fx<N>) {
        let usage = self.fallback_usage();
        self.finish_record(false, Outcome::Cancelled, &usage, fx);
        if !self.told {
            self.count(Tally::Cancelled, fx);
            self.tell(GenEvent::Cancelled(usage), fx);
        }
        self.cancel_row(fx);
        self.end(fx);
    }

    /// Usage when no `done` came: the gateway's prompt count once anything streamed, and a
    /// token per chunk received, within the request's bounds.
    fn fallback_usage(&self) -> Usage {
        let prompt = if self.attempt.chunks > 0 {
            self.cfg.estimated_prompt_tokens
        } else {
            0
        };
        let billed = self.cfg.bounds.bill(prompt, self.attempt.chunks);
        Usage {
            prompt_tokens: billed.prompt_tokens,
            completion_tokens: billed.completion_tokens,
            finish_reason: "abort".into(),
            cached_tokens: None,
        }
    }

    pub(super) fn timer(&mut self, timer: Timer, fx: &mut Fx<N>) {
        match timer {
            Timer::CancelGrace(serial) => {
                if self.grace == Some(serial) {
                    self.grace_over(fx);
                }
            }
            Timer::FirstToken if self.first_token_at.is_none() => self.time_out(fx),
            Timer::FirstToken => {}
            Timer::Total => self.time_out(fx),
            Timer::Lease(attempt) if attempt == self.attempt.epoch => self.lease_over(fx),
            Timer::Lease(_) => {}
            Timer::SettleWait => self.settle_wait_over(fx),
            Timer::SettleRetry => self.settle_again(fx),
        }
    }

    /// No `done` came: the attempt is fenced; settle from what was received.
    fn settle_wait_over(&mut self, fx: &mut Fx<N>) {
        if !matches!(
            self.at,
            Where::Cancelling { .. } | Where::AwaitingDone { .. }
        ) {
            return;
        }
        let stop = self.stop();
        let estimate = self.fallback_usage();
        tracing::warn!(request_id = %self.cfg.request_id, "no done from the node; settling from received chunks");
        self.record(
            Event::LeaseExpired {
                attempt: self.attempt.epoch,
            },
            fx,
        );
        self.settle(
            estimate.prompt_tokens,
            estimate.completion_tokens,
            None,
            AfterSettle::Wait { stop },
            fx,
        );
    }

    fn time_out(&mut self, fx: &mut Fx<N>) {
        // Rare and worth a line: where it was, so a deadline run out is never a mystery.
        tracing::warn!(
            request_id = %self.cfg.request_id,
            at = ?self.at,
            attempt = self.attempt.epoch,
            holders = ?self.holders,
            dispatched = self.dispatched_at.is_some(),
            first_token = self.first_token_at.is_some(),
            "the request's deadline passed"
        );
        match &self.at {
            Where::New | Where::Queued { .. } => {
                fx.push(Effect::Withdraw);
                self.finish_without_work(timeout(), fx);
            }
            Where::Running { .. } => {
                self.fail_client(timeout(), fx);
                self.cancel_on_node(Stop::Timeout, fx);
            }
            Where::Fencing { stop: None } => {
                self.at = Where::Fencing {
                    stop: Some(Stop::Timeout),
                };
            }
            _ => {}
        }
    }

    /// Ends a generation that did no GPU work: the record is rejected (its message released;
    /// the same key may try again), the client told, the row cancelled.
    pub(super) fn finish_without_work(&mut self, failure: Failure, fx: &mut Fx<N>) {
        self.reject(failure, false, fx);
    }

    /// Records a failure before anything ran (answer awaited in [`Self::rejected`]). An
    /// `admission` refusal is answered to the admitting caller instead of told.
    pub(super) fn reject(&mut self, failure: Failure, admission: bool, fx: &mut Fx<N>) {
        fx.push(Effect::Record {
            event: Event::Reject {
                code: failure.code.as_str().to_owned(),
            },
            answer: true,
        });
        self.at = Where::Rejecting { failure, admission };
    }

    /// When an attempt may have run (it was fenced, or accepted and then lost) the record
    /// refuses the `Reject`: the message is spent and the record fails instead, never offered
    /// to the same key again.
    pub(super) fn rejected(
        &mut self,
        failure: Failure,
        admission: bool,
        result: Option<Result<(), Refusal>>,
        fx: &mut Fx<N>,
    ) {
        if let Some(Err(Refusal::NotAllowed(_))) = result {
            let usage = self.fallback_usage();
            self.finish_record(
                false,
                Outcome::Failed(failure.code.as_str().into()),
                &usage,
                fx,
            );
        }
        // An admission still waiting for its row is answered with the failure instead: its
        // client has no stream to be told on yet.
        let admission = admission || self.reply_waits.is_some();
        if admission {
            self.count(Tally::Failed(failure.code), fx);
            self.told = true;
            if self.row == Row::Reserving {
                self.reply_waits = Some(Err(failure));
            } else {
                fx.push(Effect::Reply(Err(failure)));
            }
        } else {
            self.fail_client(failure, fx);
            self.cancel_row(fx);
        }
        self.end(fx);
    }

    pub(super) fn cancel_row(&mut self, fx: &mut Fx<N>) {
        if self.row == Row::Reserved {
            fx.push(Effect::CancelRow);
        }
    }

    pub(super) fn row_cancelled(&mut self, ok: bool) {
        if ok {
            self.row = Row::Done;
        } else {
            tracing::error!(request_id = %self.cfg.request_id, "could not cancel the ledger row");
        }
    }
}

fn timeout() -> Failure {
    Failure::new(
        ErrorCode::GenerationTimeout,
        "The generation did not finish within its deadline.",
    )
}
