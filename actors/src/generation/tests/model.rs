//! The world around one generation core, for the model checker in `properties.rs`: random
//! operations (frames of any attempt from any node, timers in any order, the client leaving and
//! coming back, cancels, I/O that succeeds, fails or is refused, the row's answer at any point),
//! stepped the way the actor steps them against a model ledger and the real lifecycle record,
//! with what every effect may and may not do checked as it happens.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use proptest::prelude::*;
use tokio::time::Instant;

use crate::error::{ErrorCode, Failure};
use crate::generation::core::{Claim, Config, Core, Effect, Input, NodeRef, Where};
use crate::generation::events::SendError;
use crate::generation::msg::{GenEvent, Timeouts, Timer};
use crate::lifecycle::{
    self, AttemptState, Event, GenerationRecord, MessageState, Outcome, Status,
};
use crate::ports::{EntryStatus, LedgerEntry, LedgerError, SettleOutcome, UsageBounds};

pub(super) const MODEL: &str = "m";

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Node(&'static str);

impl NodeRef for Node {
    fn node_id(&self) -> &str {
        self.0
    }
}

/// Which attempt a frame names, relative to the current one.
#[derive(Debug, Clone, Copy)]
pub(super) enum Which {
    Current,
    Older,
    Newer,
}

/// Which node a frame comes from.
#[derive(Debug, Clone, Copy)]
pub(super) enum Src {
    /// The node holding the named attempt (a stranger if none does).
    Holder,
    A,
    B,
    Stranger,
}

#[derive(Debug, Clone)]
pub(super) enum Op {
    Admit,
    Dispatch(bool),
    QueueTimeout,
    Accepted(Which, Src),
    Chunk(Which, Src, u64),
    Done(Which, Src, u64, u64, u8),
    EngineError(Which, Option<Src>, u8),
    NodeLost(Which),
    NodeGone(bool),
    QueueRestarted(bool),
    ClientGone,
    ClientBack,
    /// The coordinator came back empty: the holders record is written again.
    RecordAgain,
    /// The owner cancels through the record (another replica's API), then tells the actor.
    Cancel,
    /// Fires the n-th armed timer (any order, any kind).
    Fire(usize),
    /// The replica shuts down: the actor stops from outside (its `post_stop` runs).
    Shutdown,
    /// The ledger answers the reservation in flight (it commits, or refuses).
    Reserved,
}

pub(super) fn which() -> impl Strategy<Value = Which> {
    prop_oneof![
        4 => Just(Which::Current),
        1 => Just(Which::Older),
        1 => Just(Which::Newer),
    ]
}

pub(super) fn from() -> impl Strategy<Value = Src> {
    prop_oneof![
        6 => Just(Src::Holder),
        1 => Just(Src::A),
        1 => Just(Src::B),
        1 => Just(Src::Stranger),
    ]
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Admit),
        3 => any::<bool>().prop_map(Op::Dispatch),
        1 => Just(Op::QueueTimeout),
        2 => (which(), from()).prop_map(|(w, f)| Op::Accepted(w, f)),
        6 => (which(), from(), 0u64..6).prop_map(|(w, f, s)| Op::Chunk(w, f, s)),
        2 => (which(), from(), 0u64..300, 0u64..300, 0u8..4)
            .prop_map(|(w, f, p, c, r)| Op::Done(w, f, p, c, r)),
        2 => (which(), proptest::option::of(from()), 0u8..8)
            .prop_map(|(w, f, c)| Op::EngineError(w, f, c)),
        1 => which().prop_map(Op::NodeLost),
        1 => any::<bool>().prop_map(Op::NodeGone),
        1 => any::<bool>().prop_map(Op::QueueRestarted),
        1 => Just(Op::ClientGone),
        1 => Just(Op::ClientBack),
        1 => Just(Op::RecordAgain),
        1 => Just(Op::Cancel),
        3 => (0usize..8).prop_map(Op::Fire),
        1 => Just(Op::Shutdown),
        3 => Just(Op::Reserved),
    ]
}

/// The ledger row as the model ledger holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ledger {
    None,
    Reserved,
    Settled(u64, u64),
    Cancelled,
}

