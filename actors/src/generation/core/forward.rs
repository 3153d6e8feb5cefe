//! The forward path of a generation, as steps of the pure core: admission (reserve, holders
//! record, enqueue), a dispatch (the new epoch recorded, its holder written, the work sent) and
//! the stream (frames of the current attempt, the output kept for the record).

use tokio::time::Instant;

use super::{
    Admitting, Attempt, Core, Dispatching, Effect, Fx, Input, Metric, NodeRef, Reader, Row, Stop,
    Where, over_bound,
};
use crate::error::{ErrorCode, Failure};
use crate::generation::msg::{GenEvent, Timer};
use crate::lifecycle::{Event, Refusal};
use crate::node::Violation;
use crate::output::Piece;
use crate::ports::LedgerError;

/// Output kept for a lifecycle generation's result, at most.
pub(super) const MAX_RETAINED_OUTPUT: usize = 1 << 20;

impl<N: NodeRef> Core<N> {
    /// Admission: the row is opened (its answer comes later, as a message) while the holders
    /// record is written and the queue entered, so a node may start on the work before the
    /// row has committed; nothing reaches the client until it has.
    pub(super) fn admit(&mut self, fx: &mut Fx<N>) {
        if matches!(self.at, Where::New) {
            self.row = Row::Reserving;
            fx.push(Effect::Reserve);
            // Known from admission on, so a `done` for it from a node it was never
            // dispatched to is refused wherever it arrives.
            self.at = Where::Admitting(Admitting::RecordingHolders);
            fx.push(Effect::RecordHolders(self.holders.clone()));
        }
    }

    /// The row's answer. Committed: the admission is answered if it waited, and the held
    /// inputs are stepped in order ([`Core::next_held`]). Refused: nothing was billed and
    /// nothing will be — work already sent is stopped and fenced (its `done` is stale), the
    /// held inputs are dropped, and the admission is refused as it would have been before any
    /// dispatch.
    pub(super) fn reserved(&mut self, result: Result<(), LedgerError>, fx: &mut Fx<N>) {
        if self.row != Row::Reserving {
            return;
        }
        let failure = match result {
            Ok(()) => {
                self.row = Row::Reserved;
                if let Where::Ended { before_work } = self.at {
                    // Ended (refused) while it committed: released before the refusal is
                    // answered (the safety net tries again if this fails).
                    if before_work {
                        fx.push(Effect::CancelRow);
                    }
                    if let Some(reply) = self.reply_waits.take() {
                        fx.push(Effect::Reply(reply));
                    }
                    fx.push(Effect::Stop);
                } else if let Some(reply) = self.reply_waits.take() {
                    fx.push(Effect::Reply(reply));
                }
                return;
            }
            Err(LedgerError::InsufficientBalance) => Failure::new(
                ErrorCode::InsufficientBalance,
                "The team's balance cannot cover this request.",
            ),
            Err(LedgerError::Duplicate) => {
                Failure::new(ErrorCode::InvalidRequest, "Duplicate request id.")
            }
            Err(LedgerError::Unavailable(_)) => Failure::new(
                ErrorCode::QuotaServiceUnavailable,
                "The ledger is unreachable; the request was not admitted.",
            )
            .retry_after(1),
        };
        // No row: nothing to settle or release, ever.
        self.row = Row::Done;
        let decided = self.reply_waits.take();
        for input in std::mem::take(&mut self.held) {
            // A `done` that came meanwhile is acked: its node may forget it (it bills nothing).
            if let Input::Done { attempt, from, .. } = input
                && self.holders.get(&attempt).map(String::as_str) == Some(from.node_id())
            {
                fx.push(Effect::Ack {
                    node: from,
                    attempt,
                });
            }
        }
        match std::mem::replace(&mut self.at, Where::New) {
            Where::Ended { before_work } => {
                // Already ended: a refusal decided meanwhile is the answer, else this one.
                self.at = Where::Ended { before_work };
                match decided {
                    Some(Err(earlier)) => fx.push(Effect::Reply(Err(earlier))),
                    Some(Ok(())) => fx.push(Effect::Reply(Err(failure))),
                    None => {}
                }
                fx.push(Effect::Stop);
                return;
            }
            Where::Queued { .. } => fx.push(Effect::Withdraw),
            Where::Running { node } => {
                fx.push(Effect::CancelOnNode {
                    node,
                    attempt: self.attempt.epoch,
                });
                // Nothing from the node was believed yet (it waited for the row): the server
                // refuses the attempt, so nothing of it is ever billed (its `done` is stale
                // wherever it lands), the message is released and the key may be retried.
                self.record(
                    Event::Refuse {
                        attempt: self.attempt.epoch,
                    },
                    fx,
                );
            }
            other => self.at = other,
        }
        if self.active {
            // Counted as running when it was queued; it never was.
            self.active = false;
            fx.push(Effect::Metric(Metric::ActiveStreams(false)));
        }
        self.reject(failure, true, fx);
    }

