//! The [`TeamBudgetActor`]: a team's reservations in arrival order, committed in batches of
//! at most [`BudgetConfig::max_batch`] through [`Ledger::reserve_batch_report`] — one
//! transaction, one lock of the team's row and one commit for the whole batch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::time::Instant;

use super::msg::{BudgetSupervisorMsg, TeamBudgetMsg, TeamBudgetStats};
use crate::ports::{Clock, Ledger, LedgerError, Microcredits, Reservation};

/// How team actors batch, wait and retire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// Most reservations in one batch (one transaction). Bounds how long the team's row
    /// stays locked and how large one statement grows.
    pub max_batch: usize,
    /// How long the first reservation of a batch waits for company before the batch runs.
    /// Zero is natural batching: a batch runs at once, and what arrives during its
    /// transaction forms the next one.
    pub linger: Duration,
    /// A team actor without a reservation for this long retires.
    pub idle_after: Duration,
    /// How long a caller waits for its answer before it is told the quota service is
    /// unavailable (a stuck database must not hang admissions).
    pub reply_timeout: Duration,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            max_batch: 256,
            linger: Duration::ZERO,
            idle_after: Duration::from_secs(60),
            reply_timeout: Duration::from_secs(15),
        }
    }
}

/// What a team actor starts with.
#[derive(Debug, Clone)]
pub struct TeamBudgetArgs {
    /// The team it serves.
    pub team_id: i64,
    /// The authoritative ledger the batches commit to.
    pub ledger: Arc<dyn Ledger>,
    /// Time, for idleness.
    pub clock: Arc<dyn Clock>,
    /// Batching and retirement.
    pub config: BudgetConfig,
    /// Told when the actor is idle (it decides the retirement, so no new caller is routed
    /// to an actor about to stop).
    pub supervisor: ActorRef<BudgetSupervisorMsg>,
}

/// A reservation waiting for its batch, with the caller's reply port.
#[derive(Debug)]
pub(super) struct Waiting {
    /// The row to open.
    reservation: Reservation,
    /// Where its answer goes; dropped unanswered only if the actor dies, which the caller
    /// reads as `Unavailable`.
    reply: RpcReplyPort<Result<(), LedgerError>>,
}

/// The team actor's state.
#[derive(Debug)]
pub struct TeamBudgetState {
    /// What it started with.
    args: TeamBudgetArgs,
    /// Reservations that arrived since the last batch started, in arrival order (the order
    /// the ledger decides them in).
    waiting: VecDeque<Waiting>,
    /// A [`TeamBudgetMsg::Flush`] is in the mailbox or on a timer: no second one is sent.
    flush_scheduled: bool,
    /// Balance minus open reservations as the last batch committed (see
    /// [`TeamBudgetStats::available`]: reported, never trusted for a decision).
    available: Option<Microcredits>,
    /// When the last reservation arrived, for retirement.
    last_active: Instant,
    /// Batches committed so far.
    batches: u64,
    /// Reservations decided so far.
    decided: u64,
    /// The largest batch so far.
    largest_batch: usize,
    // No `TaskGuard`: a team actor outlives its team's requests by design (it retires after
    // `idle_after`), so `switchyard_tasks_alive`, the per-request leak detector, would read
    // every recently active team as a leak. `BudgetOwners::len` counts them instead.
}

/// What the actor must do after a reservation arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Schedule {
    /// A flush is already scheduled: the reservation joins it.
    Nothing,
    /// Send a flush now (natural batching).
    FlushNow,
    /// Send a flush after the linger.
    FlushAfter(Duration),
}

impl TeamBudgetState {
    fn new(args: TeamBudgetArgs) -> Self {
        let now = args.clock.now();
        Self {
            args,
            waiting: VecDeque::new(),
            flush_scheduled: false,
            available: None,
            last_active: now,
            batches: 0,
            decided: 0,
            largest_batch: 0,
        }
    }

    /// A reservation arrived: it waits for the next batch, which is scheduled unless it
    /// already is.
    pub(super) fn arrive(&mut self, waiting: Waiting, now: Instant) -> Schedule {
        self.waiting.push_back(waiting);
        self.last_active = now;
        if self.flush_scheduled {
            return Schedule::Nothing;
        }
        self.flush_scheduled = true;
        if self.args.config.linger.is_zero() {
            Schedule::FlushNow
        } else {
            Schedule::FlushAfter(self.args.config.linger)
        }
    }

    /// The next batch: the oldest waiting reservations, at most `max_batch` of them. The
    /// flush that asked for it is consumed.
    pub(super) fn next_batch(&mut self) -> Vec<Waiting> {
        self.flush_scheduled = false;
        let n = self.waiting.len().min(self.args.config.max_batch.max(1));
        self.waiting.drain(..n).collect()
    }

    /// A batch was decided.
    fn committed(&mut self, size: usize, available: Option<Microcredits>) {
        self.batches += 1;
        self.decided += size as u64;
        self.largest_batch = self.largest_batch.max(size);
        if available.is_some() {
            self.available = available;
        }
    }

