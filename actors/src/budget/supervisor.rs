//! The [`BudgetSupervisor`], the [`BudgetOwners`] map it keeps, and [`TeamBudgets`], the
//! cloneable [`Ledger`] the generations hold. A crashed team actor is forgotten and counted
//! in `switchyard_actor_restarts_total{kind="team_budget"}`; its callers are told the quota
//! service is unavailable, and the team's next reservation spawns a fresh actor.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use async_trait::async_trait;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, ActorStatus, MessagingErr, SupervisionEvent};

use super::actor::{BudgetConfig, TeamBudgetActor, TeamBudgetArgs};
use super::cluster::{Answer, Asked, BudgetCluster, Route};
use super::msg::{BudgetSupervisorMsg, TeamBudgetMsg, TeamBudgetStats};
use crate::metric_names::ACTOR_RESTARTS_TOTAL;
use crate::ports::{
    Clock, Ledger, LedgerEntry, LedgerError, Reservation, SettleOutcome, Settlement,
};
use crate::tasks::TaskGuard;

/// How often a caller asks again when the actor it found retired under it (each retry
/// goes through the supervisor, which spawns a fresh actor).
const ROUTE_ATTEMPTS: usize = 3;

/// How much longer a replica waits for another's answer than that one waits for its actor.
const ASK_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Which actor owns which team's budget on this replica: the supervisor writes it, callers
/// read it. Which replica owns it is [`BudgetCluster`]'s to say.
#[derive(Debug, Clone, Default)]
pub struct BudgetOwners {
    owners: Arc<RwLock<BTreeMap<i64, ActorRef<TeamBudgetMsg>>>>,
}

impl BudgetOwners {
    /// The actor owning `team_id`'s budget, if one runs here.
    pub fn get(&self, team_id: i64) -> Option<ActorRef<TeamBudgetMsg>> {
        self.owners
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&team_id)
            .cloned()
    }

    /// Team actors running now.
    pub fn len(&self) -> usize {
        self.owners
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no team actor runs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&self, team_id: i64, actor: ActorRef<TeamBudgetMsg>) {
        self.owners
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(team_id, actor);
    }

    /// Forgets `team_id`'s owner if it is still `actor` (a replacement stays).
    fn remove_if(&self, team_id: i64, actor: ractor::ActorId) -> bool {
        let mut owners = self.owners.write().unwrap_or_else(PoisonError::into_inner);
        if owners.get(&team_id).is_some_and(|a| a.get_id() == actor) {
            owners.remove(&team_id);
            true
        } else {
            false
        }
    }

    /// The team a running actor serves.
    fn team_of(&self, actor: ractor::ActorId) -> Option<i64> {
        self.owners
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|(_, a)| a.get_id() == actor)
            .map(|(&team, _)| team)
    }
}

/// What the supervisor starts with.
#[derive(Debug, Clone)]
pub struct BudgetSupervisorArgs {
    /// The ledger every team actor commits to.
    ledger: Arc<dyn Ledger>,
    /// Time, for the team actors' idleness.
    clock: Arc<dyn Clock>,
    /// Batching and retirement of every team actor.
    config: BudgetConfig,
    /// The map it keeps and [`TeamBudgets`] reads.
    owners: BudgetOwners,
    /// Where each incarnation binds itself, so [`TeamBudgets`] reaches the live one after the
    /// root restarted it.
    slot: SupervisorSlot,
}

/// The live budget supervisor, rebound by each incarnation; `None` before the first start
/// and once it stopped.
type SupervisorSlot = Arc<RwLock<Option<ActorRef<BudgetSupervisorMsg>>>>;

/// The supervisor's state.
#[derive(Debug)]
pub struct BudgetSupervisorState {
    /// What every team actor is started with.
    args: BudgetSupervisorArgs,
    /// Counts the supervisor in `switchyard_tasks_alive`.
    _guard: TaskGuard,
}

/// Spawns, replaces and retires the team actors of this replica.
#[derive(Debug, Clone, Copy, Default)]
pub struct BudgetSupervisor;

