//! Batched reservations ([`Ledger::reserve_batch`]): each row answered in its position with
//! exactly the single-row rule — duplicates (taken before or earlier in the batch), a batch
//! that overflows the balance midway while later, smaller rows still fit, teams mixed in one
//! batch, and concurrent batches that never hold more than the balance.

use futures::future::join_all;

use switchyard_actors::ports::{Ledger, LedgerError, Microcredits, Reservation};

use super::{
    ADMITTED, ESTIMATE, LedgerConformanceError, Outcome, RESERVERS, estimated, expect_eq,
    funded_team, open_within_balance, reservation,
};
use crate::store::{LedgerStatus, Store};

/// How many reservations each batch of [`concurrent_batches_stop_at_the_balance`] holds.
pub const BATCH: usize = 10;

/// A team that does not exist (the suites create theirs from 1 upwards).
const NO_TEAM: i64 = i64::MAX - 7;

/// Runs every batch check a plain [`Ledger`] can take (no balance needed beyond
/// [`super::SUITE_BALANCE`] on `team_id`).
pub async fn batch_ledger_suite(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    empty_batches_answer_nothing(l).await?;
    batch_duplicates_are_refused_in_place(l, team_id, prefix).await
}

/// Runs every batch check that needs balances; it creates its own teams.
pub async fn batch_balance_suite(s: &dyn Store, prefix: &str) -> Outcome {
    batches_overflowing_midway_admit_what_fits(s, prefix).await?;
    batches_mixing_teams_decide_each_team_alone(s, prefix).await?;
    concurrent_batches_stop_at_the_balance(s, prefix).await
}

/// An empty batch answers with no results.
pub async fn empty_batches_answer_nothing(l: &dyn Ledger) -> Outcome {
    expect_eq(
        "empty_batches_answer_nothing",
        l.reserve_batch(&[]).await,
        vec![],
    )
}

/// An id reserved before the batch, and an id repeated inside it, are `Duplicate` in their
/// own position; every other row of the batch is admitted.
pub async fn batch_duplicates_are_refused_in_place(
    l: &dyn Ledger,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "batch_duplicates_are_refused_in_place";
    let id = |n: &str| format!("{prefix}batch-dup-{n}");
    l.reserve(&reservation(&id("before"), team_id)).await?;
    let batch: Vec<Reservation> = ["before", "a", "a", "b", "before"]
        .iter()
        .map(|n| reservation(&id(n), team_id))
        .collect();
    expect_eq(
        CHECK,
        l.reserve_batch(&batch).await,
        vec![
            Err(LedgerError::Duplicate),
            Ok(()),
            Err(LedgerError::Duplicate),
            Ok(()),
            Err(LedgerError::Duplicate),
        ],
    )?;
    // The admitted rows exist and are open: a second reservation of them is a duplicate.
    for n in ["a", "b"] {
        expect_eq(
            CHECK,
            l.reserve(&reservation(&id(n), team_id)).await,
            Err(LedgerError::Duplicate),
        )?;
    }
    Ok(())
}

/// A batch that outgrows the balance midway: the rows before are admitted, the one that
/// does not fit is refused and leaves no row, and later smaller ones still fit — exactly as
/// the same reservations one after the other.
pub async fn batches_overflowing_midway_admit_what_fits(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "batches_overflowing_midway_admit_what_fits";
    let half = ESTIMATE / 2;
    let team = funded_team(s, prefix, "overflow", 2 * ESTIMATE + half).await?;
    let id = |n: usize| format!("{prefix}overflow-{n}");
    let estimates: [Microcredits; 6] = [ESTIMATE, ESTIMATE, ESTIMATE, half, 1, 0];
    let batch: Vec<Reservation> = estimates
        .iter()
        .enumerate()
        .map(|(i, &e)| estimated(&id(i), team, e))
        .collect();
    let results = s.reserve_batch(&batch).await;
    expect_eq(
        CHECK,
        results,
        vec![
            Ok(()),
            Ok(()),
            Err(LedgerError::InsufficientBalance),
            Ok(()),
            Err(LedgerError::InsufficientBalance),
            // A free request fits a full team, as with single reservations.
            Ok(()),
        ],
    )?;
    for (i, admitted) in [true, true, false, true, false, true]
        .into_iter()
        .enumerate()
    {
        expect_eq(
            CHECK,
            (i, s.ledger_row(&id(i)).await?.is_some()),
            (i, admitted),
        )?;
    }
    open_within_balance(s, CHECK, team).await
}