    /// Whether the actor has nothing to do and had nothing for `idle_after`.
    pub(super) fn idle(&self, now: Instant) -> bool {
        self.waiting.is_empty()
            && !self.flush_scheduled
            && now.saturating_duration_since(self.last_active) >= self.args.config.idle_after
    }

    fn stats(&self) -> TeamBudgetStats {
        TeamBudgetStats {
            team_id: self.args.team_id,
            available: self.available,
            batches: self.batches,
            decided: self.decided,
            largest_batch: self.largest_batch,
            waiting: self.waiting.len(),
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone, Copy, Default)]
pub struct TeamBudgetActor;

impl TeamBudgetActor {
    /// Commits batches until nothing waits, or until one more is scheduled through the
    /// mailbox (so reservations that arrived meanwhile join it). Runs inline when the
    /// mailbox no longer takes messages (the actor is draining to retire).
    async fn flush(myself: &ActorRef<TeamBudgetMsg>, state: &mut TeamBudgetState) {
        loop {
            let batch = state.next_batch();
            if batch.is_empty() {
                return;
            }
            Self::commit(state, batch).await;
            if state.waiting.is_empty() {
                return;
            }
            state.flush_scheduled = true;
            if myself.cast(TeamBudgetMsg::Flush).is_ok() {
                return;
            }
        }
    }

    /// One batch: one ledger call, then every caller gets its own answer.
    async fn commit(state: &mut TeamBudgetState, batch: Vec<Waiting>) {
        let (reservations, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|w| (w.reservation, w.reply)).unzip();
        let report = state.args.ledger.reserve_batch_report(&reservations).await;
        let size = reservations.len();
        let mut results = report.results.into_iter();
        for reply in replies {
            // A ledger that answered fewer rows than it was given broke its contract; the
            // rows it left out fail closed rather than hang.
            let result = results.next().unwrap_or_else(|| {
                Err(LedgerError::Unavailable(
                    "the ledger left a reservation of the batch unanswered".to_owned(),
                ))
            });
            // A caller that gave up (timeout) no longer listens; its row, if admitted, is
            // the sweeper's, as with a single reservation whose caller left.
            let _ = reply.send(result);
        }
        let available = report.available.get(&state.args.team_id).copied();
        state.committed(size, available);
        tracing::debug!(
            team_id = state.args.team_id,
            size,
            ?available,
            "budget batch committed"
        );
    }

    fn schedule(myself: &ActorRef<TeamBudgetMsg>, schedule: Schedule) -> Result<(), ()> {
        match schedule {
            Schedule::Nothing => Ok(()),
            Schedule::FlushNow => myself.cast(TeamBudgetMsg::Flush).map_err(|_| ()),
            Schedule::FlushAfter(linger) => {
                myself.send_after(linger, || TeamBudgetMsg::Flush);
                Ok(())
            }
        }
    }
}

impl Actor for TeamBudgetActor {
    type Msg = TeamBudgetMsg;
    type State = TeamBudgetState;
    type Arguments = TeamBudgetArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<TeamBudgetMsg>,
        args: TeamBudgetArgs,
    ) -> Result<TeamBudgetState, ActorProcessingErr> {
        // The timer ends with the actor (its sends fail once the mailbox is gone).
        myself.send_interval(args.config.idle_after, || TeamBudgetMsg::IdleCheck);
        Ok(TeamBudgetState::new(args))
    }

    async fn handle(
        &self,
        myself: ActorRef<TeamBudgetMsg>,
        msg: TeamBudgetMsg,
        state: &mut TeamBudgetState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TeamBudgetMsg::Reserve(reservation, reply) => {
                let now = state.args.clock.now();
                let waiting = Waiting {
                    reservation: *reservation,
                    reply,
                };
                let schedule = state.arrive(waiting, now);
                if Self::schedule(&myself, schedule).is_err() {
                    // Draining: the mailbox takes no more messages, so no flush could
                    // follow; this reservation is answered now.
                    Self::flush(&myself, state).await;
                }
            }
            TeamBudgetMsg::Flush => Self::flush(&myself, state).await,
            TeamBudgetMsg::IdleCheck => {
                if state.idle(state.args.clock.now()) {
                    let retire = BudgetSupervisorMsg::Retire(state.args.team_id, myself.get_id());
                    if state.args.supervisor.cast(retire).is_err() {
                        // No supervisor left to route callers elsewhere: stop anyway.
                        myself.stop(Some("supervisor gone".to_owned()));
                    }
                }
            }
            TeamBudgetMsg::Stats(reply) => {
                let _ = reply.send(state.stats());
            }
        }
        Ok(())
    }

    /// A retiring actor answers whatever still waits before it goes.
    async fn post_stop(
        &self,
        _myself: ActorRef<TeamBudgetMsg>,
        state: &mut TeamBudgetState,
    ) -> Result<(), ActorProcessingErr> {
        loop {
            let batch = state.next_batch();
            if batch.is_empty() {
                return Ok(());
            }
            Self::commit(state, batch).await;
        }
    }
}
