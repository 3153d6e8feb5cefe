//! Every way a generation ends, as steps of the pure core: the node's `done`, an engine error,
//! node loss (with the lease that fences a silent attempt), the client leaving or coming
//! back, a cancel, a deadline. Each path settles or cancels the row at most once and moves the
//! record only through transitions its state machine allows; settle retries are timers.

use std::time::Duration;

use super::{Core, Effect, Fx, Metric, NodeRef, Reader, Row, Stop, Where};
use crate::error::{ErrorCode, Failure};
use crate::generation::msg::{GenEvent, Timer, Usage};
use crate::lifecycle::{Event, Outcome, Refusal};
use crate::node::Violation;
use crate::ports::{
    EntryStatus, LedgerEntry, LedgerError, MAX_TOKEN_COUNT, ReviewReason, SettleOutcome,
};

/// Waits before the second, third and fourth settle tries (the first goes at once).
const SETTLE_BACKOFF_MS: [u64; 3] = [100, 500, 2000];

/// A node's `done` as it reported it: a claim, billed only within the request's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Prompt tokens claimed.
    pub prompt_tokens: u64,
    /// Completion tokens claimed.
    pub completion_tokens: u64,
    /// Prompt tokens served from the engine's cache, when it said.
    pub cached_tokens: Option<u64>,
    /// The engine's finish reason.
    pub finish_reason: String,
}

/// What the ledger holds for the row after the settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    /// Final with these (prompt, completion) tokens billed, now or by an earlier settle.
    Billed(u64, u64),
    /// Final without billing (cancelled, or no such row).
    Unbilled,
    /// The ledger could not be reached: the row is still reserved.
    Unreachable,
}

/// A settle in progress.
#[derive(Debug, Clone)]
pub(crate) struct Settling<N> {
    /// Prompt tokens claimed.
    prompt_tokens: u64,
    /// Completion tokens claimed.
    completion_tokens: u64,
    /// Review mark for the row.
    review: Option<ReviewReason>,
    /// Settle tries that failed so far.
    failed: usize,
    /// Whether the settle is done and the row's standing is being read; `Some(answered)`
    /// says whether the ledger answered the settle at all.
    looking_up: Option<bool>,
    /// What the end does with the result.
    then: AfterSettle<N>,
}

/// Who asked for the settle, and so what follows it.
#[derive(Debug, Clone)]
enum AfterSettle<N> {
    /// The node's `done` of the current attempt.
    Done {
        /// Its sender (acked once the row is final).
        from: N,
        /// The engine's finish reason.
        finish_reason: String,
        /// Cached prompt tokens, when it said.
        cached_tokens: Option<u64>,
        /// The counts could not be true.
        unrepresentable: bool,
        /// Why the server was stopping it, if it was.
        stop: Option<Stop>,
    },
    /// No `done` came in time: settled from what was received.
    Wait {
        /// Why the server was stopping it, if it was.
        stop: Option<Stop>,
    },
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
            AfterSettle::Done {
                from,
                finish_reason: claim.finish_reason,
                cached_tokens: claim.cached_tokens,
                unrepresentable,
                stop,
            },
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

    /// Settles the row with a claim, then carries on with `then`. A row this generation no
    /// longer holds is only read.
    fn settle(
        &mut self,
        prompt_tokens: u64,
        completion_tokens: u64,
        review: Option<ReviewReason>,
        then: AfterSettle<N>,
        fx: &mut Fx<N>,
    ) {
        let held = self.row == Row::Reserved;
        self.at = Where::Settling(Settling {
            prompt_tokens,
            completion_tokens,
            review,
            failed: 0,
            looking_up: (!held).then_some(false),
            then,
        });
        // Final or not, this generation does not touch the row again after this settle: a
        // row left reserved waits for the node's resent done, or the sweeper.
        self.row = Row::Done;
        fx.push(if held {
            Effect::Settle {
                prompt_tokens,
                completion_tokens,
                review,
            }
        } else {
            Effect::LookUpRow
        });
    }

    fn settle_again(&self, fx: &mut Fx<N>) {
        if let Where::Settling(s) = &self.at
            && s.looking_up.is_none()
        {
            fx.push(Effect::Settle {
                prompt_tokens: s.prompt_tokens,
                completion_tokens: s.completion_tokens,
                review: s.review,
            });
        }
    }