/// The world around one core, and what it observed.
pub(super) struct World {
    pub(super) core: Core<Node>,
    pub(super) now: Instant,
    pub(super) bounds: UsageBounds,
    pub(super) dice: Vec<u8>,
    pub(super) next_die: usize,
    /// All I/O succeeds (driving to quiescence).
    pub(super) calm: bool,
    pub(super) timers: Vec<Timer>,
    pub(super) ledger: Ledger,
    /// A finalising call (settle or cancel) of the row failed: the row may stay reserved
    /// for the node's resent `done` or the sweeper.
    pub(super) row_io_failed: bool,
    /// The core's own finalisations that the ledger applied.
    pub(super) finalised: u32,
    pub(super) record: Option<GenerationRecord>,
    pub(super) record_io_failed: bool,
    pub(super) closed: bool,
    pub(super) deltas: usize,
    pub(super) terminals: Vec<GenEvent>,
    pub(super) replies: Vec<Result<(), Failure>>,
    pub(super) stops: u32,
    pub(super) counts: u32,
    /// Attempts whose frames (from their holder) reached the core.
    pub(super) evidence: BTreeSet<u64>,
    /// Attempts handed to a node and neither refused nor fenced since.
    pub(super) may_run: BTreeSet<u64>,
    /// Dispatches in the current run of the core (each gives its slot back or is sent).
    pub(super) slots_back: u32,
    pub(super) sent: u32,
    /// Stopped from outside while a node may have been working: its row waits for the
    /// node's resent `done`.
    pub(super) shut_mid_flight: bool,
    /// Stopped from outside at all.
    pub(super) shut: bool,
    /// A reservation is in flight (its answer is a message, delivered by [`Op::Reserved`]).
    pub(super) reserving: bool,
    /// The reservation committed and its answer reached the core.
    pub(super) reserved_ok: bool,
}

pub(super) fn record(recorded: bool) -> Option<GenerationRecord> {
    recorded.then(|| GenerationRecord {
        id: "g".into(),
        subject: "s".into(),
        idempotency_key: "k".into(),
        fingerprint: "f".into(),
        model: MODEL.into(),
        ledger_id: "g".into(),
        status: Status::Queued,
        cancel_requested: false,
        attempt: 0,
        attempt_state: AttemptState::None,
        message: MessageState::Reserved,
        window_start_ms: 0,
        slot_held: true,
        slot_expires_ms: i64::MAX,
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        error_code: None,
        finish_reason: None,
        created_ms: 0,
        terminal_ms: None,
    })
}

impl World {
    /// The world with an output bound of `bytes` (each chunk carries 3).
    pub(super) fn output_bound(mut self, bytes: u64) -> Self {
        self.core.cfg.output_bytes = bytes;
        self
    }

    pub(super) fn new(recorded: bool, bounded: bool, dice: Vec<u8>) -> Self {
        let bounds = if bounded {
            UsageBounds {
                prompt_tokens: 100,
                completion_tokens: 50,
            }
        } else {
            UsageBounds::UNBOUNDED
        };
        let cfg = Config {
            request_id: "g".into(),
            model: MODEL.into(),
            timeouts: Timeouts::default(),
            bounds,
            estimated_prompt_tokens: 20,
            // Four 3-byte chunks fit; see [`World::output_bound`].
            output_bytes: if bounded { 12 } else { u64::MAX },
            recorded,
            resumable: recorded,
        };
        let now = Instant::now();
        Self {
            core: Core::new(cfg, now),
            now,
            bounds,
            dice,
            next_die: 0,
            calm: false,
            timers: Vec::new(),
            ledger: Ledger::None,
            row_io_failed: false,
            finalised: 0,
            record: record(recorded),
            record_io_failed: false,
            closed: false,
            deltas: 0,
            terminals: Vec::new(),
            replies: Vec::new(),
            stops: 0,
            counts: 0,
            evidence: BTreeSet::new(),
            may_run: BTreeSet::new(),
            slots_back: 0,
            sent: 0,
            shut_mid_flight: false,
            shut: false,
            reserving: false,
            reserved_ok: false,
        }
    }