impl Actor for BudgetSupervisor {
    type Msg = BudgetSupervisorMsg;
    type State = BudgetSupervisorState;
    type Arguments = BudgetSupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<BudgetSupervisorMsg>,
        args: BudgetSupervisorArgs,
    ) -> Result<BudgetSupervisorState, ActorProcessingErr> {
        // Team actors listed by a crashed incarnation died with it (they were linked): a
        // listed one that no longer takes messages is replaced on its team's next request.
        *args.slot.write().unwrap_or_else(PoisonError::into_inner) = Some(myself);
        Ok(BudgetSupervisorState {
            args,
            _guard: TaskGuard::new("budget_supervisor"),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<BudgetSupervisorMsg>,
        msg: BudgetSupervisorMsg,
        state: &mut BudgetSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BudgetSupervisorMsg::Owner(team_id, reply) => {
                let owners = &state.args.owners;
                // An actor that crashed or is retiring may still be listed: its failure
                // or end reaches us after this message. A fresh one replaces it.
                let live = owners.get(team_id).filter(|a| {
                    matches!(a.get_status(), ActorStatus::Starting | ActorStatus::Running)
                });
                let result = match live {
                    Some(actor) => Ok(actor),
                    None => {
                        let args = TeamBudgetArgs {
                            team_id,
                            ledger: state.args.ledger.clone(),
                            clock: state.args.clock.clone(),
                            config: state.args.config,
                            supervisor: myself.clone(),
                        };
                        match Actor::spawn_linked(None, TeamBudgetActor, args, myself.get_cell())
                            .await
                        {
                            Ok((actor, _)) => {
                                owners.insert(team_id, actor.clone());
                                Ok(actor)
                            }
                            Err(e) => {
                                tracing::error!(team_id, error = %e, "could not spawn a team budget actor");
                                Err(LedgerError::Unavailable(
                                    "the team's budget actor could not start".to_owned(),
                                ))
                            }
                        }
                    }
                };
                let _ = reply.send(result);
            }
            #[cfg(any(test, feature = "fault-injection"))]
            BudgetSupervisorMsg::Crash => crate::supervision::fault::inject("budget supervisor"),
            BudgetSupervisorMsg::Retire(team_id, actor) => {
                if let Some(retiring) = state.args.owners.get(team_id)
                    && retiring.get_id() == actor
                {
                    // Forgotten first, so new callers get a fresh actor; drained second,
                    // so what its mailbox holds is still answered.
                    state.args.owners.remove_if(team_id, actor);
                    let _ = retiring.drain();
                    tracing::debug!(team_id, "idle team budget actor retired");
                }
            }
        }
        Ok(())
    }

    /// A team actor's end never stops the supervisor (ractor's default would).
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<BudgetSupervisorMsg>,
        event: SupervisionEvent,
        state: &mut BudgetSupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                if let Some(team) = state.args.owners.team_of(cell.get_id()) {
                    state.args.owners.remove_if(team, cell.get_id());
                }
            }
            SupervisionEvent::ActorFailed(cell, error) => {
                // Its waiting callers' reply ports died with it: they are told the quota
                // service is unavailable. The team's next reservation spawns a new actor.
                metrics::counter!(ACTOR_RESTARTS_TOTAL, "kind" => "team_budget").increment(1);
                let team = state.args.owners.team_of(cell.get_id());
                if let Some(team) = team {
                    state.args.owners.remove_if(team, cell.get_id());
                }
                tracing::error!(team_id = ?team, %error, "team budget actor crashed; the next reservation replaces it");
            }
            _ => {}
        }
        Ok(())
    }
}

/// The [`Ledger`] generations use: a reservation goes through its team's actor (batched
/// with the team's other reservations), settles, cancels and reads go straight to the inner
/// ledger. Cloneable; every clone shares the supervisor.
#[derive(Debug, Clone)]
pub struct TeamBudgets {
    inner: Arc<dyn Ledger>,
    supervisor: SupervisorSlot,
    owners: BudgetOwners,
    config: BudgetConfig,
    /// In a cluster: who owns each team's budget, and the way to them.
    cluster: Option<Arc<BudgetCluster>>,
}

