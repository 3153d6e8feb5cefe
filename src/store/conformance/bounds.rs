//! Bounded billing (issue 10): a node's report is a claim, billed within the row's
//! [`UsageBounds`] by [`UsageBounds::bill`]. A claim beyond the bounds, however large, settles
//! at the bounds (never an error, never a row left reserved), keeps the claim and marks the
//! row for review; a claim within them marks nothing; a review the caller asks for is stored.
//!
//! The checks read rows back through [`LedgerProbe`], which the in-memory reference and every
//! [`Store`] implement, so one contract holds all three ledgers.

use async_trait::async_trait;

use switchyard_actors::ports::memory::{MemoryLedger, RowStatus};
use switchyard_actors::ports::{
    Ledger, MAX_TOKEN_COUNT, Microcredits, Reservation, ReviewReason, SettleOutcome, Settlement,
    UsageBounds, cost_of,
};

use super::{LedgerConformanceError, Outcome, expect_eq, reservation};
use crate::store::{LedgerStatus, Store};

/// A settled (or open, or cancelled) row as the bounded-billing checks compare it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BilledRow {
    /// Where the row stands.
    pub status: LedgerStatus,
    /// Prompt tokens billed.
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// Cost debited.
    pub cost: Microcredits,
    /// The clamped claim, as a ledger can store it: each count at most [`MAX_TOKEN_COUNT`].
    pub claimed: Option<(u64, u64)>,
    /// Why the row is under review.
    pub review: Option<ReviewReason>,
}

/// Reads back what a ledger did with a settle.
#[async_trait]
pub trait LedgerProbe: Ledger {
    /// The row of `request_id`, if any.
    async fn billed_row(
        &self,
        request_id: &str,
    ) -> Result<Option<BilledRow>, LedgerConformanceError>;
    /// The team's balance, where the ledger keeps balances (the in-memory one does not).
    async fn balance(&self, team_id: i64) -> Result<Option<Microcredits>, LedgerConformanceError>;
}

fn count(check: &'static str, v: i64) -> Result<u64, LedgerConformanceError> {
    u64::try_from(v).map_err(|_| LedgerConformanceError::Violated {
        check,
        detail: format!("a stored count is negative: {v}"),
    })
}

#[async_trait]
impl<S: Store + ?Sized> LedgerProbe for S {
    async fn billed_row(
        &self,
        request_id: &str,
    ) -> Result<Option<BilledRow>, LedgerConformanceError> {
        const CHECK: &str = "billed_row";
        let Some(row) = self.ledger_row(request_id).await? else {
            return Ok(None);
        };
        let claimed = match (row.claimed_prompt_tokens, row.claimed_completion_tokens) {
            (Some(p), Some(c)) => Some((count(CHECK, p)?, count(CHECK, c)?)),
            (None, None) => None,
            other => {
                return Err(LedgerConformanceError::Violated {
                    check: CHECK,
                    detail: format!("half a claim: {other:?}"),
                });
            }
        };
        Ok(Some(BilledRow {
            status: row.status,
            prompt_tokens: count(CHECK, row.prompt_tokens)?,
            completion_tokens: count(CHECK, row.completion_tokens)?,
            cost: row.cost_microcredits,
            claimed,
            review: row.review,
        }))
    }

    async fn balance(&self, team_id: i64) -> Result<Option<Microcredits>, LedgerConformanceError> {
        Ok(self.team(team_id).await?.map(|t| t.balance_microcredits))
    }
}

#[async_trait]
impl LedgerProbe for MemoryLedger {
    async fn billed_row(
        &self,
        request_id: &str,
    ) -> Result<Option<BilledRow>, LedgerConformanceError> {
        Ok(self.row(request_id).map(|row| BilledRow {
            status: match row.status {
                RowStatus::Reserved => LedgerStatus::Reserved,
                RowStatus::Settled => LedgerStatus::Settled,
                RowStatus::Cancelled => LedgerStatus::Cancelled,
            },
            prompt_tokens: row.prompt_tokens,
            completion_tokens: row.completion_tokens,
            cost: row.cost,
            // The reference keeps a claim as reported; an SQL ledger keeps it within i64.
            claimed: row
                .claimed
                .map(|(p, c)| (p.min(MAX_TOKEN_COUNT), c.min(MAX_TOKEN_COUNT))),
            review: row.review,
        }))
    }

    async fn balance(&self, _team_id: i64) -> Result<Option<Microcredits>, LedgerConformanceError> {
        Ok(None)
    }
}

/// Runs every bounded-billing check in turn, stopping at the first failure. Same conventions
/// as [`super::ledger_conformance_suite`]: rows `{prefix}…` for `team_id`, which must hold at
/// least [`super::SUITE_BALANCE`] where the ledger checks balances (the checks debit a few
/// hundred microcredits).
pub async fn bounded_billing_suite<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    over_bound_claims_bill_the_bound(l, team_id, prefix).await?;
    huge_claims_settle_at_the_bounds(l, team_id, prefix).await?;
    in_bound_claims_mark_nothing(l, team_id, prefix).await?;
    requested_reviews_are_stored(l, team_id, prefix).await?;
    unbounded_rows_bill_the_claim(l, team_id, prefix).await?;
    Ok(())
}