    /// The next die (0–99); always "success" once calm or out of dice.
    pub(super) fn die(&mut self) -> u8 {
        if self.calm || self.next_die >= self.dice.len() {
            return 99;
        }
        let d = self.dice[self.next_die] % 100;
        self.next_die += 1;
        d
    }

    pub(super) fn stopped(&self) -> bool {
        self.stops > 0
    }

    pub(super) fn epoch(&self, which: Which) -> u64 {
        let e = self.core.attempt.epoch;
        match which {
            Which::Current => e,
            Which::Older => e.saturating_sub(1),
            Which::Newer => e + 1,
        }
    }

    pub(super) fn node(&self, attempt: u64, from: Src) -> Node {
        match from {
            Src::Holder => match self.core.holders.get(&attempt).map(String::as_str) {
                Some("a") => Node("a"),
                Some("b") => Node("b"),
                _ => Node("x"),
            },
            Src::A => Node("a"),
            Src::B => Node("b"),
            Src::Stranger => Node("x"),
        }
    }

    /// A frame of `attempt` from `node` is evidence when `node` holds it.
    pub(super) fn frame(&mut self, attempt: u64, node: &Node) {
        if self.core.holders.get(&attempt).map(String::as_str) == Some(node.0) {
            self.evidence.insert(attempt);
        }
    }

    pub(super) fn apply(&mut self, op: Op) {
        if self.stopped() || self.shut {
            return;
        }
        let input = match op {
            Op::Admit => Input::Admit,
            Op::Dispatch(a) => {
                let node = Node(if a { "a" } else { "b" });
                let (back, sent) = (self.slots_back, self.sent);
                self.step(Input::Dispatch { node });
                // Each dispatch gives its slot back, or is sent: exactly one of them.
                assert_eq!(
                    (self.slots_back - back) + (self.sent - sent),
                    1,
                    "a dispatch neither gave its slot back nor ran, or did both"
                );
                return;
            }
            Op::QueueTimeout => Input::QueueTimeout,
            Op::Accepted(w, f) => {
                let attempt = self.epoch(w);
                let from = self.node(attempt, f);
                self.frame(attempt, &from);
                Input::Accepted { attempt, from }
            }
            Op::Chunk(w, f, seq) => {
                let attempt = self.epoch(w);
                let from = self.node(attempt, f);
                self.frame(attempt, &from);
                Input::Chunk {
                    attempt,
                    seq,
                    delta: "tok".into(),
                    from,
                }
            }
            Op::Done(w, f, p, c, r) => {
                let attempt = self.epoch(w);
                let from = self.node(attempt, f);
                self.frame(attempt, &from);
                let reason = ["stop", "length", "abort", "error"][usize::from(r % 4)];
                Input::Done {
                    attempt,
                    claim: Claim {
                        prompt_tokens: p,
                        completion_tokens: c,
                        cached_tokens: Some(p / 2),
                        chunks: None,
                        finish_reason: reason.into(),
                    },
                    from,
                }
            }
            Op::EngineError(w, f, c) => {
                let attempt = self.epoch(w);
                let from = f.map(|f| self.node(attempt, f));
                let code = [
                    "model_loading",
                    "invalid_request",
                    "draining",
                    "engine_unreachable",
                    "model_backend_error",
                    "model_not_found",
                    "not_sent",
                    "oom",
                ][usize::from(c % 8)];
                Input::EngineError {
                    attempt,
                    code: code.into(),
                    message: "engine says no".into(),
                    from,
                }
            }
            Op::NodeLost(w) => Input::NodeLost {
                attempt: self.epoch(w),
            },
            Op::NodeGone(a) => Input::NodeGone {
                node_id: if a { "a" } else { "b" }.into(),
            },
            Op::QueueRestarted(mine) => Input::QueueRestarted {
                model: if mine { MODEL } else { "other" }.into(),
            },
            Op::ClientGone => Input::ClientGone,
            Op::ClientBack => Input::ClientBack,
            Op::RecordAgain => Input::RecordAgain,
            Op::Cancel => {
                if let Some(rec) = &mut self.record {
                    let _ = lifecycle::apply(rec, &Event::RequestCancel, 0);
                }
                Input::Cancel
            }
            Op::Shutdown => {
                self.shut = true;
                // The reservation in flight may still commit, with nobody to answer: the
                // row waits for the node's resent `done` or the sweeper.
                if std::mem::take(&mut self.reserving) {
                    self.ledger = Ledger::Reserved;
                }
                self.shut_mid_flight = self.ledger == Ledger::Reserved && !self.reserved_ok
                    || matches!(
                        self.core.at,
                        Where::Running { .. }
                            | Where::Fencing { .. }
                            | Where::Cancelling { .. }
                            | Where::AwaitingDone { .. }
                            | Where::Settling(_)
                    );
                Input::Stopped
            }
            Op::Reserved => match self.reservation_answer() {
                Some(answer) => answer,
                None => return,
            },
            Op::Fire(n) => {
                if self.timers.is_empty() {
                    return;
                }
                let timer = self.timers.remove(n % self.timers.len());
                Input::Timer(timer)
            }
        };
        self.step(input);
    }

