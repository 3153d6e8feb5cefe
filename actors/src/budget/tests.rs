//! The team budget actors on an in-memory ledger that keeps balances and counts its calls:
//! concurrent reservations are batched, a batch never admits beyond the balance, a crash
//! mid-batch answers every caller and the next reservation gets a fresh actor, idle actors
//! retire and come back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{BudgetConfig, TeamBudgets};
use crate::ports::memory::MemoryLedger;
use crate::ports::{
    BatchReport, Ledger, LedgerEntry, LedgerError, Microcredits, Reservation, SettleOutcome,
    Settlement, SystemClock, UsageBounds,
};

/// A ledger with balances, the single-row rule batched natively, a transaction's latency,
/// and a switch that makes the next batch panic (a bug in the middle of a batch).
#[derive(Debug, Default)]
struct BankLedger {
    /// Team → (balance, held by open reservations).
    teams: Mutex<BTreeMap<i64, (Microcredits, Microcredits)>>,
    /// Ids taken.
    ids: Mutex<BTreeSet<String>>,
    /// Calls of `reserve_batch_report`.
    batches: AtomicUsize,
    /// Calls of `reserve`.
    singles: AtomicUsize,
    /// How long a batch's "transaction" takes.
    latency: Duration,
    /// The next batch panics.
    panic_next: AtomicBool,
    /// Settles, cancels and reads go here.
    rows: MemoryLedger,
}

impl BankLedger {
    fn with(latency: Duration, teams: &[(i64, Microcredits)]) -> Arc<Self> {
        Arc::new(Self {
            teams: Mutex::new(teams.iter().map(|&(t, b)| (t, (b, 0))).collect()),
            latency,
            ..Self::default()
        })
    }

    fn decide(&self, r: &Reservation) -> Result<(), LedgerError> {
        let mut teams = self.teams.lock().unwrap();
        let Some((balance, held)) = teams.get_mut(&r.team_id) else {
            return Err(LedgerError::Unavailable("no team".into()));
        };
        let mut ids = self.ids.lock().unwrap();
        if ids.contains(&r.request_id) {
            return Err(LedgerError::Duplicate);
        }
        if *held + r.estimated_cost > *balance {
            return Err(LedgerError::InsufficientBalance);
        }
        *held += r.estimated_cost;
        ids.insert(r.request_id.clone());
        Ok(())
    }

    fn held(&self, team: i64) -> Microcredits {
        self.teams.lock().unwrap().get(&team).map_or(0, |t| t.1)
    }
}

#[async_trait]
impl Ledger for BankLedger {
    async fn reserve(&self, r: &Reservation) -> Result<(), LedgerError> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.latency).await;
        self.decide(r)
    }

    async fn reserve_batch_report(&self, batch: &[Reservation]) -> BatchReport {
        self.batches.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.latency).await;
        if self.panic_next.swap(false, Ordering::SeqCst) {
            panic!("a bug in the middle of a batch");
        }
        let results = batch.iter().map(|r| self.decide(r)).collect();
        let available = self
            .teams
            .lock()
            .unwrap()
            .iter()
            .map(|(&t, &(balance, held))| (t, balance - held))
            .collect();
        BatchReport { results, available }
    }

    async fn settle(&self, s: &Settlement) -> Result<SettleOutcome, LedgerError> {
        self.rows.settle(s).await
    }

    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError> {
        self.rows.cancel(request_id).await
    }

    async fn entry(&self, request_id: &str) -> Result<Option<LedgerEntry>, LedgerError> {
        self.rows.entry(request_id).await
    }
}

const TEAM: i64 = 7;

fn reservation(id: usize, team_id: i64, estimate: Microcredits) -> Reservation {
    Reservation {
        request_id: format!("req-{team_id}-{id}"),
        team_id,
        key_id: None,
        model: "m".into(),
        estimated_prompt_tokens: 10,
        max_tokens: 10,
        estimated_cost: estimate,
        price_input_per_mtok: 1,
        price_output_per_mtok: 1,
        bounds: UsageBounds::UNBOUNDED,
    }
}

async fn budgets(ledger: Arc<BankLedger>, config: BudgetConfig) -> TeamBudgets {
    TeamBudgets::start(ledger, Arc::new(SystemClock), config)
        .await
        .unwrap()
}