/// The bounds of a `max_tokens: 5` request whose prompt the gateway counted within 100.
pub const FIVE_TOKENS: UsageBounds = UsageBounds {
    prompt_tokens: 100,
    completion_tokens: 5,
};

/// [`reservation`] with `bounds`.
pub fn bounded(request_id: &str, team_id: i64, bounds: UsageBounds) -> Reservation {
    Reservation {
        max_tokens: bounds.completion_tokens,
        bounds,
        ..reservation(request_id, team_id)
    }
}

/// What a settle of `claim` must leave in a row reserved as `r`: [`UsageBounds::bill`],
/// priced with the row's prices.
pub fn expected_row(r: &Reservation, s: &Settlement) -> BilledRow {
    let billed = r.bounds.bill(s.prompt_tokens, s.completion_tokens);
    BilledRow {
        status: LedgerStatus::Settled,
        prompt_tokens: billed.prompt_tokens,
        completion_tokens: billed.completion_tokens,
        cost: cost_of(
            billed.prompt_tokens,
            billed.completion_tokens,
            r.price_input_per_mtok,
            r.price_output_per_mtok,
        ),
        claimed: billed.clamped.then_some((
            s.prompt_tokens.min(MAX_TOKEN_COUNT),
            s.completion_tokens.min(MAX_TOKEN_COUNT),
        )),
        review: s
            .review
            .or(billed.clamped.then_some(ReviewReason::UsageOverBound)),
    }
}

/// Reserves `r`, settles it with `s` (which must apply, whatever its counts) and checks the
/// row against [`expected_row`] and the team's balance against the row's cost. A retried
/// settle then changes nothing. Returns the row.
async fn settle_and_check<L: LedgerProbe + ?Sized>(
    l: &L,
    check: &'static str,
    r: &Reservation,
    s: &Settlement,
) -> Result<BilledRow, LedgerConformanceError> {
    l.reserve(r).await?;
    let before = l.balance(r.team_id).await?;
    expect_eq(check, l.settle(s).await?, SettleOutcome::Applied)?;
    let want = expected_row(r, s);
    let got = l
        .billed_row(&r.request_id)
        .await?
        .ok_or(LedgerConformanceError::Violated {
            check,
            detail: format!("{} vanished", r.request_id),
        })?;
    expect_eq(check, &got, &want)?;
    if let Some(before) = before {
        // balance = credits - settled cost: the debit is exactly the bill's price.
        expect_eq(check, l.balance(r.team_id).await?, Some(before - want.cost))?;
    }
    expect_eq(check, l.settle(s).await?, SettleOutcome::AlreadyFinal)?;
    expect_eq(check, l.billed_row(&r.request_id).await?, Some(got.clone()))?;
    Ok(got)
}

/// A `max_tokens: 5` request whose node claims 100,000 completion tokens bills 5, keeps the
/// claim and is marked `usage_over_bound`.
pub async fn over_bound_claims_bill_the_bound<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "over_bound_claims_bill_the_bound";
    let id = format!("{prefix}bound-five");
    let r = bounded(&id, team_id, FIVE_TOKENS);
    let s = Settlement {
        request_id: id,
        prompt_tokens: 30,
        completion_tokens: 100_000,
        review: None,
        node_id: None,
    };
    let row = settle_and_check(l, CHECK, &r, &s).await?;
    expect_eq(
        CHECK,
        (row.prompt_tokens, row.completion_tokens, row.claimed),
        (30, 5, Some((30, 100_000))),
    )?;
    expect_eq(CHECK, row.review, Some(ReviewReason::UsageOverBound))?;
    // The prompt alone over its bound is clamped the same way.
    let id = format!("{prefix}bound-prompt");
    let r = bounded(&id, team_id, FIVE_TOKENS);
    let s = Settlement {
        request_id: id,
        prompt_tokens: 101,
        completion_tokens: 0,
        review: None,
        node_id: None,
    };
    let row = settle_and_check(l, CHECK, &r, &s).await?;
    expect_eq(
        CHECK,
        (row.prompt_tokens, row.claimed),
        (100, Some((101, 0))),
    )
}