    /// The ledger's answer to the reservation in flight, if one is.
    pub(super) fn reservation_answer(&mut self) -> Option<Input<Node>> {
        if !std::mem::take(&mut self.reserving) {
            return None;
        }
        let answer = match self.die() {
            0..5 => Err(LedgerError::InsufficientBalance),
            5..10 => Err(LedgerError::Unavailable("down".into())),
            10..12 => Err(LedgerError::Duplicate),
            _ => {
                self.ledger = Ledger::Reserved;
                self.reserved_ok = true;
                Ok(())
            }
        };
        Some(Input::Reserved(answer))
    }

    /// Steps the core the way the actor does: effects in order, each answer stepped at once,
    /// then the inputs it held while its row was being opened.
    pub(super) fn step(&mut self, input: Input<Node>) {
        let mut next = Some(input);
        while let Some(input) = next {
            self.now += Duration::from_millis(7);
            let fx = self.core.step(input, self.now);
            let mut todo = self.batch(fx);
            while let Some(effect) = todo.pop_front() {
                if let Some(answer) = self.carry_out(effect) {
                    let more = self.core.step(answer, self.now);
                    for e in self.batch(more).into_iter().rev() {
                        todo.push_front(e);
                    }
                }
            }
            next = self.core.next_held();
        }
    }

    /// Checks a batch's shape: an effect whose answer decides what comes next ends it; nothing
    /// follows the stop.
    pub(super) fn batch(&mut self, fx: Vec<Effect<Node>>) -> VecDeque<Effect<Node>> {
        for (i, e) in fx.iter().enumerate() {
            let decides = matches!(
                e,
                Effect::RecordHolders(_)
                    | Effect::Enqueue { .. }
                    | Effect::Record { answer: true, .. }
                    | Effect::Assign { .. }
                    | Effect::Settle { .. }
                    | Effect::LookUpRow
            );
            assert!(
                !decides || i + 1 == fx.len(),
                "{e:?} does not end its batch: {fx:?}"
            );
            assert!(
                !matches!(e, Effect::Stop) || i + 1 == fx.len(),
                "effects after the stop: {fx:?}"
            );
        }
        fx.into()
    }

