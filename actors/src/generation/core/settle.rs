//! The settle of a generation's row, as steps of the pure core: the claim goes to the ledger,
//! a failed try is retried on a timer (100/500/2000 ms, never a sleep), and what the ledger
//! holds afterwards is what the client and the record are told.

use std::time::Duration;

use super::{Core, Effect, Fx, NodeRef, Row, Stop, Tally, Where};
use crate::error::{ErrorCode, Failure};
use crate::generation::msg::{GenEvent, Timer, Usage};
use crate::lifecycle::Outcome;
use crate::ports::{EntryStatus, LedgerEntry, LedgerError, ReviewReason, SettleOutcome};

/// Waits before the second, third and fourth settle tries (the first goes at once).
const SETTLE_BACKOFF_MS: [u64; 3] = [100, 500, 2000];

/// What the ledger holds for the row after the settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settled {
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
    /// The node that held the settled attempt.
    node_id: Option<String>,
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
pub(super) enum AfterSettle<N> {
    /// The node's `done` of the current attempt.
    Done(DoneReport<N>),
    /// No `done` came in time: settled from what was received.
    Wait {
        /// Why the server was stopping it, if it was.
        stop: Option<Stop>,
    },
}

/// What a `done` of the current attempt said, besides its counts.
#[derive(Debug, Clone)]
pub(super) struct DoneReport<N> {
    /// Its sender (acked once the row is final).
    pub from: N,
    /// The engine's finish reason.
    pub finish_reason: String,
    /// Cached prompt tokens, when it said.
    pub cached_tokens: Option<u64>,
    /// The counts could not be true.
    pub unrepresentable: bool,
    /// Chunks of the attempt never reached this generation: the client's output has holes.
    pub lost_output: bool,
    /// Why the server was stopping it, if it was.
    pub stop: Option<Stop>,
}

impl<N: NodeRef> Core<N> {
    /// Settles the row with a claim, then carries on with `then`. A row this generation no
    /// longer holds is only read.
    pub(super) fn settle(
        &mut self,
        prompt_tokens: u64,
        completion_tokens: u64,
        review: Option<ReviewReason>,
        then: AfterSettle<N>,
        fx: &mut Fx<N>,
    ) {
        let held = self.row == Row::Reserved;
        // The settle is always of the current attempt: its holder did (or claims) the work.
        let node_id = self.holders.get(&self.attempt.epoch).cloned();
        self.at = Where::Settling(Settling {
            prompt_tokens,
            completion_tokens,
            review,
            node_id: node_id.clone(),
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
                node_id,
            }
        } else {
            Effect::LookUpRow
        });
    }

    pub(super) fn settle_again(&self, fx: &mut Fx<N>) {
        if let Where::Settling(s) = &self.at
            && s.looking_up.is_none()
        {
            fx.push(Effect::Settle {
                prompt_tokens: s.prompt_tokens,
                completion_tokens: s.completion_tokens,
                review: s.review,
                node_id: s.node_id.clone(),
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
                fx.push(Effect::Metric(super::Metric::SettledTokens {
                    prompt: billed.prompt_tokens,
                    completion: billed.completion_tokens,
                }));
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
            AfterSettle::Done(report) => self.done_settled(settled, report, fx),
            AfterSettle::Wait { stop } => self.wait_settled(settled, stop, fx),
        }
    }

    /// The rest of a `done`: the client and the record are told what the ledger holds.
    fn done_settled(&mut self, settled: Settled, report: DoneReport<N>, fx: &mut Fx<N>) {
        let DoneReport {
            from,
            finish_reason,
            cached_tokens,
            unrepresentable,
            lost_output,
            stop,
        } = report;
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
            _ if unrepresentable || lost_output => Outcome::Failed("model_backend_error".into()),
            // Whatever the node says now, its answer was cut at the bound.
            (_, Some(Stop::OverBound)) => Outcome::Failed("model_backend_error".into()),
            ("abort", Some(Stop::Cancelled)) => Outcome::Cancelled,
            ("abort", Some(Stop::Timeout)) => Outcome::Failed("generation_timeout".into()),
            ("abort" | "error", _) => Outcome::Failed("model_backend_error".into()),
            _ => Outcome::Completed,
        };
        self.finish_record(true, outcome.clone(), &usage, fx);
        match outcome {
            Outcome::Cancelled => {
                self.count(Tally::Cancelled, fx);
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
            // Billed what the engine produced: the work was done; the client is told its
            // answer is incomplete rather than handed it as whole.
            Outcome::Failed(_) if lost_output => self.fail_client(
                Failure::new(
                    ErrorCode::ModelBackendError,
                    "Part of the output was lost between the node and the gateway.",
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
                    self.count(Tally::Ok, fx);
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
            Some(Stop::OverBound) | None => Outcome::Failed("model_backend_error".into()),
        };
        self.finish_record(false, outcome.clone(), &usage, fx);
        if outcome == Outcome::Cancelled && !self.told {
            self.tell(GenEvent::Cancelled(usage), fx);
        }
        self.end(fx);
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
