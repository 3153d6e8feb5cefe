//! [`TeamBudgets`] over a real PostgreSQL with a scarce pool (5 connections): a stampede of
//! 2,000 reservations for one team is answered in full — admitted or refused for the
//! balance, never `Unavailable` — the open reservations never exceed the balance, and once
//! the admitted ones settle, the balance is the credits minus the settled costs. Prints the
//! admissions per second through the team's actor and, for comparison, through plain
//! `reserve` on the same pool (run with `--nocapture` to see them).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[allow(dead_code)]
#[path = "store/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use switchyard::store::conformance::{reservation, settlement};
use switchyard::store::{Ledger, LedgerError, LedgerStatus, PostgresStore, Store, cost_of};
use switchyard_actors::budget::{BudgetConfig, TeamBudgets};
use switchyard_actors::ports::SystemClock;

use harness::{Backend, Db};

/// Reservations in the stampede.
const STAMPEDE: usize = 2_000;
/// The estimate of each.
const ESTIMATE: i64 = 1_000;
/// The balance covers this many of them.
const COVERED: usize = 1_200;
/// Connections in the pool under test.
const POOL: u32 = 5;

/// What one stampede did.
#[derive(Debug)]
struct Run {
    admitted: Vec<String>,
    refused: usize,
    unavailable: usize,
    per_second: f64,
}

/// Fires `STAMPEDE` reservations of `ESTIMATE` for `team` at once through `ledger`.
async fn stampede(ledger: Arc<dyn Ledger>, team: i64, prefix: &str) -> Run {
    let started = Instant::now();
    let tasks: Vec<_> = (0..STAMPEDE)
        .map(|i| {
            let ledger = ledger.clone();
            let mut r = reservation(&format!("{prefix}-{i}"), team);
            r.estimated_cost = ESTIMATE;
            tokio::spawn(async move { (r.request_id.clone(), ledger.reserve(&r).await) })
        })
        .collect();
    let mut run = Run {
        admitted: Vec::new(),
        refused: 0,
        unavailable: 0,
        per_second: 0.0,
    };
    for task in tasks {
        match task.await.unwrap() {
            (id, Ok(())) => run.admitted.push(id),
            (_, Err(LedgerError::InsufficientBalance)) => run.refused += 1,
            (_, Err(LedgerError::Unavailable(_))) => run.unavailable += 1,
            (id, Err(e)) => panic!("{id}: {e}"),
        }
    }
    run.per_second = STAMPEDE as f64 / started.elapsed().as_secs_f64();
    run
}

async fn funded(store: &dyn Store, name: &str, balance: i64) -> i64 {
    let team = store.create_team(name).await.unwrap();
    store.add_credits(team.id, balance, "start").await.unwrap();
    team.id
}

/// The open reservations of `team` and what they hold.
async fn open(store: &dyn Store, team: i64) -> (usize, i64) {
    let rows = store.ledger_rows(Some(team)).await.unwrap();
    let open: Vec<_> = rows
        .iter()
        .filter(|r| r.status == LedgerStatus::Reserved)
        .collect();
    (
        open.len(),
        open.iter().map(|r| r.estimated_cost_microcredits).sum(),
    )
}

/// One stampede through `TeamBudgets` with `config`: every reservation answered, exactly
/// the covered ones admitted, then settled with a balance that adds up.
async fn through_team_budgets(store: &PostgresStore, name: &str, config: BudgetConfig) -> f64 {
    let credits = ESTIMATE * COVERED as i64;
    let team = funded(store, name, credits).await;
    let inner: Arc<dyn Ledger> = Arc::new(store.clone());
    let budgets = Arc::new(
        TeamBudgets::start(inner, Arc::new(SystemClock), config)
            .await
            .unwrap(),
    );
    let run = stampede(budgets.clone(), team, name).await;
    assert_eq!(
        run.unavailable, 0,
        "{name}: none refused for a busy database"
    );
    assert_eq!(
        (run.admitted.len(), run.refused),
        (COVERED, STAMPEDE - COVERED),
        "{name}: exactly what the balance covers is admitted"
    );
    let (count, held) = open(store, team).await;
    assert_eq!(count, COVERED);
    assert!(
        held <= credits,
        "{name}: open reservations hold {held} of {credits}"
    );
    let stats = budgets.stats(team).await.unwrap();
    assert_eq!(stats.available, Some(credits - held));
    eprintln!(
        "{name}: {:.0} admissions/s through TeamBudgets ({} batches, largest {})",
        run.per_second, stats.batches, stats.largest_batch
    );

    // Settle them all (a few at a time: settles still take the team's row lock one by one)
    // at 100 prompt tokens and 50 completion tokens each.
    let settled: Vec<_> = futures::stream::iter(run.admitted.iter())
        .map(|id| {
            let budgets = budgets.clone();
            async move { budgets.settle(&settlement(id, 100, 50)).await }
        })
        .buffer_unordered(POOL as usize)
        .collect()
        .await;
    assert!(settled.iter().all(Result::is_ok), "{settled:?}");
    let cost = cost_of(100, 50, 1_000_000, 2_000_000) * COVERED as i64;
    let balance = store
        .team(team)
        .await
        .unwrap()
        .unwrap()
        .balance_microcredits;
    assert_eq!(
        balance,
        credits - cost,
        "{name}: balance = credits - settled cost"
    );
    assert_eq!(open(store, team).await, (0, 0));
    budgets.stop();
    run.per_second
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_reservations_for_one_team_through_team_budgets() {
    let db = Db::new(Backend::Postgres, "budget_stampede").await;
    let store = PostgresStore::connect_with_pool(db.url(), POOL)
        .await
        .unwrap();

    let natural = through_team_budgets(&store, "natural", BudgetConfig::default()).await;
    let lingering = through_team_budgets(
        &store,
        "linger-1ms",
        BudgetConfig {
            linger: Duration::from_millis(1),
            ..BudgetConfig::default()
        },
    )
    .await;

    // The same stampede on plain `reserve` and the same pool: every reservation queues for
    // a connection, then for the team's row lock. Measured, not asserted on (how many time
    // out depends on the machine).
    let team = funded(&store, "plain", ESTIMATE * COVERED as i64).await;
    let plain = stampede(Arc::new(store.clone()), team, "plain").await;
    let (_, held) = open(&store, team).await;
    assert!(held <= ESTIMATE * COVERED as i64);
    eprintln!(
        "plain reserve: {:.0} answers/s, {} admitted, {} refused, {} unavailable",
        plain.per_second,
        plain.admitted.len(),
        plain.refused,
        plain.unavailable
    );
    eprintln!("TeamBudgets: natural batching {natural:.0}/s, 1 ms linger {lingering:.0}/s");
}
