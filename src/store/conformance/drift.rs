//! The drift report's query ([`Store::drift_report`]) on a [`Store`]: per-model totals of
//! settled rows in a range, rows under review by reason with their claims against their
//! bills (exact past i64), the reviewed rows newest first and cut at
//! [`DRIFT_REVIEWED_LIMIT`], and nothing outside the range. Works on models named after the
//! caller's prefix, so other rows in the store do not disturb it.

use chrono::{DateTime, Duration, Utc};

use switchyard_actors::ports::{ReviewReason, Settlement, UsageBounds};

use super::bounds::{FIVE_TOKENS, bounded};
use super::{LedgerConformanceError, Outcome, expect_eq, funded_team};
use crate::store::{
    DRIFT_REVIEWED_LIMIT, DriftReport, ModelDrift, ReviewCounts, ReviewedRow, Store, StoreError,
    TokenCounts, TokenTotals,
};

/// Runs every drift check in turn; it creates its own team, named after `prefix`.
pub async fn drift_conformance_suite(s: &dyn Store, prefix: &str) -> Outcome {
    drift_totals_and_reviewed_rows(s, prefix).await?;
    drift_reviewed_rows_are_capped(s, prefix).await?;
    Ok(())
}

fn violated(check: &'static str, detail: String) -> LedgerConformanceError {
    LedgerConformanceError::Violated { check, detail }
}

fn model<'r>(
    check: &'static str,
    report: &'r DriftReport,
    name: &str,
) -> Result<&'r ModelDrift, LedgerConformanceError> {
    report
        .models
        .iter()
        .find(|m| m.model == name)
        .ok_or_else(|| violated(check, format!("no entry for {name}")))
}

fn reviewed<'r>(
    check: &'static str,
    report: &'r DriftReport,
    request_id: &str,
) -> Result<&'r ReviewedRow, LedgerConformanceError> {
    report
        .reviewed
        .iter()
        .find(|r| r.request_id == request_id)
        .ok_or_else(|| violated(check, format!("{request_id} is not listed")))
}

/// When `request_id` settled.
async fn settled_at(
    s: &dyn Store,
    check: &'static str,
    request_id: &str,
) -> Result<DateTime<Utc>, LedgerConformanceError> {
    s.ledger_row(request_id)
        .await?
        .and_then(|row| row.settled_at)
        .ok_or_else(|| violated(check, format!("{request_id} did not settle")))
}

/// Reserves `{prefix}{name}` on `model` within `bounds` and settles it with the claim.
async fn settled(
    s: &dyn Store,
    team: i64,
    id: &str,
    model: &str,
    bounds: UsageBounds,
    claim: (u64, u64),
    review: Option<ReviewReason>,
) -> Outcome {
    let r = switchyard_actors::ports::Reservation {
        model: model.to_owned(),
        ..bounded(id, team, bounds)
    };
    s.reserve(&r).await?;
    s.settle(&Settlement {
        request_id: id.to_owned(),
        prompt_tokens: claim.0,
        completion_tokens: claim.1,
        review,
        node_id: None,
    })
    .await?;
    Ok(())
}