impl TeamBudgets {
    /// Starts the supervisor over `ledger`, on its own (tests; the server puts it under the
    /// root supervisor through [`Self::unstarted`]).
    pub async fn start(
        ledger: Arc<dyn Ledger>,
        clock: Arc<dyn Clock>,
        config: BudgetConfig,
    ) -> Result<Self, ractor::SpawnErr> {
        let (budgets, args) = Self::unstarted(ledger, clock, config);
        Actor::spawn(None, BudgetSupervisor, args).await?;
        Ok(budgets)
    }

    /// The handle, and the arguments its [`BudgetSupervisor`] is (re)started with by
    /// whoever supervises it: every incarnation binds itself where the handle looks.
    pub fn unstarted(
        ledger: Arc<dyn Ledger>,
        clock: Arc<dyn Clock>,
        config: BudgetConfig,
    ) -> (Self, BudgetSupervisorArgs) {
        let owners = BudgetOwners::default();
        let slot = SupervisorSlot::default();
        let args = BudgetSupervisorArgs {
            ledger: ledger.clone(),
            clock,
            config,
            owners: owners.clone(),
            slot: slot.clone(),
        };
        let budgets = Self {
            inner: ledger,
            supervisor: slot,
            owners,
            config,
            cluster: None,
        };
        (budgets, args)
    }

    /// In a cluster: a team's reservations are decided by the replica holding its lease.
    #[must_use]
    pub fn in_cluster(mut self, cluster: Arc<BudgetCluster>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// Test-only fault hook: makes the budget supervisor panic.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn crash_supervisor(&self) {
        if let Some(s) = self.supervisor() {
            let _ = s.cast(BudgetSupervisorMsg::Crash);
        }
    }

    /// Which incarnation of the supervisor is bound (tests see a restart by it).
    #[cfg(test)]
    pub(crate) fn supervisor_id(&self) -> Option<ractor::ActorId> {
        self.supervisor().map(|s| s.get_id())
    }

    /// The live supervisor, if one is bound.
    fn supervisor(&self) -> Option<ActorRef<BudgetSupervisorMsg>> {
        self.supervisor
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Which team actors run here.
    pub fn owners(&self) -> &BudgetOwners {
        &self.owners
    }

    /// What the actor of `team_id` knows (its last reported available balance, its
    /// batches), if one runs here.
    pub async fn stats(&self, team_id: i64) -> Option<TeamBudgetStats> {
        let actor = self.owners.get(team_id)?;
        match actor
            .call(TeamBudgetMsg::Stats, Some(self.config.reply_timeout))
            .await
        {
            Ok(CallResult::Success(stats)) => Some(stats),
            _ => None,
        }
    }

    /// Stops the supervisor and every team actor.
    pub fn stop(&self) {
        if let Some(cluster) = &self.cluster {
            cluster.stop();
        }
        if let Some(supervisor) = self
            .supervisor
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            supervisor.stop(None);
        }
    }

    /// The running actor of `team_id`, spawned if none runs.
    async fn owner(&self, team_id: i64) -> Result<ActorRef<TeamBudgetMsg>, LedgerError> {
        match self.owners.get(team_id) {
            Some(actor) => Ok(actor),
            None => self.fresh_owner(team_id).await,
        }
    }

    /// Asks the supervisor for the team's actor, spawned now if none runs (it also replaces
    /// one that is listed but no longer takes messages).
    async fn fresh_owner(&self, team_id: i64) -> Result<ActorRef<TeamBudgetMsg>, LedgerError> {
        let Some(supervisor) = self.supervisor() else {
            return Err(unavailable("the budget supervisor is not running"));
        };
        match supervisor
            .call(
                |reply| BudgetSupervisorMsg::Owner(team_id, reply),
                Some(self.config.reply_timeout),
            )
            .await
        {
            Ok(CallResult::Success(owner)) => owner,
            _ => Err(unavailable("the budget supervisor did not answer")),
        }
    }
}

