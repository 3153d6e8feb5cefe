//! Messages of the [`super::TeamBudgetActor`] and of its [`super::BudgetSupervisor`].

use ractor::{ActorId, ActorRef, RpcReplyPort};

use crate::ports::{LedgerError, Microcredits, Reservation};

/// What a [`super::TeamBudgetActor`] handles.
#[derive(Debug)]
pub enum TeamBudgetMsg {
    /// A reservation of this team to admit; answered once the batch holding it committed
    /// (or failed), exactly as [`crate::ports::Ledger::reserve`] would answer it.
    Reserve(Box<Reservation>, RpcReplyPort<Result<(), LedgerError>>),
    /// Commit the waiting reservations as one batch. The actor sends it to itself when the
    /// first reservation arrives with none scheduled, so every reservation that arrived
    /// before it — during the previous batch's transaction, typically — joins this batch.
    Flush,
    /// Periodic: a team actor idle for [`super::BudgetConfig::idle_after`] asks to retire,
    /// so a hundred thousand teams seen once do not pin an actor each.
    IdleCheck,
    /// What the actor knows, for operators and tests.
    Stats(RpcReplyPort<TeamBudgetStats>),
}

/// A team actor's view, as [`TeamBudgetMsg::Stats`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TeamBudgetStats {
    /// The team.
    pub team_id: i64,
    /// Balance minus open reservations when the last batch committed, if the ledger reported
    /// it. A snapshot: credits and settles change it at any time, so it never decides an
    /// admission.
    pub available: Option<Microcredits>,
    /// Batches committed (ledger calls made) since the actor started.
    pub batches: u64,
    /// Reservations decided in those batches.
    pub decided: u64,
    /// The largest batch so far.
    pub largest_batch: usize,
    /// Reservations waiting for the next batch now.
    pub waiting: usize,
}

/// What the [`super::BudgetSupervisor`] handles.
#[derive(Debug)]
pub enum BudgetSupervisorMsg {
    /// The running actor of a team, spawned now if none runs (lazily: a team gets an actor
    /// on its first reservation, or its first after a crash or retirement).
    Owner(
        i64,
        RpcReplyPort<Result<ActorRef<TeamBudgetMsg>, LedgerError>>,
    ),
    /// A team actor found itself idle: forget it and drain it (reservations already in its
    /// mailbox are still answered; later sends fail and their callers ask again).
    Retire(i64, ActorId),
    /// Test-only fault hook: the supervisor panics while handling it.
    #[cfg(any(test, feature = "fault-injection"))]
    Crash,
}
