//! The contract every [`Ledger`] must meet, as async checks any implementation can run: the
//! actors' in-memory ledger, SQLite and PostgreSQL alike. Compiled in every build so
//! integration tests and other crates can call it.
//!
//! [`ledger_conformance_suite`] opens rows with request ids starting with the caller's
//! `prefix` for the team `team_id`, which must exist where the implementation checks teams
//! and hold at least [`SUITE_BALANCE`]; so does [`bounded_billing_suite`] (bills within a
//! row's bounds, claims and reviews kept), which reads rows back through [`LedgerProbe`].
//! [`balance_conformance_suite`] checks the admission rule (balance minus open reservations
//! must cover the estimate), single and batched, on a [`Store`], which owns balances, and
//! [`drift_conformance_suite`] the drift report's query; they create their own teams, named
//! after `prefix`.

use std::fmt::Debug;

use futures::future::join_all;

use switchyard_actors::ports::{
    Ledger, LedgerError, Microcredits, Reservation, SettleOutcome, Settlement, UsageBounds,
};

use super::{LedgerStatus, Store, StoreError};

mod batch;
mod bounds;
mod drift;
mod node_days;

pub use batch::{
    BATCH, batch_balance_suite, batch_duplicates_are_refused_in_place, batch_ledger_suite,
    batches_mixing_teams_decide_each_team_alone, batches_overflowing_midway_admit_what_fits,
    concurrent_batches_stop_at_the_balance, empty_batches_answer_nothing,
};
pub use bounds::{
    BilledRow, FIVE_TOKENS, LedgerProbe, bounded, bounded_billing_suite, expected_row,
    huge_claims_settle_at_the_bounds, in_bound_claims_mark_nothing,
    over_bound_claims_bill_the_bound, requested_reviews_are_stored, unbounded_rows_bill_the_claim,
};
pub use drift::{
    drift_conformance_suite, drift_reviewed_rows_are_capped, drift_totals_and_reviewed_rows,
};
pub use node_days::{
    node_day_ledger_sums_settles_by_node, node_days_add_up_per_node_day_and_model,
    node_days_conformance_suite, node_pools_are_checked,
};

