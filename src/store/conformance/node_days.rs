//! Node uptime per day and the reports' sums on a [`Store`]: [`Store::add_node_day`] adds to
//! one row per (node, day, model) and saturates, [`Store::node_days`] reads the days of a
//! range with the node's pool, [`Store::node_day_ledger`] sums what settles named each node
//! for, and [`Store::set_node_pool`] checks its node and name. Works on nodes and models
//! named after the caller's prefix, so other rows in the store do not disturb it.

use chrono::{Days, NaiveDate};

use switchyard_actors::ports::{NodeDayUsage, Reservation, Settlement, UsageBounds};

use super::bounds::bounded;
use super::{LedgerConformanceError, Outcome, funded_team};
use crate::store::{NodeRecord, Store, StoreError};

/// Runs every check in turn.
pub async fn node_days_conformance_suite(s: &dyn Store, prefix: &str) -> Outcome {
    node_days_add_up_per_node_day_and_model(s, prefix).await?;
    node_day_ledger_sums_settles_by_node(s, prefix).await?;
    node_pools_are_checked(s, prefix).await?;
    Ok(())
}

fn violated(check: &'static str, detail: String) -> LedgerConformanceError {
    LedgerConformanceError::Violated { check, detail }
}

fn next(day: NaiveDate) -> NaiveDate {
    day.checked_add_days(Days::new(1)).unwrap_or(day)
}

fn usage(
    node: &str,
    day: NaiveDate,
    model: &str,
    seconds: u64,
    tokens: (u64, u64),
) -> NodeDayUsage {
    NodeDayUsage {
        node_id: node.to_owned(),
        day,
        model: model.to_owned(),
        connected_seconds: seconds,
        gpus: 2,
        engine_prompt_tokens: tokens.0,
        engine_generation_tokens: tokens.1,
        engine_counters: true,
    }
}

/// Two intervals of one day add up, the GPU count is the latest, the counters flag sticks;
/// another day and another model are rows of their own; a day outside the range is not
/// read; sums saturate at i64::MAX; the node's pool comes with its rows.
pub async fn node_days_add_up_per_node_day_and_model(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "node_days_add_up_per_node_day_and_model";
    let node = format!("{prefix}nd-a");
    let model = format!("{prefix}nd-m");
    s.create_node(&node, "cloud", &crate::store::hash_secret(&node))
        .await?;
    s.set_node_pool(&node, Some("gpu-l40s")).await?;
    let day = NaiveDate::from_ymd_opt(2026, 3, 1).unwrap_or_default();
    s.add_node_day(&usage(&node, day, &model, 5, (100, 40)))
        .await?;
    let mut second = usage(&node, day, &model, 7, (3, 2));
    second.gpus = 4;
    second.engine_counters = false;
    s.add_node_day(&second).await?;
    s.add_node_day(&usage(&node, next(day), &model, 11, (1, 1)))
        .await?;
    s.add_node_day(&usage(&node, day, &format!("{model}-other"), 13, (0, 0)))
        .await?;
    let rows: Vec<_> = s
        .node_days(day, next(day))
        .await?
        .into_iter()
        .filter(|r| r.node_id == node)
        .collect();
    let summary: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.model.clone(),
                r.connected_seconds,
                r.gpus,
                r.engine_prompt_tokens,
                r.engine_generation_tokens,
                r.engine_counters,
                r.pool.clone(),
            )
        })
        .collect();
    let pool = Some("gpu-l40s".to_owned());
    let expected = vec![
        (model.clone(), 12, 4, 103, 42, true, pool.clone()),
        (format!("{model}-other"), 13, 2, 0, 0, true, pool.clone()),
    ];
    if summary != expected {
        return Err(violated(
            CHECK,
            format!("read {summary:?}, expected {expected:?}"),
        ));
    }
    // Saturating: a counter near i64::MAX twice stays at i64::MAX.
    let huge = u64::try_from(i64::MAX).unwrap_or(u64::MAX);
    let later = next(next(day));
    s.add_node_day(&usage(&node, later, &model, 1, (huge, huge)))
        .await?;
    s.add_node_day(&usage(&node, later, &model, 1, (huge, 5)))
        .await?;
    let row = s
        .node_days(later, next(later))
        .await?
        .into_iter()
        .find(|r| r.node_id == node)
        .ok_or_else(|| violated(CHECK, "the saturated row is missing".into()))?;
    if (row.engine_prompt_tokens, row.engine_generation_tokens) != (huge, huge) {
        return Err(violated(CHECK, format!("saturated sums read {row:?}")));
    }
    Ok(())
}