/// Claims of 2^62 and of u64::MAX (which no ledger can store) settle at the bounds: the
/// settle applies, the row is final, and the team pays exactly the bounds' price.
pub async fn huge_claims_settle_at_the_bounds<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "huge_claims_settle_at_the_bounds";
    let cases = [
        ("2^62", 1 << 62, 1 << 62),
        ("max", u64::MAX, u64::MAX),
        ("max-completion", 7, u64::MAX),
        ("max-prompt", u64::MAX, 0),
    ];
    for (name, prompt, completion) in cases {
        let id = format!("{prefix}huge-{name}");
        let r = bounded(&id, team_id, FIVE_TOKENS);
        let s = Settlement {
            request_id: id,
            prompt_tokens: prompt,
            completion_tokens: completion,
            review: None,
            node_id: None,
        };
        let row = settle_and_check(l, CHECK, &r, &s).await?;
        expect_eq(CHECK, row.status, LedgerStatus::Settled)?;
        let (billed_prompt, billed_completion) = (
            prompt.min(FIVE_TOKENS.prompt_tokens),
            completion.min(FIVE_TOKENS.completion_tokens),
        );
        expect_eq(
            CHECK,
            (row.prompt_tokens, row.completion_tokens),
            (billed_prompt, billed_completion),
        )?;
        expect_eq(
            CHECK,
            row.cost,
            cost_of(
                billed_prompt,
                billed_completion,
                r.price_input_per_mtok,
                r.price_output_per_mtok,
            ),
        )?;
        expect_eq(CHECK, row.review, Some(ReviewReason::UsageOverBound))?;
    }
    Ok(())
}

/// A claim within the bounds (up to them exactly) bills as claimed and marks nothing.
pub async fn in_bound_claims_mark_nothing<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "in_bound_claims_mark_nothing";
    for (name, prompt, completion) in [("zero", 0, 0), ("some", 42, 3), ("edge", 100, 5)] {
        let id = format!("{prefix}within-{name}");
        let r = bounded(&id, team_id, FIVE_TOKENS);
        let s = Settlement {
            request_id: id,
            prompt_tokens: prompt,
            completion_tokens: completion,
            review: None,
            node_id: None,
        };
        let row = settle_and_check(l, CHECK, &r, &s).await?;
        expect_eq(
            CHECK,
            (row.prompt_tokens, row.completion_tokens),
            (prompt, completion),
        )?;
        expect_eq(CHECK, (row.claimed, row.review), (None, None))?;
    }
    Ok(())
}

/// A settlement's own review is stored whatever the counts: alone for a claim within the
/// bounds, and in place of `usage_over_bound` (the claim still kept) for one beyond them.
pub async fn requested_reviews_are_stored<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "requested_reviews_are_stored";
    for (name, completion, clamped) in [("within", 4, false), ("beyond", 9, true)] {
        let id = format!("{prefix}unverified-{name}");
        let r = bounded(&id, team_id, FIVE_TOKENS);
        let s = Settlement {
            request_id: id,
            prompt_tokens: 10,
            completion_tokens: completion,
            review: Some(ReviewReason::UnverifiedNode),
            node_id: None,
        };
        let row = settle_and_check(l, CHECK, &r, &s).await?;
        expect_eq(CHECK, row.review, Some(ReviewReason::UnverifiedNode))?;
        expect_eq(CHECK, row.claimed.is_some(), clamped)?;
    }
    let id = format!("{prefix}unrepresentable");
    let r = bounded(&id, team_id, FIVE_TOKENS);
    let s = Settlement {
        request_id: id,
        prompt_tokens: u64::MAX,
        completion_tokens: 1,
        review: Some(ReviewReason::UsageUnrepresentable),
        node_id: None,
    };
    let row = settle_and_check(l, CHECK, &r, &s).await?;
    expect_eq(CHECK, row.review, Some(ReviewReason::UsageUnrepresentable))
}

/// A row without bounds ([`UsageBounds::UNBOUNDED`], as admitted before bounds existed)
/// bills what was claimed, as before; only a claim beyond the ledger's range is clamped (to
/// it) and marked.
pub async fn unbounded_rows_bill_the_claim<L: LedgerProbe + ?Sized>(
    l: &L,
    team_id: i64,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "unbounded_rows_bill_the_claim";
    let id = format!("{prefix}unbounded");
    let r = reservation(&id, team_id);
    let row = settle_and_check(l, CHECK, &r, &super::settlement(&id, 1_234, 567)).await?;
    expect_eq(
        CHECK,
        (
            row.prompt_tokens,
            row.completion_tokens,
            row.claimed,
            row.review,
        ),
        (1_234, 567, None, None),
    )?;
    // Free, so the suite's balance survives billing the whole range.
    for (name, prompt, completion) in [("2^62", 1 << 62, 1 << 62), ("max", u64::MAX, 3)] {
        let id = format!("{prefix}unbounded-{name}");
        let r = Reservation {
            price_input_per_mtok: 0,
            price_output_per_mtok: 0,
            ..reservation(&id, team_id)
        };
        let row =
            settle_and_check(l, CHECK, &r, &super::settlement(&id, prompt, completion)).await?;
        expect_eq(
            CHECK,
            (row.prompt_tokens, row.completion_tokens),
            (prompt.min(MAX_TOKEN_COUNT), completion),
        )?;
    }
    Ok(())
}