/// One batch over two teams and a missing one: each team's rows are decided against its own
/// balance only, and the missing team's row fails closed (`Unavailable`) without failing the
/// others.
pub async fn batches_mixing_teams_decide_each_team_alone(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "batches_mixing_teams_decide_each_team_alone";
    let rich = funded_team(s, prefix, "mixed-rich", 3 * ESTIMATE).await?;
    let poor = funded_team(s, prefix, "mixed-poor", ESTIMATE).await?;
    let id = |n: &str| format!("{prefix}mixed-{n}");
    let batch = vec![
        estimated(&id("rich-1"), rich, ESTIMATE),
        estimated(&id("poor-1"), poor, ESTIMATE),
        estimated(&id("nobody"), NO_TEAM, 0),
        estimated(&id("poor-2"), poor, ESTIMATE),
        estimated(&id("rich-2"), rich, ESTIMATE),
    ];
    let results = s.reserve_batch(&batch).await;
    let shape: Vec<&str> = results
        .iter()
        .map(|r| match r {
            Ok(()) => "ok",
            Err(LedgerError::Duplicate) => "duplicate",
            Err(LedgerError::InsufficientBalance) => "insufficient",
            Err(LedgerError::Unavailable(_)) => "unavailable",
        })
        .collect();
    expect_eq(
        CHECK,
        shape,
        vec!["ok", "ok", "unavailable", "insufficient", "ok"],
    )?;
    expect_eq(CHECK, s.ledger_row(&id("nobody")).await?.is_none(), true)?;
    open_within_balance(s, CHECK, rich).await?;
    open_within_balance(s, CHECK, poor).await
}

/// [`RESERVERS`] reservations in batches of [`BATCH`], all batches at once, beside as many
/// single reservations, against a balance that covers exactly [`ADMITTED`]: exactly that
/// many are admitted, every other one refused `InsufficientBalance`.
pub async fn concurrent_batches_stop_at_the_balance(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrent_batches_stop_at_the_balance";
    let covered = Microcredits::try_from(ADMITTED).unwrap_or(Microcredits::MAX);
    let team = funded_team(s, prefix, "batch-stampede", covered * ESTIMATE).await?;
    let batched: Vec<Reservation> = (0..RESERVERS)
        .map(|i| estimated(&format!("{prefix}batch-stampede-{i}"), team, ESTIMATE))
        .collect();
    let single: Vec<Reservation> = (0..RESERVERS)
        .map(|i| estimated(&format!("{prefix}single-stampede-{i}"), team, ESTIMATE))
        .collect();
    let batches = join_all(batched.chunks(BATCH).map(|b| s.reserve_batch(b)));
    let singles = join_all(single.iter().map(|r| s.reserve(r)));
    let (batches, singles) = futures::join!(batches, singles);
    let (mut admitted, mut refused) = (0, 0);
    for outcome in batches.into_iter().flatten().chain(singles) {
        match outcome {
            Ok(()) => admitted += 1,
            Err(LedgerError::InsufficientBalance) => refused += 1,
            Err(other) => return Err(LedgerConformanceError::Ledger(other)),
        }
    }
    expect_eq(
        CHECK,
        (admitted, refused),
        (ADMITTED, 2 * RESERVERS - ADMITTED),
    )?;
    let open = s
        .ledger_rows(Some(team))
        .await?
        .iter()
        .filter(|row| row.status == LedgerStatus::Reserved)
        .count();
    expect_eq(CHECK, open, ADMITTED)?;
    open_within_balance(s, CHECK, team).await
}
