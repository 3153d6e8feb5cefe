//! One [`TeamBudgetActor`] per team: it serialises the team's reservations and commits them
//! in batches (group commit: while one batch's transaction runs, the next one gathers in the
//! mailbox), under a [`BudgetSupervisor`] that spawns team actors lazily, replaces a crashed
//! one on the next request and retires idle ones. [`TeamBudgets`] is the [`Ledger`] the
//! generations use: reservations go through the team's actor, everything else straight on.
//!
//! [`Ledger`]: crate::ports::Ledger

mod actor;
mod cluster;
mod msg;
mod supervisor;

pub use actor::{BudgetConfig, TeamBudgetActor, TeamBudgetArgs, TeamBudgetState};
pub use cluster::BudgetCluster;
pub use msg::{BudgetSupervisorMsg, TeamBudgetMsg, TeamBudgetStats};
pub use supervisor::{BudgetOwners, BudgetSupervisor, BudgetSupervisorArgs, TeamBudgets};

#[cfg(test)]
mod tests;