    pub(super) fn settled(&mut self, result: Result<SettleOutcome, LedgerError>, fx: &mut Fx<N>) {
        let Where::Settling(s) = &mut self.at else {
            return;
        };
        if s.looking_up.is_some() {
            return;
        }
        match result {
            Ok(SettleOutcome::Applied) => {
                let billed = self.cfg.bounds.bill(s.prompt_tokens, s.completion_tokens);
                self.settled_tokens = Some(
                    billed
                        .prompt_tokens
                        .saturating_add(billed.completion_tokens),
                );
                self.after_settle(
                    Settled::Billed(billed.prompt_tokens, billed.completion_tokens),
                    fx,
                );
            }
            // Final already (an earlier settle whose answer was lost, a sweep): what it holds.
            Ok(SettleOutcome::AlreadyFinal) => {
                s.looking_up = Some(true);
                fx.push(Effect::LookUpRow);
            }
            Ok(SettleOutcome::Unknown) => {
                tracing::error!(request_id = %self.cfg.request_id, "settling a row that does not exist");
                self.after_settle(Settled::Unbilled, fx);
            }
            Err(e) => {
                tracing::warn!(request_id = %self.cfg.request_id, error = %e, "settle failed; retrying");
                let wait = SETTLE_BACKOFF_MS.get(s.failed).copied();
                s.failed += 1;
                match wait {
                    Some(ms) => fx.push(Effect::ArmTimer {
                        timer: Timer::SettleRetry,
                        after: Duration::from_millis(ms),
                    }),
                    None => {
                        s.looking_up = Some(false);
                        fx.push(Effect::LookUpRow);
                    }
                }
            }
        }
    }

    pub(super) fn row_looked_up(
        &mut self,
        result: Result<Option<LedgerEntry>, LedgerError>,
        fx: &mut Fx<N>,
    ) {
        let Where::Settling(s) = &self.at else {
            return;
        };
        let Some(answered) = s.looking_up else {
            return;
        };
        let settled = match result {
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
            Ok(_) | Err(_) if !answered => Settled::Unreachable,
            Ok(_) | Err(_) => Settled::Unbilled,
        };
        self.after_settle(settled, fx);
    }

    fn after_settle(&mut self, settled: Settled, fx: &mut Fx<N>) {
        let Where::Settling(s) =
            std::mem::replace(&mut self.at, Where::Ended { before_work: false })
        else {
            return;
        };
        match s.then {
            AfterSettle::Done {
                from,
                finish_reason,
                cached_tokens,
                unrepresentable,
                stop,
            } => self.done_settled(
                settled,
                from,
                finish_reason,
                cached_tokens,
                unrepresentable,
                stop,
                fx,
            ),
            AfterSettle::Wait { stop } => self.wait_settled(settled, stop, fx),
        }
    }