/// Two models, each with rows in and out of bounds, a requested review, a claim beyond i64,
/// a cancelled and an open row: the totals count settled rows only, reviews by reason, and
/// claims against bills exactly; the reviewed rows are listed newest first with their
/// claims, bills and bounds; a range after them holds none of it; an empty range is
/// `Invalid`.
pub async fn drift_totals_and_reviewed_rows(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "drift_totals_and_reviewed_rows";
    let team = funded_team(s, prefix, "drift", 1_000_000).await?;
    let (model_a, model_b) = (format!("{prefix}drift-a"), format!("{prefix}drift-b"));
    let id = |name: &str| format!("{prefix}drift-{name}");
    let big = i64::MAX;
    let rows = [
        ("a1", model_a.as_str(), (10, 2), None),
        ("a2", model_a.as_str(), (10, 1_000), None),
        (
            "b1",
            model_b.as_str(),
            (3, 4),
            Some(ReviewReason::UnverifiedNode),
        ),
        ("b2", model_b.as_str(), (u64::MAX, u64::MAX), None),
    ];
    for (name, model, claim, review) in rows {
        settled(s, team, &id(name), model, FIVE_TOKENS, claim, review).await?;
    }
    // Neither a cancelled nor an open row counts.
    for name in ["a-cancelled", "a-open"] {
        let r = switchyard_actors::ports::Reservation {
            model: model_a.clone(),
            ..bounded(&id(name), team, FIVE_TOKENS)
        };
        s.reserve(&r).await?;
    }
    s.cancel(&id("a-cancelled")).await?;

    let first = settled_at(s, CHECK, &id("a1")).await?;
    let last = settled_at(s, CHECK, &id("b2")).await?;
    let to = last + Duration::milliseconds(1);
    let report = s.drift_report(first, to).await?;
    expect_eq(CHECK, (report.from, report.to), (first, to))?;
    expect_eq(
        CHECK,
        model(CHECK, &report, &model_a)?,
        &ModelDrift {
            model: model_a.clone(),
            settled_requests: 2,
            settled: TokenTotals {
                prompt_tokens: 20,
                completion_tokens: 7,
            },
            under_review: ReviewCounts {
                usage_over_bound: 1,
                ..ReviewCounts::default()
            },
            reviewed_claimed: TokenTotals {
                prompt_tokens: 10,
                completion_tokens: 1_000,
            },
            reviewed_billed: TokenTotals {
                prompt_tokens: 10,
                completion_tokens: 5,
            },
        },
    )?;
    // b2's claim is kept as i64::MAX; with b1's it sums past i64, exactly.
    let wide = |n: u128| u128::from(big.unsigned_abs()) + n;
    expect_eq(
        CHECK,
        model(CHECK, &report, &model_b)?,
        &ModelDrift {
            model: model_b.clone(),
            settled_requests: 2,
            settled: TokenTotals {
                prompt_tokens: 103,
                completion_tokens: 9,
            },
            under_review: ReviewCounts {
                usage_over_bound: 1,
                unverified_node: 1,
                ..ReviewCounts::default()
            },
            reviewed_claimed: TokenTotals {
                prompt_tokens: wide(3),
                completion_tokens: wide(4),
            },
            reviewed_billed: TokenTotals {
                prompt_tokens: 103,
                completion_tokens: 9,
            },
        },
    )?;
    let mine: Vec<&str> = report
        .reviewed
        .iter()
        .map(|r| r.request_id.as_str())
        .filter(|r| r.starts_with(&id("")))
        .collect();
    expect_eq(
        CHECK,
        mine,
        vec![id("b2").as_str(), id("b1").as_str(), id("a2").as_str()],
    )?;
    let bounds = Some(TokenCounts {
        prompt_tokens: 100,
        completion_tokens: 5,
    });
    expect_eq(
        CHECK,
        reviewed(CHECK, &report, &id("b2"))?,
        &ReviewedRow {
            request_id: id("b2"),
            team_id: team,
            model: model_b.clone(),
            review: ReviewReason::UsageOverBound,
            claimed: TokenCounts {
                prompt_tokens: big,
                completion_tokens: big,
            },
            billed: TokenCounts {
                prompt_tokens: 100,
                completion_tokens: 5,
            },
            bounds,
            cost_microcredits: crate::store::cost_of(100, 5, 1_000_000, 2_000_000),
            settled_at: last,
        },
    )?;
    let b1 = reviewed(CHECK, &report, &id("b1"))?;
    expect_eq(
        CHECK,
        (b1.review, b1.claimed, b1.billed),
        (
            ReviewReason::UnverifiedNode,
            TokenCounts {
                prompt_tokens: 3,
                completion_tokens: 4,
            },
            TokenCounts {
                prompt_tokens: 3,
                completion_tokens: 4,
            },
        ),
    )?;
    if report
        .reviewed
        .windows(2)
        .any(|w| w[0].settled_at < w[1].settled_at)
    {
        return Err(violated(CHECK, "reviewed rows are not newest first".into()));
    }

    // After the range: none of it.
    let later = s.drift_report(to, to + Duration::hours(1)).await?;
    let leaked = later
        .models
        .iter()
        .any(|m| m.model == model_a || m.model == model_b)
        || later
            .reviewed
            .iter()
            .any(|r| r.request_id.starts_with(&id("")));
    expect_eq(CHECK, leaked, false)?;
    match s.drift_report(to, to).await {
        Err(StoreError::Invalid(_)) => Ok(()),
        other => Err(violated(
            CHECK,
            format!("an empty range answered {other:?}"),
        )),
    }
}

/// One more reviewed row than a report lists: the list holds the newest
/// [`DRIFT_REVIEWED_LIMIT`] and says it was cut; the totals count them all.
pub async fn drift_reviewed_rows_are_capped(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "drift_reviewed_rows_are_capped";
    let team = funded_team(s, prefix, "drift-cap", 1_000_000).await?;
    let name = format!("{prefix}drift-many");
    let id = |i: usize| format!("{prefix}drift-many-{i:03}");
    let n = DRIFT_REVIEWED_LIMIT + 1;
    for i in 0..n {
        let r = switchyard_actors::ports::Reservation {
            model: name.clone(),
            price_input_per_mtok: 0,
            price_output_per_mtok: 0,
            ..bounded(&id(i), team, FIVE_TOKENS)
        };
        s.reserve(&r).await?;
    }
    // Settled in reservation order, so the last settled is also the highest id: the newest
    // even when rows share a millisecond.
    for i in 0..n {
        s.settle(&Settlement {
            request_id: id(i),
            prompt_tokens: 1,
            completion_tokens: 1,
            review: Some(ReviewReason::UnverifiedNode),
            node_id: None,
        })
        .await?;
    }
    let first = settled_at(s, CHECK, &id(0)).await?;
    let last = settled_at(s, CHECK, &id(n - 1)).await?;
    let report = s
        .drift_report(first, last + Duration::milliseconds(1))
        .await?;
    expect_eq(
        CHECK,
        (report.reviewed.len(), report.reviewed_truncated),
        (DRIFT_REVIEWED_LIMIT, true),
    )?;
    expect_eq(
        CHECK,
        report.reviewed.first().map(|r| r.request_id.clone()),
        Some(id(n - 1)),
    )?;
    let counted = model(CHECK, &report, &name)?;
    let expected = u64::try_from(n).unwrap_or(u64::MAX);
    expect_eq(
        CHECK,
        (counted.settled_requests, counted.under_review.total()),
        (expected, expected),
    )
}