/// Settles naming a node are summed per node, UTC day and model; a settle naming no node is
/// not in any node's row; `settled_by_model` totals them all.
pub async fn node_day_ledger_sums_settles_by_node(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "node_day_ledger_sums_settles_by_node";
    let team = funded_team(s, prefix, "node-days", 1_000_000).await?;
    let model = format!("{prefix}ndl-m");
    let (a, b) = (format!("{prefix}ndl-a"), format!("{prefix}ndl-b"));
    let bounds = UsageBounds {
        prompt_tokens: 1_000,
        completion_tokens: 1_000,
    };
    let rows = [
        ("1", Some(a.as_str()), (10, 20)),
        ("2", Some(a.as_str()), (1, 2)),
        ("3", Some(b.as_str()), (5, 7)),
        ("4", None, (100, 100)),
    ];
    for (name, node, (prompt, completion)) in rows {
        let id = format!("{prefix}ndl-{name}");
        s.reserve(&Reservation {
            model: model.clone(),
            ..bounded(&id, team, bounds)
        })
        .await?;
        s.settle(&Settlement {
            request_id: id,
            prompt_tokens: prompt,
            completion_tokens: completion,
            review: None,
            node_id: node.map(str::to_owned),
        })
        .await?;
    }
    let settled_at = s
        .ledger_row(&format!("{prefix}ndl-1"))
        .await?
        .and_then(|r| r.settled_at)
        .ok_or_else(|| violated(CHECK, "row 1 did not settle".into()))?;
    let day = settled_at.date_naive();
    // A day that straddles the settles' day on both sides, so a settle just before midnight
    // is still in range.
    let from = day.pred_opt().unwrap_or(day);
    let ledger: Vec<_> = s
        .node_day_ledger(from, next(next(day)))
        .await?
        .into_iter()
        .filter(|r| r.model == model)
        .map(|r| {
            (
                r.node_id,
                r.settled.prompt_tokens,
                r.settled.completion_tokens,
            )
        })
        .collect();
    let expected = vec![(a.clone(), 11, 22), (b.clone(), 5, 7)];
    if ledger != expected {
        return Err(violated(
            CHECK,
            format!("read {ledger:?}, expected {expected:?}"),
        ));
    }
    let after = s
        .node_day_ledger(next(next(day)), next(next(next(day))))
        .await?;
    if after.iter().any(|r| r.model == model) {
        return Err(violated(CHECK, format!("a later day holds {after:?}")));
    }
    let totals = s
        .settled_by_model(
            settled_at - chrono::Duration::days(1),
            settled_at + chrono::Duration::days(1),
        )
        .await?;
    let total = totals.get(&model).copied().unwrap_or_default();
    if (total.prompt_tokens, total.completion_tokens) != (116, 129) {
        return Err(violated(CHECK, format!("settled_by_model read {total:?}")));
    }
    Ok(())
}

/// A pool is set on a known node only, with a valid name, shows in the node's record, and
/// can be cleared.
pub async fn node_pools_are_checked(s: &dyn Store, prefix: &str) -> Outcome {
    const CHECK: &str = "node_pools_are_checked";
    let node = format!("{prefix}np-a");
    s.create_node(&node, "onprem", &crate::store::hash_secret(&node))
        .await?;
    let unknown = s
        .set_node_pool(&format!("{prefix}np-nobody"), Some("x"))
        .await;
    if unknown != Err(StoreError::NotFound) {
        return Err(violated(CHECK, format!("unknown node: {unknown:?}")));
    }
    for bad in ["", "GPU", "a_b", &"x".repeat(64)] {
        let r = s.set_node_pool(&node, Some(bad)).await;
        if !matches!(r, Err(StoreError::Invalid(_))) {
            return Err(violated(CHECK, format!("pool {bad:?}: {r:?}")));
        }
    }
    s.set_node_pool(&node, Some("gpu-h100")).await?;
    let pool = |n: Option<NodeRecord>| n.and_then(|n| n.pool);
    let set = pool(s.node(&node).await?);
    if set.as_deref() != Some("gpu-h100") {
        return Err(violated(
            CHECK,
            format!("the node's record shows pool {set:?}"),
        ));
    }
    s.set_node_pool(&node, None).await?;
    let cleared = pool(s.node(&node).await?);
    if cleared.is_some() {
        return Err(violated(CHECK, format!("a cleared pool reads {cleared:?}")));
    }
    Ok(())
}