/// How a ledger conformance check failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerConformanceError {
    /// The implementation returned an error where the contract expects success.
    #[error("ledger error: {0}")]
    Ledger(#[from] LedgerError),
    /// A store call the check needs (creating teams, crediting, reading rows) failed.
    #[error("store error: {0}")]
    Store(#[from] StoreError),
    /// The implementation answered, but not as the contract says.
    #[error("{check}: {detail}")]
    Violated {
        /// Which property was broken.
        check: &'static str,
        /// What was observed.
        detail: String,
    },
}

type Outcome = Result<(), LedgerConformanceError>;

/// How many settles and cancels race for one row in [`concurrent_finishes_apply_once`].
pub const RACERS: usize = 50;
/// What the team given to [`ledger_conformance_suite`] must hold at least: its reservations
/// are admitted only while the balance covers them, and its settles are debited.
pub const SUITE_BALANCE: Microcredits = 1_000_000;
/// How many reservations race for a balance that covers [`ADMITTED`] of them in
/// [`concurrent_reserves_stop_at_the_balance`].
pub const RESERVERS: usize = 200;
/// How many estimates the balance covers in [`concurrent_reserves_stop_at_the_balance`].
pub const ADMITTED: usize = 10;
/// The estimate of every reservation in the balance checks.
pub const ESTIMATE: Microcredits = 1_000;

/// Runs every ledger check in turn, stopping at the first failure.
pub async fn ledger_conformance_suite(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    settle_applies_once(l, team_id, prefix).await?;
    cancel_applies_once(l, team_id, prefix).await?;
    unknown_rows(l, prefix).await?;
    duplicate_reservations(l, team_id, prefix).await?;
    concurrent_finishes_apply_once(l, team_id, prefix).await?;
    batch_ledger_suite(l, team_id, prefix).await?;
    Ok(())
}

/// Runs every balance check in turn, stopping at the first failure.
pub async fn balance_conformance_suite(s: &dyn Store, prefix: &str) -> Outcome {
    concurrent_reserves_stop_at_the_balance(s, prefix).await?;
    finishing_and_crediting_free_room(s, prefix).await?;
    duplicates_are_refused_before_the_balance(s, prefix).await?;
    batch_balance_suite(s, prefix).await?;
    Ok(())
}

fn expect_eq<T: PartialEq + Debug>(check: &'static str, got: T, want: T) -> Outcome {
    if got == want {
        Ok(())
    } else {
        Err(LedgerConformanceError::Violated {
            check,
            detail: format!("got {got:?}, want {want:?}"),
        })
    }
}

/// A reservation for `request_id` at 1 credit per million input tokens and 2 per million
/// output tokens.
pub fn reservation(request_id: &str, team_id: i64) -> Reservation {
    Reservation {
        request_id: request_id.to_owned(),
        team_id,
        key_id: None,
        model: "conformance-model".to_owned(),
        estimated_prompt_tokens: 100,
        max_tokens: 200,
        estimated_cost: 1,
        price_input_per_mtok: 1_000_000,
        price_output_per_mtok: 2_000_000,
        bounds: UsageBounds::UNBOUNDED,
    }
}

/// A settlement of `request_id` with the given usage.
pub fn settlement(request_id: &str, prompt_tokens: u64, completion_tokens: u64) -> Settlement {
    Settlement {
        request_id: request_id.to_owned(),
        prompt_tokens,
        completion_tokens,
        review: None,
        node_id: None,
    }
}

/// A settle applies once; a retried settle, and a cancel after it, change nothing.
pub async fn settle_applies_once(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    const CHECK: &str = "settle_applies_once";
    let id = format!("{prefix}settle-once");
    l.reserve(&reservation(&id, team_id)).await?;
    expect_eq(
        CHECK,
        l.settle(&settlement(&id, 10, 20)).await?,
        SettleOutcome::Applied,
    )?;
    expect_eq(
        CHECK,
        l.settle(&settlement(&id, 10, 20)).await?,
        SettleOutcome::AlreadyFinal,
    )?;
    // A retry carrying other numbers is still a no-op.
    expect_eq(
        CHECK,
        l.settle(&settlement(&id, 99, 99)).await?,
        SettleOutcome::AlreadyFinal,
    )?;
    expect_eq(CHECK, l.cancel(&id).await?, SettleOutcome::AlreadyFinal)?;
    Ok(())
}

/// A cancel applies once; a settle after it changes nothing.
pub async fn cancel_applies_once(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    const CHECK: &str = "cancel_applies_once";
    let id = format!("{prefix}cancel-once");
    l.reserve(&reservation(&id, team_id)).await?;
    expect_eq(CHECK, l.cancel(&id).await?, SettleOutcome::Applied)?;
    expect_eq(CHECK, l.cancel(&id).await?, SettleOutcome::AlreadyFinal)?;
    expect_eq(
        CHECK,
        l.settle(&settlement(&id, 1, 1)).await?,
        SettleOutcome::AlreadyFinal,
    )?;
    Ok(())
}

/// Settling or cancelling a request that never reserved reports `Unknown`.
pub async fn unknown_rows(l: &dyn Ledger, prefix: &str) -> Outcome {
    const CHECK: &str = "unknown_rows";
    let id = format!("{prefix}never-reserved");
    expect_eq(
        CHECK,
        l.settle(&settlement(&id, 1, 1)).await?,
        SettleOutcome::Unknown,
    )?;
    expect_eq(CHECK, l.cancel(&id).await?, SettleOutcome::Unknown)?;
    Ok(())
}

/// A request id reserves once, whether its row is open or final.
pub async fn duplicate_reservations(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    const CHECK: &str = "duplicate_reservations";
    let id = format!("{prefix}duplicate");
    l.reserve(&reservation(&id, team_id)).await?;
    expect_eq(
        CHECK,
        l.reserve(&reservation(&id, team_id)).await,
        Err(LedgerError::Duplicate),
    )?;
    l.cancel(&id).await?;
    expect_eq(
        CHECK,
        l.reserve(&reservation(&id, team_id)).await,
        Err(LedgerError::Duplicate),
    )?;
    Ok(())
}

/// [`RACERS`] settles and as many cancels of one row, all at once: exactly one applies.
pub async fn concurrent_finishes_apply_once(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrent_finishes_apply_once";
    let id = format!("{prefix}race");
    l.reserve(&reservation(&id, team_id)).await?;
    let settle = settlement(&id, 5, 5);
    let settles = join_all((0..RACERS).map(|_| l.settle(&settle)));
    let cancels = join_all((0..RACERS).map(|_| l.cancel(&id)));
    let (settles, cancels) = futures::join!(settles, cancels);
    let mut applied = 0;
    for outcome in settles.into_iter().chain(cancels) {
        match outcome? {
            SettleOutcome::Applied => applied += 1,
            SettleOutcome::AlreadyFinal => {}
            SettleOutcome::Unknown => {
                return Err(LedgerConformanceError::Violated {
                    check: CHECK,
                    detail: "a reserved row was reported unknown".to_owned(),
                });
            }
        }
    }
    expect_eq(CHECK, applied, 1)
}

/// A team named `{prefix}{name}` holding `balance`.
async fn funded_team(
    s: &dyn Store,
    prefix: &str,
    name: &str,
    balance: Microcredits,
) -> Result<i64, LedgerConformanceError> {
    let team = s.create_team(&format!("{prefix}{name}")).await?;
    if balance != 0 {
        s.add_credits(team.id, balance, "conformance").await?;
    }
    Ok(team.id)
}

/// A reservation for `request_id` holding `estimate`.
fn estimated(request_id: &str, team_id: i64, estimate: Microcredits) -> Reservation {
    Reservation {
        estimated_cost: estimate,
        ..reservation(request_id, team_id)
    }
}

/// The invariant: a team's open reservations never hold more than its balance.
async fn open_within_balance(s: &dyn Store, check: &'static str, team_id: i64) -> Outcome {
    let held: i128 = s
        .ledger_rows(Some(team_id))
        .await?
        .iter()
        .filter(|row| row.status == LedgerStatus::Reserved)
        .map(|row| i128::from(row.estimated_cost_microcredits))
        .sum();
    let balance = s
        .team(team_id)
        .await?
        .ok_or(LedgerConformanceError::Violated {
            check,
            detail: format!("team {team_id} vanished"),
        })?
        .balance_microcredits;
    if held > i128::from(balance) {
        return Err(LedgerConformanceError::Violated {
            check,
            detail: format!("open reservations hold {held}, the balance is {balance}"),
        });
    }
    Ok(())
}

/// Expects a refused reservation: `InsufficientBalance`, and no row left behind.
async fn refused(s: &dyn Store, check: &'static str, r: &Reservation) -> Outcome {
    expect_eq(
        check,
        s.reserve(r).await,
        Err(LedgerError::InsufficientBalance),
    )?;
    expect_eq(check, s.ledger_row(&r.request_id).await?.is_none(), true)
}

/// [`RESERVERS`] reservations at once against a balance that covers exactly [`ADMITTED`]:
/// exactly that many are admitted, the rest refused with `InsufficientBalance`; another
/// team's reservations are unaffected.
pub async fn concurrent_reserves_stop_at_the_balance(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrent_reserves_stop_at_the_balance";
    let covered = Microcredits::try_from(ADMITTED).unwrap_or(Microcredits::MAX);
    let team = funded_team(s, prefix, "stampede", covered * ESTIMATE).await?;
    let bystander = funded_team(s, prefix, "bystander", ESTIMATE).await?;
    let reservations: Vec<_> = (0..RESERVERS)
        .map(|i| estimated(&format!("{prefix}stampede-{i}"), team, ESTIMATE))
        .collect();
    let outcomes = join_all(reservations.iter().map(|r| s.reserve(r))).await;
    let (mut admitted, mut refused_count) = (0, 0);
    for outcome in outcomes {
        match outcome {
            Ok(()) => admitted += 1,
            Err(LedgerError::InsufficientBalance) => refused_count += 1,
            Err(other) => return Err(other.into()),
        }
    }
    expect_eq(
        CHECK,
        (admitted, refused_count),
        (ADMITTED, RESERVERS - ADMITTED),
    )?;
    open_within_balance(s, CHECK, team).await?;
    let open = s
        .ledger_rows(Some(team))
        .await?
        .iter()
        .filter(|row| row.status == LedgerStatus::Reserved)
        .count();
    expect_eq(CHECK, open, ADMITTED)?;
    // A full team holds nothing against another team's balance.
    s.reserve(&estimated(
        &format!("{prefix}bystander"),
        bystander,
        ESTIMATE,
    ))
    .await?;
    Ok(())
}

/// A full team gets room back as its reservations finish or credits arrive: a cancel frees
/// the estimate, a settle frees the estimate and debits the cost, a credit adds its amount.
pub async fn finishing_and_crediting_free_room(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "finishing_and_crediting_free_room";
    let team = funded_team(s, prefix, "room", 3 * ESTIMATE).await?;
    let id = |name: &str| format!("{prefix}room-{name}");
    for name in ["a", "b", "c"] {
        s.reserve(&estimated(&id(name), team, ESTIMATE)).await?;
    }
    refused(s, CHECK, &estimated(&id("d"), team, ESTIMATE)).await?;
    // Room for exactly what is left, nothing more: a free request still fits.
    s.reserve(&estimated(&id("free"), team, 0)).await?;

    expect_eq(CHECK, s.cancel(&id("a")).await?, SettleOutcome::Applied)?;
    s.reserve(&estimated(&id("d"), team, ESTIMATE)).await?;
    refused(s, CHECK, &estimated(&id("e"), team, ESTIMATE)).await?;

    // Settled at no cost: the estimate is released and nothing is debited.
    expect_eq(
        CHECK,
        s.settle(&settlement(&id("b"), 0, 0)).await?,
        SettleOutcome::Applied,
    )?;
    s.reserve(&estimated(&id("e"), team, ESTIMATE)).await?;

    // Settled at half an estimate (1 microcredit per prompt token at the suite's prices):
    // half an estimate of room comes back.
    let half = ESTIMATE / 2;
    let half_tokens = u64::try_from(half).unwrap_or(0);
    expect_eq(
        CHECK,
        s.settle(&settlement(&id("c"), half_tokens, 0)).await?,
        SettleOutcome::Applied,
    )?;
    refused(s, CHECK, &estimated(&id("f"), team, ESTIMATE)).await?;
    s.reserve(&estimated(&id("f"), team, half)).await?;
    refused(s, CHECK, &estimated(&id("g"), team, 1)).await?;

    s.add_credits(team, ESTIMATE, "top-up").await?;
    s.reserve(&estimated(&id("g"), team, ESTIMATE)).await?;
    refused(s, CHECK, &estimated(&id("h"), team, 1)).await?;
    open_within_balance(s, CHECK, team).await
}

/// A retried reservation is `Duplicate` even when the balance is spent (by itself, typically):
/// the caller learns its row exists rather than that it cannot pay.
pub async fn duplicates_are_refused_before_the_balance(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "duplicates_are_refused_before_the_balance";
    let team = funded_team(s, prefix, "retry", ESTIMATE).await?;
    let r = estimated(&format!("{prefix}retry"), team, ESTIMATE);
    s.reserve(&r).await?;
    expect_eq(CHECK, s.reserve(&r).await, Err(LedgerError::Duplicate))?;
    refused(
        s,
        CHECK,
        &estimated(&format!("{prefix}retry-2"), team, ESTIMATE),
    )
    .await
}