    pub(super) fn carry_out(&mut self, effect: Effect<Node>) -> Option<Input<Node>> {
        assert!(
            self.stops == 0
                || matches!(
                    effect,
                    Effect::CancelRow | Effect::Tell(_) | Effect::Metric(_)
                ),
            "{effect:?} after the stop"
        );
        match effect {
            Effect::Reply(r) => {
                assert!(self.replies.is_empty(), "admission answered twice");
                assert!(
                    r.is_err() || self.reserved_ok,
                    "admitted before its row committed"
                );
                assert!(
                    r.is_ok() || self.ledger != Ledger::Reserved || self.row_io_failed || self.shut,
                    "refused with its row still reserved"
                );
                self.replies.push(r);
                None
            }
            Effect::Reserve => {
                assert!(
                    !self.reserving && self.ledger == Ledger::None,
                    "reserved twice"
                );
                self.reserving = true;
                None
            }
            Effect::RecordHolders(holders) => {
                for (attempt, node) in &holders {
                    assert_eq!(self.core.holders.get(attempt), Some(node));
                }
                Some(Input::HoldersRecorded(self.die() >= 8))
            }
            Effect::Enqueue { .. } => Some(Input::Enqueued(if self.die() < 8 {
                Err(Failure::new(ErrorCode::NoHealthyNode, "no node"))
            } else {
                Ok(())
            })),
            Effect::Withdraw => None,
            Effect::Record { event, answer } => {
                self.check_record(&event);
                let result = if self.die() < 6 {
                    self.record_io_failed |= self.record.is_some();
                    None
                } else {
                    self.record
                        .as_mut()
                        .map(|rec| lifecycle::apply(rec, &event, 0).map(|_| ()))
                };
                answer.then_some(Input::Recorded(result))
            }
            Effect::Assign { node, attempt } => {
                assert_eq!(
                    self.core.holders.get(&attempt).map(String::as_str),
                    Some(node.0),
                    "work sent to a node not on record"
                );
                assert_eq!(attempt, self.core.attempt.epoch);
                let sent = self.die() >= 6;
                self.may_run.insert(attempt);
                if sent {
                    self.sent += 1;
                }
                Some(Input::Assigned(sent))
            }
            Effect::CancelOnNode { node, attempt } => {
                assert_eq!(
                    self.core.holders.get(&attempt).map(String::as_str),
                    Some(node.0)
                );
                None
            }
            Effect::Ack { node, attempt } => {
                assert_eq!(
                    self.core.holders.get(&attempt).map(String::as_str),
                    Some(node.0),
                    "acked a node that does not hold the attempt"
                );
                None
            }
            Effect::Violation { .. } => None,
            Effect::ReleaseSlot(_) => {
                self.slots_back += 1;
                None
            }
            Effect::Settle {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                assert_ne!(self.ledger, Ledger::None, "settled a row never opened");
                assert_eq!(self.finalised, 0, "settled a row it had finalised");
                if self.die() < 25 {
                    self.row_io_failed = true;
                    return Some(Input::Settled(Err(LedgerError::Unavailable("down".into()))));
                }
                let outcome = if self.ledger == Ledger::Reserved {
                    let billed = self.bounds.bill(prompt_tokens, completion_tokens);
                    self.ledger = Ledger::Settled(billed.prompt_tokens, billed.completion_tokens);
                    self.finalised += 1;
                    SettleOutcome::Applied
                } else {
                    SettleOutcome::AlreadyFinal
                };
                Some(Input::Settled(Ok(outcome)))
            }
            Effect::LookUpRow => {
                if self.die() < 25 {
                    return Some(Input::RowLookedUp(Err(LedgerError::Unavailable(
                        "down".into(),
                    ))));
                }
                let status = match self.ledger {
                    Ledger::None => None,
                    Ledger::Reserved => Some(EntryStatus::Reserved),
                    Ledger::Settled(p, c) => Some(EntryStatus::Settled {
                        prompt_tokens: p,
                        completion_tokens: c,
                    }),
                    Ledger::Cancelled => Some(EntryStatus::Cancelled),
                };
                Some(Input::RowLookedUp(Ok(status.map(|status| LedgerEntry {
                    model: "m".into(),
                    bounds: self.bounds,
                    status,
                }))))
            }
            Effect::CancelRow => {
                assert_ne!(self.ledger, Ledger::None, "cancelled a row never opened");
                assert_eq!(self.finalised, 0, "cancelled a row it had finalised");
                if self.die() < 25 {
                    self.row_io_failed = true;
                    return Some(Input::RowCancelled(false));
                }
                if self.ledger == Ledger::Reserved {
                    self.ledger = Ledger::Cancelled;
                    self.finalised += 1;
                }
                Some(Input::RowCancelled(true))
            }
            Effect::Tell(event) => {
                let delta = matches!(event, GenEvent::Delta(_));
                assert!(
                    self.terminals.is_empty(),
                    "{event:?} after the terminal {:?}",
                    self.terminals
                );
                if delta {
                    assert!(
                        self.reserved_ok,
                        "output reached the client before its row committed"
                    );
                    self.deltas += 1;
                } else {
                    self.terminals.push(event);
                }
                let d = self.die();
                let answer = if self.closed || d < 5 {
                    self.closed = true;
                    Err(SendError::Closed)
                } else if delta && d < 15 {
                    Err(SendError::Overflow)
                } else {
                    Ok(())
                };
                Some(Input::Told(answer))
            }
            Effect::Count(_) => {
                self.counts += 1;
                assert_eq!(self.counts, 1, "outcome counted twice");
                None
            }
            Effect::Metric(_) => None,
            Effect::ArmTimer { timer, .. } => {
                self.timers.push(timer);
                None
            }
            Effect::Stop => {
                self.stops += 1;
                assert_eq!(self.stops, 1, "stopped twice");
                None
            }
        }
    }