    pub(super) fn holders_recorded(&mut self, ok: bool, now: Instant, fx: &mut Fx<N>) {
        match &self.at {
            Where::Admitting(Admitting::RecordingHolders) if ok => {
                self.at = Where::Admitting(Admitting::Enqueueing);
                fx.push(Effect::Enqueue {
                    front: false,
                    avoid: None,
                });
            }
            Where::Admitting(Admitting::RecordingHolders) => {
                let failure = Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The request could not be recorded; it was not admitted.",
                )
                .retry_after(1);
                self.cancel_row(fx);
                self.reject(failure, true, fx);
            }
            Where::Dispatching {
                node,
                step: Dispatching::RecordingHolders,
            } => {
                let node = node.clone();
                if !ok {
                    // Work whose node is not on record is not sent: a `done` for it could not
                    // be told apart from another node's.
                    fx.push(Effect::ReleaseSlot(node.node_id().to_owned()));
                    self.record(
                        Event::Refuse {
                            attempt: self.attempt.epoch,
                        },
                        fx,
                    );
                    let failure = Failure::new(
                        ErrorCode::QuotaServiceUnavailable,
                        "The request's dispatch could not be recorded; nothing was run.",
                    )
                    .retry_after(1);
                    self.finish_without_work(failure, fx);
                    return;
                }
                if self.dispatched_at.is_none() {
                    let waited = now.saturating_duration_since(self.admitted_at);
                    fx.push(Effect::Metric(Metric::QueueWait(waited.as_secs_f64())));
                }
                self.dispatched_at = Some(now);
                tracing::debug!(request_id = %self.cfg.request_id, node_id = node.node_id(), attempt = self.attempt.epoch, "dispatching");
                fx.push(Effect::Assign {
                    node: node.clone(),
                    attempt: self.attempt.epoch,
                });
                self.at = Where::Dispatching {
                    node,
                    step: Dispatching::Assigning,
                };
            }
            _ => {}
        }
    }

    /// The coordinator lost its data: a generation whose holders record was written (it was
    /// admitted and has not ended) writes it again — the attempts dispatched so far and this
    /// replica — so that a `done` arriving where the generation is not live still goes to it
    /// from the node that held the attempt, rather than waiting to be settled unverified. Its
    /// answer changes nothing: a record that could not be written is as lost as before.
    pub(super) fn record_again(&self, fx: &mut Fx<N>) {
        let recorded = !matches!(
            self.at,
            Where::New
                | Where::Admitting(_)
                | Where::Dispatching {
                    step: Dispatching::RecordingHolders,
                    ..
                }
                | Where::Rejecting { .. }
                | Where::Ended { .. }
        );
        if recorded {
            fx.push(Effect::RecordHolders(self.holders.clone()));
        }
    }

    pub(super) fn enqueued(&mut self, result: Result<(), Failure>, now: Instant, fx: &mut Fx<N>) {
        match (&self.at, result) {
            (Where::Admitting(Admitting::Enqueueing), Ok(())) => {
                self.at = Where::Queued { avoid: None };
                self.admitted_at = now;
                self.active = true;
                fx.push(Effect::Metric(Metric::ActiveStreams(true)));
                self.arm(Timer::Total, self.cfg.timeouts.total, fx);
                if self.row == Row::Reserved {
                    fx.push(Effect::Reply(Ok(())));
                } else {
                    // Answered once the row has committed (or refused).
                    self.reply_waits = Some(Ok(()));
                }
            }
            (Where::Admitting(Admitting::Enqueueing), Err(failure)) => {
                self.cancel_row(fx);
                self.reject(failure, true, fx);
            }
            (Where::Requeueing { avoid }, Ok(())) => {
                self.at = Where::Queued {
                    avoid: avoid.clone(),
                };
            }
            (Where::Requeueing { .. }, Err(failure)) => self.finish_without_work(failure, fx),
            _ => {}
        }
    }

    pub(super) fn dispatch(&mut self, node: N, fx: &mut Fx<N>) {
        if !matches!(self.at, Where::Queued { .. }) || self.reader == Reader::Gone {
            // The queue counted this assignment against the node: give the slot back.
            fx.push(Effect::ReleaseSlot(node.node_id().to_owned()));
            return;
        }
        // The epoch is recorded before any node hears of it, so a stale one can be fenced;
        // work whose epoch could not be recorded is not sent.
        fx.push(Effect::Record {
            event: Event::Dispatch {
                attempt: self.attempt.epoch + 1,
            },
            answer: true,
        });
        self.at = Where::Dispatching {
            node,
            step: Dispatching::RecordingEpoch,
        };
    }

    /// The answer of a record whose answer was asked for: a new epoch's, or a `Reject`'s.
    pub(super) fn recorded(&mut self, result: Option<Result<(), Refusal>>, fx: &mut Fx<N>) {
        match std::mem::replace(&mut self.at, Where::New) {
            Where::Dispatching {
                node,
                step: Dispatching::RecordingEpoch,
            } => self.epoch_recorded(node, result, fx),
            Where::Rejecting { failure, admission } => {
                self.at = Where::Rejecting {
                    failure: failure.clone(),
                    admission,
                };
                self.rejected(failure, admission, result, fx);
            }
            other => self.at = other,
        }
    }

    pub(super) fn epoch_recorded(
        &mut self,
        node: N,
        result: Option<Result<(), Refusal>>,
        fx: &mut Fx<N>,
    ) {
        // Until decided otherwise it is still waiting in the queue (the safety net releases
        // the row of a generation stopped there).
        self.at = Where::Queued { avoid: None };
        let slot = Effect::ReleaseSlot(node.node_id().to_owned());
        match result {
            None if self.cfg.recorded => {
                fx.push(slot);
                let failure = Failure::new(
                    ErrorCode::QuotaServiceUnavailable,
                    "The generation's record could not be updated; nothing was run.",
                )
                .retry_after(1);
                self.finish_without_work(failure, fx);
            }
            // Cancelled meanwhile through another replica.
            Some(Err(Refusal::NotAllowed(_))) => {
                fx.push(slot);
                self.end_cancelled_without_work(fx);
            }
            // Ended elsewhere (the sweeper): nothing to run, nobody to tell.
            Some(Err(Refusal::Final | Refusal::Stale)) => {
                fx.push(slot);
                self.told = true;
                self.cancel_row(fx);
                self.end(fx);
            }
            None | Some(Ok(())) => {
                let attempt = self.attempt.epoch + 1;
                self.attempt = Attempt {
                    epoch: attempt,
                    ..Attempt::default()
                };
                self.holders.insert(attempt, node.node_id().to_owned());
                fx.push(Effect::RecordHolders(self.holders.clone()));
                self.at = Where::Dispatching {
                    node,
                    step: Dispatching::RecordingHolders,
                };
            }
        }
    }

    pub(super) fn assigned(&mut self, sent: bool, fx: &mut Fx<N>) {
        let Where::Dispatching {
            node,
            step: Dispatching::Assigning,
        } = &self.at
        else {
            return;
        };
        let node = node.clone();
        self.at = Where::Running { node: node.clone() };
        if sent {
            self.arm(Timer::FirstToken, self.cfg.timeouts.first_token, fx);
        } else {
            // Never sent: proven not started.
            fx.push(Effect::ReleaseSlot(node.node_id().to_owned()));
            self.engine_error("not_sent", "the node's connection is gone", fx);
        }
    }

    /// The current attempt proved it started: the message is consumed (once).
    pub(super) fn prove_started(&mut self, fx: &mut Fx<N>) {
        if !self.attempt.evidence {
            self.attempt.evidence = true;
            self.record(
                Event::Accept {
                    attempt: self.attempt.epoch,
                },
                fx,
            );
        }
    }

    pub(super) fn chunk(
        &mut self,
        attempt: u64,
        seq: u64,
        delta: Piece,
        from: N,
        now: Instant,
        fx: &mut Fx<N>,
    ) {
        if !self.frame_is_current(attempt) {
            fx.push(Effect::Metric(Metric::StaleFrame("old_attempt")));
            return;
        }
        if seq < self.attempt.next_seq {
            // The agent sends each chunk once, in order: a `seq` going backwards is a lie.
            fx.push(Effect::Violation {
                node: from,
                kind: Violation::SeqRegression,
            });
            return;
        }
        if seq > self.attempt.next_seq {
            tracing::warn!(request_id = %self.cfg.request_id, expected = self.attempt.next_seq, got = seq, "gap in chunk sequence");
            self.attempt.gap = true;
        }
        self.prove_started(fx);
        self.attempt.next_seq = seq.saturating_add(1);
        self.attempt.chunks += 1;
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
            let ttft = now.saturating_duration_since(self.admitted_at);
            fx.push(Effect::Metric(Metric::Ttft(ttft.as_secs_f64())));
        }
        self.last_token_at = Some(now);
        if self.beyond_bound(&delta, from, fx) {
            return;
        }
        if self.cfg.recorded && !self.retained.full {
            self.retain(&delta);
        }
        self.tell(GenEvent::Delta(delta), fx);
    }

    /// Counts `delta` against the request's output bound. The chunk that crosses it, and every
    /// one after, is neither kept nor relayed: no engine sends that much for this request
    /// (SPEC section 7, trust), so it is a `completion_over_bound` violation, the client gets
    /// `model_backend_error` and the node is told to stop; its `done` settles the row within
    /// the request's usage bounds, as any other.
    fn beyond_bound(&mut self, delta: &Piece, from: N, fx: &mut Fx<N>) -> bool {
        let bound = self.cfg.output_bytes;
        let was_beyond = self.attempt.bytes > bound;
        let size = u64::try_from(delta.size()).unwrap_or(u64::MAX);
        self.attempt.bytes = self.attempt.bytes.saturating_add(size);
        if was_beyond {
            return true;
        }
        if self.attempt.bytes <= bound {
            return false;
        }
        tracing::warn!(
            request_id = %self.cfg.request_id,
            node_id = from.node_id(),
            received_bytes = self.attempt.bytes,
            bound_bytes = bound,
            "output beyond the request's bound; stopping the node's work"
        );
        fx.push(Effect::Violation {
            node: from,
            kind: Violation::CompletionOverBound,
        });
        self.fail_client(over_bound(), fx);
        self.cancel_on_node(Stop::OverBound, fx);
        true
    }

    /// Keeps the text, reasoning and tool calls of a lifecycle generation (never the
    /// logprobs), up to [`MAX_RETAINED_OUTPUT`].
    pub(super) fn retain(&mut self, delta: &Piece) {
        let calls: usize = delta
            .tool_calls
            .iter()
            .filter_map(|c| c.function.as_ref())
            .map(|f| {
                f.name.as_ref().map_or(0, String::len) + f.arguments.as_ref().map_or(0, String::len)
            })
            .sum();
        let adds = delta.text.len() + delta.reasoning.len() + calls;
        if self.retained.bytes + adds <= MAX_RETAINED_OUTPUT {
            self.retained.bytes += adds;
            self.retained.text.push_str(&delta.text);
            if !delta.tool_calls.is_empty() || !delta.reasoning.is_empty() {
                self.retained.extra.push(&Piece {
                    text: String::new(),
                    raw: None,
                    logprobs: None,
                    ..delta.clone()
                });
            }
        } else {
            // A retained result is a prefix of the answer, never one with a hole.
            self.retained.full = true;
        }
    }
}