/// Runs `n` reservations of `estimate` for `team` at once; their answers in order.
async fn stampede(
    budgets: &TeamBudgets,
    team: i64,
    ids: std::ops::Range<usize>,
    estimate: Microcredits,
) -> Vec<Result<(), LedgerError>> {
    let tasks: Vec<_> = ids
        .map(|i| {
            let budgets = budgets.clone();
            tokio::spawn(async move { budgets.reserve(&reservation(i, team, estimate)).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reservations_share_batches() {
    let ledger = BankLedger::with(Duration::from_millis(5), &[(TEAM, 1_000_000)]);
    let budgets = budgets(ledger.clone(), BudgetConfig::default()).await;
    let results = stampede(&budgets, TEAM, 0..200, 10).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let calls = ledger.batches.load(Ordering::SeqCst);
    assert!(
        calls < 200 / 4,
        "200 reservations took {calls} ledger calls"
    );
    assert_eq!(ledger.singles.load(Ordering::SeqCst), 0);
    let stats = budgets.stats(TEAM).await.unwrap();
    assert_eq!(stats.batches, calls as u64);
    assert_eq!(stats.decided, 200);
    assert!(stats.largest_batch > 1);
    assert_eq!(stats.available, Some(1_000_000 - 200 * 10));
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_never_admit_beyond_the_balance() {
    let ledger = BankLedger::with(Duration::from_millis(2), &[(TEAM, 10 * 100), (8, 100)]);
    let budgets = budgets(ledger.clone(), BudgetConfig::default()).await;
    let (ours, theirs) = tokio::join!(
        stampede(&budgets, TEAM, 0..300, 100),
        stampede(&budgets, 8, 0..20, 100)
    );
    let admitted = ours.iter().filter(|r| r.is_ok()).count();
    assert_eq!(admitted, 10);
    assert!(
        ours.iter()
            .all(|r| matches!(r, Ok(()) | Err(LedgerError::InsufficientBalance)))
    );
    assert_eq!(theirs.iter().filter(|r| r.is_ok()).count(), 1);
    assert_eq!(ledger.held(TEAM), 10 * 100);
    assert_eq!(budgets.stats(TEAM).await.unwrap().available, Some(0));
    assert_eq!(budgets.owners().len(), 2, "one actor per team");
    // A duplicate of an admitted one is refused as the ledger refuses it (which ids won the
    // balance depends on the order the spawned tasks reached the actor).
    let taken = ours.iter().position(Result::is_ok).unwrap();
    assert_eq!(
        budgets.reserve(&reservation(taken, TEAM, 0)).await,
        Err(LedgerError::Duplicate)
    );
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_bounded() {
    let ledger = BankLedger::with(Duration::from_millis(5), &[(TEAM, 1_000_000)]);
    let config = BudgetConfig {
        max_batch: 8,
        ..BudgetConfig::default()
    };
    let budgets = budgets(ledger.clone(), config).await;
    let results = stampede(&budgets, TEAM, 0..100, 1).await;
    assert!(results.iter().all(Result::is_ok));
    let stats = budgets.stats(TEAM).await.unwrap();
    assert!(stats.largest_batch <= 8, "{stats:?}");
    assert!(stats.batches >= 100 / 8);
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linger_gathers_one_batch() {
    let ledger = BankLedger::with(Duration::ZERO, &[(TEAM, 1_000_000)]);
    let config = BudgetConfig {
        linger: Duration::from_millis(200),
        ..BudgetConfig::default()
    };
    let budgets = budgets(ledger.clone(), config).await;
    let results = stampede(&budgets, TEAM, 0..20, 1).await;
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(ledger.batches.load(Ordering::SeqCst), 1);
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_batch_answers_every_caller_and_the_next_gets_a_fresh_actor() {
    let ledger = BankLedger::with(Duration::from_millis(50), &[(TEAM, 1_000_000)]);
    let config = BudgetConfig {
        // Far beyond the test's own bound: the answers must come from the crash.
        reply_timeout: Duration::from_secs(60),
        ..BudgetConfig::default()
    };
    let budgets = budgets(ledger.clone(), config).await;
    budgets.reserve(&reservation(0, TEAM, 1)).await.unwrap();
    let before = budgets.owners().get(TEAM).unwrap().get_id();

    ledger.panic_next.store(true, Ordering::SeqCst);
    let results = tokio::time::timeout(Duration::from_secs(5), stampede(&budgets, TEAM, 1..101, 1))
        .await
        .expect("every caller is answered, none hangs");
    let unavailable = results
        .iter()
        .filter(|r| matches!(r, Err(LedgerError::Unavailable(_))))
        .count();
    // The batch that panicked fails closed; reservations that reached the mailbox after
    // the crash went to a fresh actor and were admitted.
    assert!(unavailable >= 1, "{results:?}");
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Ok(()) | Err(LedgerError::Unavailable(_)))),
        "{results:?}"
    );

    budgets.reserve(&reservation(500, TEAM, 1)).await.unwrap();
    let after = budgets.owners().get(TEAM).unwrap().get_id();
    assert_ne!(before, after, "the crashed actor was replaced");
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_actors_retire_and_come_back() {
    let ledger = BankLedger::with(Duration::ZERO, &[(TEAM, 1_000)]);
    let config = BudgetConfig {
        idle_after: Duration::from_millis(50),
        ..BudgetConfig::default()
    };
    let budgets = budgets(ledger.clone(), config).await;
    budgets.reserve(&reservation(0, TEAM, 1)).await.unwrap();
    assert_eq!(budgets.owners().len(), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(budgets.owners().is_empty(), "an idle team actor retired");
    budgets.reserve(&reservation(1, TEAM, 1)).await.unwrap();
    assert_eq!(budgets.owners().len(), 1);
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retiring_under_load_loses_no_reservation() {
    // Retirement checks run every 20 ms while reservations trickle in with gaps around
    // that long: some land on an actor being drained and must still be answered.
    let ledger = BankLedger::with(Duration::from_millis(1), &[(TEAM, 1_000_000)]);
    let config = BudgetConfig {
        idle_after: Duration::from_millis(20),
        ..BudgetConfig::default()
    };
    let budgets = budgets(ledger.clone(), config).await;
    for i in 0..40 {
        let r = budgets.reserve(&reservation(i, TEAM, 1)).await;
        assert_eq!(r, Ok(()), "reservation {i}");
        tokio::time::sleep(Duration::from_millis(if i % 2 == 0 { 45 } else { 1 })).await;
    }
    assert_eq!(ledger.held(TEAM), 40);
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_and_reads_go_to_the_inner_ledger() {
    let ledger = BankLedger::with(Duration::ZERO, &[(TEAM, 1_000)]);
    let budgets = budgets(ledger.clone(), BudgetConfig::default()).await;
    ledger.rows.reserve(&reservation(0, TEAM, 1)).await.unwrap();
    let settlement = Settlement {
        request_id: reservation(0, TEAM, 1).request_id,
        prompt_tokens: 1,
        completion_tokens: 1,
        review: None,
        node_id: None,
    };
    assert_eq!(
        budgets.settle(&settlement).await,
        Ok(SettleOutcome::Applied)
    );
    assert_eq!(
        budgets.cancel(&settlement.request_id).await,
        Ok(SettleOutcome::AlreadyFinal)
    );
    assert!(
        budgets
            .entry(&settlement.request_id)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        budgets.owners().is_empty(),
        "no actor for what is not a reservation"
    );
    budgets.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_budget_supervisor_is_restarted_by_the_root_and_reservations_go_on() {
    use crate::supervision::{RestartPolicy, Spec, Supervision, SupervisionArgs};

    let ledger = BankLedger::with(Duration::ZERO, &[(TEAM, 1_000_000), (8, 1_000)]);
    let (budgets, args) = TeamBudgets::unstarted(
        ledger.clone(),
        Arc::new(SystemClock),
        BudgetConfig::default(),
    );
    let tree = Supervision::start(SupervisionArgs {
        ledger: ledger.clone(),
        queues: Vec::new(),
        queue_policy: RestartPolicy::QUEUES,
        supervisor_policy: RestartPolicy {
            max_restarts: 2,
            window: Duration::from_secs(600),
            backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(10),
        },
        extra: vec![Box::new(Spec::new(
            "team_budgets",
            super::BudgetSupervisor,
            args,
        ))],
    })
    .await
    .unwrap();
    budgets.reserve(&reservation(1, TEAM, 100)).await.unwrap();
    let first = budgets.supervisor_id().unwrap();

    budgets.crash_supervisor();
    // The root restarts it at once (the first restart has no backoff); the new incarnation
    // binds itself where the handle looks.
    let mut restarted = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if budgets.supervisor_id().is_some_and(|id| id != first) {
            restarted = true;
            break;
        }
    }
    assert!(restarted, "the root did not restart the budget supervisor");
    assert!(tree.down().is_empty());
    // The team's reservations go on, and a team new to this replica gets its actor from the
    // new incarnation.
    budgets.reserve(&reservation(2, TEAM, 100)).await.unwrap();
    budgets.reserve(&reservation(3, 8, 100)).await.unwrap();
    tree.stop();
}
