//! The contract every [`Ledger`] must meet, as async checks any implementation can run: the
//! actors' in-memory ledger, SQLite and PostgreSQL alike. Compiled in every build so
//! integration tests and other crates can call it.
//!
//! Each check opens rows with request ids starting with the caller's `prefix` for the team
//! `team_id`, which must exist where the implementation checks teams.

use std::fmt::Debug;

use futures::future::join_all;

use switchyard_actors::ports::{Ledger, LedgerError, Reservation, SettleOutcome, Settlement};

/// How a ledger conformance check failed.
#[derive(Debug, thiserror::Error)]
pub enum LedgerConformanceError {
    /// The implementation returned an error where the contract expects success.
    #[error("ledger error: {0}")]
    Ledger(#[from] LedgerError),
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

/// Runs every check in turn, stopping at the first failure.
pub async fn ledger_conformance_suite(l: &dyn Ledger, team_id: i64, prefix: &str) -> Outcome {
    settle_applies_once(l, team_id, prefix).await?;
    cancel_applies_once(l, team_id, prefix).await?;
    unknown_rows(l, prefix).await?;
    duplicate_reservations(l, team_id, prefix).await?;
    concurrent_finishes_apply_once(l, team_id, prefix).await?;
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
    }
}

/// A settlement of `request_id` with the given usage.
pub fn settlement(request_id: &str, prompt_tokens: u64, completion_tokens: u64) -> Settlement {
    Settlement {
        request_id: request_id.to_owned(),
        prompt_tokens,
        completion_tokens,
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