    /// The record moves only as its facts allow: an attempt is accepted only on evidence
    /// from its node; a generation is rejected only when nothing may still run; only the node
    /// completes.
    pub(super) fn check_record(&mut self, event: &Event) {
        match event {
            Event::Accept { attempt } => assert!(
                self.evidence.contains(attempt),
                "accepted attempt {attempt} without evidence from its node"
            ),
            Event::Refuse { attempt } | Event::LeaseExpired { attempt } => {
                self.may_run.remove(attempt);
            }
            Event::Reject { .. } => assert!(
                self.may_run.is_empty(),
                "rejected while attempts {:?} may still run",
                self.may_run
            ),
            Event::Finish {
                from_node: false,
                outcome,
                ..
            } => assert_ne!(*outcome, Outcome::Completed, "the server completed it"),
            _ => {}
        }
    }

    /// Fires what is armed and lets the queue's deadline pass until the generation stops,
    /// with every I/O succeeding; then the actor's `post_stop` runs.
    pub(super) fn quiesce(&mut self) {
        if self.shut {
            return;
        }
        self.calm = true;
        if let Some(answer) = self.reservation_answer() {
            self.step(answer);
        }
        for _ in 0..64 {
            if self.stopped() {
                break;
            }
            if !self.timers.is_empty() {
                let timer = self.timers.remove(0);
                self.step(Input::Timer(timer));
            } else if matches!(self.core.at, Where::Queued { .. }) {
                self.step(Input::QueueTimeout);
            } else {
                break;
            }
        }
        self.step(Input::Stopped);
    }

    pub(super) fn check_end(&self) {
        let admitted = matches!(self.replies.as_slice(), [Ok(())]);
        let refused = matches!(self.replies.as_slice(), [Err(_)]);
        if (admitted || refused) && !self.shut {
            assert_eq!(
                self.stops, 1,
                "an admitted generation did not stop: {:?}",
                self.core.at
            );
        }
        // Exactly one terminal event, unless the admission itself answered. A refused
        // client never gets the stream: an end put in it before the refusal (a cancel while
        // its row committed) is never read, and no output ever went into it.
        if refused {
            assert!(self.terminals.len() <= 1 && self.deltas == 0);
        } else {
            assert_eq!(self.terminals.len(), 1, "terminals: {:?}", self.terminals);
        }
        // The row: finalised at most once, and exactly once unless the ledger failed us
        // (then it waits for the node's resent done or the sweeper).
        assert!(self.finalised <= 1);
        if self.ledger == Ledger::Reserved {
            assert!(
                self.row_io_failed || self.shut_mid_flight,
                "the row was left reserved"
            );
        }
        if let (Some(rec), false) = (&self.record, self.record_io_failed) {
            // Driven to its end (unless the replica shut it down), and its message spent
            // exactly when output went out.
            assert!(
                rec.status.is_terminal()
                    || rec.status == Status::Rejected
                    || !admitted
                    || self.shut,
                "record left {:?}",
                rec.status
            );
            if self.deltas > 0 {
                assert_eq!(rec.message, MessageState::Consumed);
            }
            if rec.status == Status::Rejected {
                assert_eq!(rec.message, MessageState::Released);
                assert_eq!(self.deltas, 0);
            }
        }
        if let [GenEvent::Finished(usage)] = self.terminals.as_slice() {
            // What the client is told is what the ledger holds.
            assert_eq!(
                self.ledger,
                Ledger::Settled(usage.prompt_tokens, usage.completion_tokens)
            );
        }
    }
}