    /// The rest of a `done`: the client and the record are told what the ledger holds.
    #[allow(clippy::too_many_arguments)]
    fn done_settled(
        &mut self,
        settled: Settled,
        from: N,
        finish_reason: String,
        cached_tokens: Option<u64>,
        unrepresentable: bool,
        stop: Option<Stop>,
        fx: &mut Fx<N>,
    ) {
        let attempt = self.attempt.epoch;
        let (usage, failure) = match settled {
            Settled::Billed(prompt_tokens, completion_tokens) => {
                fx.push(Effect::Ack {
                    node: from,
                    attempt,
                });
                let usage = Usage {
                    prompt_tokens,
                    completion_tokens,
                    finish_reason,
                    // A part of what was billed, never more.
                    cached_tokens: cached_tokens.map(|c| c.min(prompt_tokens)),
                };
                (usage, None)
            }
            Settled::Unbilled => {
                fx.push(Effect::Ack {
                    node: from,
                    attempt,
                });
                let failure = Failure::new(
                    ErrorCode::ModelBackendError,
                    "The generation's reservation ended before its usage arrived; nothing was billed.",
                );
                (nothing_billed(finish_reason), Some(failure))
            }
            // Left reserved and unacked: the node sends its done again after a reconnect.
            Settled::Unreachable => {
                let failure = Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The answer is complete, but its usage could not be recorded yet; it is billed once recorded.",
                )
                .retry_after(1);
                (nothing_billed(finish_reason), Some(failure))
            }
        };
        let outcome = match (usage.finish_reason.as_str(), stop) {
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
        self.finish_record(true, outcome.clone(), &usage, fx);
        match outcome {
            Outcome::Cancelled => {
                self.count("cancelled", fx);
                self.tell(GenEvent::Cancelled(usage), fx);
            }
            Outcome::Failed(_) if failure.is_some() => {
                if let Some(failure) = failure {
                    self.fail_client(failure, fx);
                }
            }
            // After our own stop the client was already told; otherwise the node stopped on
            // its own (its agent shut down) or the engine failed: a backend failure.
            Outcome::Failed(_) if unrepresentable => self.fail_client(
                Failure::new(
                    ErrorCode::ModelBackendError,
                    "The node's usage report could not be true; the generation ended and was billed at most what the request allowed.",
                ),
                fx,
            ),
            Outcome::Failed(_) => self.fail_client(
                Failure::new(
                    ErrorCode::ModelBackendError,
                    "The engine stopped the generation.",
                ),
                fx,
            ),
            Outcome::Completed => {
                if !self.told {
                    self.record_rate(usage.completion_tokens, fx);
                    self.count("ok", fx);
                    self.tell(GenEvent::Finished(usage), fx);
                }
            }
        }
        self.end(fx);
    }

    /// The rest of a settle after no `done` came: told and recorded as the ledger holds it.
    fn wait_settled(&mut self, settled: Settled, stop: Option<Stop>, fx: &mut Fx<N>) {
        let finish_reason = "abort".to_owned();
        let usage = match settled {
            Settled::Billed(prompt_tokens, completion_tokens) => Usage {
                prompt_tokens,
                completion_tokens,
                finish_reason,
                cached_tokens: None,
            },
            Settled::Unbilled | Settled::Unreachable => nothing_billed(finish_reason),
        };
        let outcome = match stop {
            Some(Stop::Cancelled) => Outcome::Cancelled,
            Some(Stop::Timeout) => Outcome::Failed("generation_timeout".into()),
            None => Outcome::Failed("model_backend_error".into()),
        };
        self.finish_record(false, outcome.clone(), &usage, fx);
        if outcome == Outcome::Cancelled && !self.told {
            self.tell(GenEvent::Cancelled(usage), fx);
        }
        self.end(fx);
    }

    /// Moves the record to its end. From the node: its `done` of the current attempt; from
    /// the server: only once nothing can be running (refused or fenced).
    fn finish_record(&mut self, from_node: bool, outcome: Outcome, usage: &Usage, fx: &mut Fx<N>) {
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

    fn record_rate(&self, completion_tokens: u64, fx: &mut Fx<N>) {
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
        if retryable && !self.retried && self.reader != Reader::Gone {
            self.retry(fx);
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
        self.finish_without_work(failure, fx);
    }

    /// Retries once on another node; the previous attempt is refused or fenced.
    fn retry(&mut self, fx: &mut Fx<N>) {
        self.retried = true;
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
                self.count("client_gone", fx);
                self.record(Event::RequestCancel, fx);
                self.end_cancelled_without_work(fx);
            }
            // Nobody can come back to a generation without a record (a chat completion
            // without Idempotency-Key): every token from now on would be billed for nothing, so
            // the node stops at once. One with a record may finish within the grace, and its
            // answer is kept for the client's retry.
            Where::Running { .. } if !self.cfg.recorded => self.grace_over(fx),
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
                self.count("client_gone", fx);
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
            self.count("client_gone", fx);
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
            self.count("cancelled", fx);
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
        if admission {
            self.count(failure.code.as_str(), fx);
            self.told = true;
            fx.push(Effect::Reply(Err(failure)));
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

/// Zero usage, as a record shows a generation that billed nothing.
fn nothing_billed(finish_reason: String) -> Usage {
    Usage {
        prompt_tokens: 0,
        completion_tokens: 0,
        finish_reason,
        cached_tokens: None,
    }
}

fn timeout() -> Failure {
    Failure::new(
        ErrorCode::GenerationTimeout,
        "The generation did not finish within its deadline.",
    )
}