fn unavailable(why: &str) -> LedgerError {
    LedgerError::Unavailable(why.to_owned())
}

#[async_trait]
impl Ledger for TeamBudgets {
    async fn reserve(&self, reservation: &Reservation) -> Result<(), LedgerError> {
        let Some(cluster) = &self.cluster else {
            return self.reserve_here(reservation).await;
        };
        // Set once an owner heard an ask and went without answering: it may have opened the
        // row, so a `Duplicate` now is that row (request ids are the server's, one per
        // request), not another request's.
        let mut unanswered = false;
        let ours = |result: Result<(), LedgerError>, unanswered: bool| match result {
            Err(LedgerError::Duplicate) if unanswered => Ok(()),
            other => other,
        };
        for _ in 0..ROUTE_ATTEMPTS {
            match cluster.route(reservation.team_id).await? {
                Route::Here => return ours(self.reserve_here(reservation).await, unanswered),
                Route::There(replica) => {
                    // Longer than the owner's own wait for its actor, so an answer it sends
                    // in time is heard.
                    let wait = self.config.reply_timeout + ASK_MARGIN;
                    match cluster.ask(&replica, reservation, wait).await? {
                        Asked::Answered(Answer::Decided(result)) => {
                            return ours(result, unanswered);
                        }
                        Asked::Answered(Answer::NotOwner) => cluster.forget(reservation.team_id),
                        // Nobody heard it: the owner is gone and its lease runs out soon.
                        // Deciding here meanwhile costs batching, not money (the ledger
                        // judges every reservation).
                        Asked::Unheard => {
                            return ours(self.reserve_here(reservation).await, unanswered);
                        }
                        // The owner went: whoever holds the lease now decides.
                        Asked::Unanswered => unanswered = true,
                    }
                }
            }
        }
        Err(unavailable("no replica took the team's reservation"))
    }

    async fn settle(&self, settlement: &Settlement) -> Result<SettleOutcome, LedgerError> {
        self.inner.settle(settlement).await
    }

    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        self.inner.cancel(request_id).await
    }

    async fn entry(&self, request_id: &str) -> Result<Option<LedgerEntry>, LedgerError> {
        self.inner.entry(request_id).await
    }
}

impl TeamBudgets {
    /// Decides a reservation through this replica's actor of the team.
    pub(super) async fn reserve_here(&self, reservation: &Reservation) -> Result<(), LedgerError> {
        let mut routed = self.owner(reservation.team_id).await?;
        for _ in 0..ROUTE_ATTEMPTS {
            let sent = routed
                .call(
                    |reply| TeamBudgetMsg::Reserve(Box::new(reservation.clone()), reply),
                    Some(self.config.reply_timeout),
                )
                .await;
            match sent {
                Ok(CallResult::Success(result)) => return result,
                // The actor died with the reservation in hand (a crash mid-batch): whether
                // its batch committed is unknown, so it is not retried — admission fails
                // closed and the sweeper releases a row that did commit.
                Ok(CallResult::SenderError) => {
                    return Err(unavailable("the team's budget actor stopped"));
                }
                Ok(CallResult::Timeout) => {
                    return Err(unavailable(
                        "the team's budget actor did not answer in time",
                    ));
                }
                // The mailbox was closed before the reservation got in (the actor retired
                // or died): it never saw it, so asking a fresh actor is safe.
                Err(MessagingErr::SendErr(_) | MessagingErr::ChannelClosed) => {
                    let team = reservation.team_id;
                    let stale = routed.get_id();
                    routed = match self.owners.get(team) {
                        Some(actor) if actor.get_id() != stale => actor,
                        _ => self.fresh_owner(team).await?,
                    };
                }
                Err(MessagingErr::InvalidActorType) => {
                    return Err(unavailable("the team's budget actor has the wrong type"));
                }
            }
        }
        Err(unavailable("no team budget actor took the reservation"))
    }
}
