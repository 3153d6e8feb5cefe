//! The ledger on both backends: exactly-once transitions under concurrency, pricing from the
//! row, the balance check at admission, and `balance = credits - settled cost` after a seeded
//! random mix.

use super::*;
use switchyard::store::{ReviewReason, UsageBounds};

on_both!(store:
    ledger_prices_settles_from_the_row_and_debits_once,
    a_reservation_for_an_unknown_team_fails_closed,
    the_store_is_usable_as_dyn_store_and_dyn_ledger,
    ledger_conformance,
    balance_conformance,
    bounded_billing_conformance,
    drift_conformance,
    node_days_conformance,
    bounds_and_claims_round_trip_through_ledger_row,
    two_hundred_spawned_reserves_admit_exactly_ten,
    fifty_concurrent_settles_of_one_row_debit_once,
    settles_saturate_like_cost_of_and_take_any_claim,
    an_overflowing_debit_rolls_the_settle_back,
    names_with_nul_are_absent,
);
on_both!(db:
    balance_equals_credits_minus_settled_costs_after_a_random_mix,
    the_ledger_schema_holds_the_bounds_and_review_rules,
);

async fn ledger_prices_settles_from_the_row_and_debits_once(store: Arc<dyn Store>) {
    let team = store.create_team("ledger").await.unwrap();
    let key = store
        .create_api_key(new_key(team.id, "sk-sy-ledger"))
        .await
        .unwrap();
    store
        .add_credits(team.id, 10_000_000, "start")
        .await
        .unwrap();

    let mut r = reservation("req-1", team.id);
    r.key_id = Some(key.id);
    r.estimated_cost = 4_321;
    r.price_input_per_mtok = 150_000;
    r.price_output_per_mtok = 600_000;
    store.reserve(&r).await.unwrap();
    store.reserve(&reservation("req-2", team.id)).await.unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 2);

    let open = store.ledger_row("req-1").await.unwrap().unwrap();
    assert_eq!(open.status, LedgerStatus::Reserved);
    assert_eq!(open.key_id, Some(key.id));
    assert_eq!(open.model, r.model);
    assert_eq!(open.estimated_cost_microcredits, 4_321);
    assert_eq!(open.price_input_per_mtok, 150_000);
    assert_eq!(open.price_output_per_mtok, 600_000);
    assert_eq!(
        (
            open.prompt_tokens,
            open.completion_tokens,
            open.cost_microcredits
        ),
        (0, 0, 0)
    );
    assert_eq!(open.settled_at, None);

    assert_eq!(
        store
            .settle(&settlement("req-1", 1_234, 567))
            .await
            .unwrap(),
        SettleOutcome::Applied
    );
    let cost = cost_of(1_234, 567, 150_000, 600_000);
    assert_eq!(cost, 526, "185.1 + 340.2 microcredits, rounded up");
    let settled = store.ledger_row("req-1").await.unwrap().unwrap();
    assert_eq!(settled.status, LedgerStatus::Settled);
    assert_eq!(
        (settled.prompt_tokens, settled.completion_tokens),
        (1_234, 567)
    );
    assert_eq!(settled.cost_microcredits, cost);
    assert!(settled.settled_at.is_some());
    let balance = || async {
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits
    };
    assert_eq!(balance().await, 10_000_000 - cost);

    // Retries and late cancels change nothing.
    assert_eq!(
        store
            .settle(&settlement("req-1", 9_999, 9_999))
            .await
            .unwrap(),
        SettleOutcome::AlreadyFinal
    );
    assert_eq!(
        store.cancel("req-1").await.unwrap(),
        SettleOutcome::AlreadyFinal
    );
    assert_eq!(store.ledger_row("req-1").await.unwrap(), Some(settled));
    assert_eq!(balance().await, 10_000_000 - cost);
    assert_eq!(store.open_reservations().await.unwrap(), 1);

    // A cancel debits nothing, and a settle after it is refused.
    assert_eq!(store.cancel("req-2").await.unwrap(), SettleOutcome::Applied);
    assert_eq!(
        store.settle(&settlement("req-2", 10, 10)).await.unwrap(),
        SettleOutcome::AlreadyFinal
    );
    let cancelled = store.ledger_row("req-2").await.unwrap().unwrap();
    assert_eq!(cancelled.status, LedgerStatus::Cancelled);
    assert_eq!(cancelled.cost_microcredits, 0);
    assert!(cancelled.settled_at.is_some());
    assert_eq!(balance().await, 10_000_000 - cost);
    assert_eq!(store.open_reservations().await.unwrap(), 0);

    assert_eq!(
        store.settle(&settlement("nope", 1, 1)).await.unwrap(),
        SettleOutcome::Unknown
    );
    assert_eq!(store.cancel("nope").await.unwrap(), SettleOutcome::Unknown);
    assert_eq!(store.ledger_row("nope").await.unwrap(), None);
    assert_eq!(
        store.reserve(&reservation("req-1", team.id)).await,
        Err(LedgerError::Duplicate)
    );

    let other = funded(store.as_ref(), "other", 1).await;
    store.reserve(&reservation("req-3", other)).await.unwrap();
    let ids = |rows: Vec<switchyard::store::LedgerRow>| {
        rows.into_iter().map(|r| r.request_id).collect::<Vec<_>>()
    };
    assert_eq!(
        ids(store.ledger_rows(Some(team.id)).await.unwrap()),
        ["req-1", "req-2"]
    );
    assert_eq!(
        ids(store.ledger_rows(None).await.unwrap()),
        ["req-1", "req-2", "req-3"]
    );
    assert_eq!(store.open_reservations().await.unwrap(), 1);
}

async fn a_reservation_for_an_unknown_team_fails_closed(store: Arc<dyn Store>) {
    assert!(matches!(
        store.reserve(&reservation("orphan", 999)).await,
        Err(LedgerError::Unavailable(_))
    ));
    assert_eq!(store.ledger_row("orphan").await.unwrap(), None);
}

async fn the_store_is_usable_as_dyn_store_and_dyn_ledger(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "dyn", 1).await;
    let ledger: Arc<dyn Ledger> = store.clone();
    ledger.reserve(&reservation("dyn", team)).await.unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 1);
}

async fn ledger_conformance(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "conformance", conformance::SUITE_BALANCE).await;
    conformance::ledger_conformance_suite(store.as_ref(), team, "c:")
        .await
        .unwrap();
}

async fn balance_conformance(store: Arc<dyn Store>) {
    conformance::balance_conformance_suite(store.as_ref(), "b:")
        .await
        .unwrap();
}

async fn bounded_billing_conformance(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "bounded", conformance::SUITE_BALANCE).await;
    conformance::bounded_billing_suite(store.as_ref(), team, "bb:")
        .await
        .unwrap();
}

async fn node_days_conformance(store: Arc<dyn Store>) {
    conformance::node_days_conformance_suite(store.as_ref(), "nd:")
        .await
        .unwrap();
}

async fn drift_conformance(store: Arc<dyn Store>) {
    conformance::drift_conformance_suite(store.as_ref(), "d:")
        .await
        .unwrap();
}

/// `ledger_row` shows the bounds a row was reserved with, and after a clamped settle the
/// claim and the review; a bound beyond i64 is stored as no bound (`i64::MAX`).
async fn bounds_and_claims_round_trip_through_ledger_row(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "bounds", 1_000_000).await;
    let r = conformance::bounded("five", team, conformance::FIVE_TOKENS);
    store.reserve(&r).await.unwrap();
    let open = store.ledger_row("five").await.unwrap().unwrap();
    assert_eq!(
        (
            open.prompt_token_bound,
            open.completion_token_bound,
            open.claimed_prompt_tokens,
            open.claimed_completion_tokens,
            open.review
        ),
        (Some(100), Some(5), None, None, None)
    );
    store
        .settle(&settlement("five", 30, 100_000))
        .await
        .unwrap();
    let row = store.ledger_row("five").await.unwrap().unwrap();
    assert_eq!(
        (
            row.prompt_tokens,
            row.completion_tokens,
            row.claimed_prompt_tokens,
            row.claimed_completion_tokens,
            row.review
        ),
        (
            30,
            5,
            Some(30),
            Some(100_000),
            Some(ReviewReason::UsageOverBound)
        )
    );
    assert_eq!(row.cost_microcredits, cost_of(30, 5, 1_000_000, 2_000_000));

    let wide = conformance::bounded(
        "wide",
        team,
        UsageBounds {
            prompt_tokens: u64::MAX,
            completion_tokens: 7,
        },
    );
    store.reserve(&wide).await.unwrap();
    let row = store.ledger_row("wide").await.unwrap().unwrap();
    assert_eq!(
        (row.prompt_token_bound, row.completion_token_bound),
        (Some(i64::MAX), Some(7))
    );
}

/// The schema refuses what the store never writes: a bill beyond the row's bounds, half a
/// pair of bounds or claims, a claim without a review, a review on an open row, an unknown
/// reason.
async fn the_ledger_schema_holds_the_bounds_and_review_rules(db: &Db) {
    let store = db.store();
    let team = funded(store.as_ref(), "rules", 1_000_000).await;
    for id in ["open", "done"] {
        store
            .reserve(&conformance::bounded(id, team, conformance::FIVE_TOKENS))
            .await
            .unwrap();
    }
    store.settle(&settlement("done", 1, 1)).await.unwrap();
    let raw = db.raw().await;
    let refused = [
        "UPDATE usage_ledger SET completion_tokens = 6 WHERE request_id = 'done'",
        "UPDATE usage_ledger SET prompt_tokens = 101 WHERE request_id = 'done'",
        "UPDATE usage_ledger SET completion_token_bound = NULL WHERE request_id = 'done'",
        "UPDATE usage_ledger SET prompt_token_bound = -1, prompt_tokens = 0 \
         WHERE request_id = 'done'",
        "UPDATE usage_ledger SET review = 'usage_over_bound' WHERE request_id = 'open'",
        "UPDATE usage_ledger SET review = 'looks_odd' WHERE request_id = 'done'",
        "UPDATE usage_ledger SET claimed_prompt_tokens = 1, claimed_completion_tokens = 1 \
         WHERE request_id = 'done'",
        "UPDATE usage_ledger SET review = 'usage_over_bound', claimed_prompt_tokens = 1 \
         WHERE request_id = 'done'",
        "UPDATE usage_ledger SET review = 'usage_over_bound', claimed_prompt_tokens = -1, \
         claimed_completion_tokens = 1 WHERE request_id = 'done'",
    ];
    for sql in refused {
        let err = match &raw {
            harness::Raw::Sqlite(pool) => sqlx::query(sql).execute(pool).await.unwrap_err(),
            harness::Raw::Postgres(pool) => sqlx::query(sql).execute(pool).await.unwrap_err(),
        };
        assert!(
            matches!(&err, sqlx::Error::Database(d) if d.is_check_violation()),
            "{sql}: {err}"
        );
    }
    // What a clamped settle writes is allowed.
    let allowed = "UPDATE usage_ledger SET review = 'usage_over_bound', \
                   claimed_prompt_tokens = 1, claimed_completion_tokens = 9 \
                   WHERE request_id = 'done'";
    let changed = match &raw {
        harness::Raw::Sqlite(pool) => sqlx::query(allowed)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()),
        harness::Raw::Postgres(pool) => sqlx::query(allowed)
            .execute(pool)
            .await
            .map(|r| r.rows_affected()),
    }
    .unwrap();
    assert_eq!(changed, 1);
}

/// The conformance check races futures on one task; this one races tasks on two threads.
async fn two_hundred_spawned_reserves_admit_exactly_ten(store: Arc<dyn Store>) {
    const ESTIMATE: i64 = 7_777;
    let team = funded(store.as_ref(), "ten", 10 * ESTIMATE).await;
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let r = Reservation {
                    estimated_cost: ESTIMATE,
                    ..reservation(&format!("ten-{i}"), team)
                };
                store.reserve(&r).await
            })
        })
        .collect();
    let mut outcomes = BTreeMap::new();
    for task in tasks {
        *outcomes
            .entry(format!("{:?}", task.await.unwrap()))
            .or_insert(0) += 1;
    }
    assert_eq!(
        outcomes,
        BTreeMap::from([
            ("Err(InsufficientBalance)".to_owned(), 190),
            ("Ok(())".to_owned(), 10)
        ])
    );
    assert_eq!(store.open_reservations().await.unwrap(), 10);
    assert_eq!(store.ledger_rows(Some(team)).await.unwrap().len(), 10);
}

async fn fifty_concurrent_settles_of_one_row_debit_once(store: Arc<dyn Store>) {
    let team = store.create_team("racers").await.unwrap();
    store
        .add_credits(team.id, 1_000_000, "start")
        .await
        .unwrap();
    let mut r = reservation("contended", team.id);
    r.price_input_per_mtok = 1_000_000;
    r.price_output_per_mtok = 1_000_000;
    store.reserve(&r).await.unwrap();

    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.settle(&settlement("contended", 100, 200)).await })
        })
        .collect();
    let mut outcomes = BTreeMap::new();
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        *outcomes.entry(format!("{outcome:?}")).or_insert(0) += 1;
    }
    assert_eq!(
        outcomes,
        BTreeMap::from([("AlreadyFinal".to_owned(), 49), ("Applied".to_owned(), 1)])
    );
    assert_eq!(
        store
            .team(team.id)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits,
        1_000_000 - 300
    );
    assert_eq!(store.open_reservations().await.unwrap(), 0);
}

/// The ledger prices a settle exactly as `cost_of` does, up to its saturation at i64::MAX,
/// and settles a claim beyond i64 at the ledger's range (marked for review) rather than
/// failing and leaving the row reserved (issue 10, finding 3).
async fn settles_saturate_like_cost_of_and_take_any_claim(store: Arc<dyn Store>) {
    let top = u64::try_from(i64::MAX).unwrap();
    let cases = [
        ("zero", 0, 0, 0, 0),
        ("tiny", 1, 0, 1, 0),
        ("round", 1_000_000, 1_000_000, 150_000, 600_000),
        ("odd", 999_999, 1, 999_999, 1_000_001),
        ("edge", top, 0, 1_000_000, 0),
        ("huge", top, top, i64::MAX, i64::MAX),
    ];
    for (id, p, c, pin, pout) in cases {
        let team = funded(store.as_ref(), id, 1_000_000).await;
        let r = Reservation {
            price_input_per_mtok: pin,
            price_output_per_mtok: pout,
            bounds: switchyard::store::UsageBounds::UNBOUNDED,
            ..reservation(id, team)
        };
        store.reserve(&r).await.unwrap();
        assert_eq!(
            store.settle(&settlement(id, p, c)).await.unwrap(),
            SettleOutcome::Applied
        );
        let want = cost_of(p, c, pin, pout);
        let row = store.ledger_row(id).await.unwrap().unwrap();
        assert_eq!(row.cost_microcredits, want, "{id}");
        assert_eq!(
            balance(store.as_ref(), team).await,
            1_000_000 - want,
            "{id}"
        );
    }
    assert_eq!(cost_of(top, top, i64::MAX, i64::MAX), i64::MAX, "saturated");

    let team = funded(store.as_ref(), "too-many", 1_000).await;
    store.reserve(&reservation("too-many", team)).await.unwrap();
    assert_eq!(
        store
            .settle(&settlement("too-many", u64::MAX, 0))
            .await
            .unwrap(),
        SettleOutcome::Applied
    );
    let row = store.ledger_row("too-many").await.unwrap().unwrap();
    assert_eq!(
        (
            row.status,
            row.prompt_tokens,
            row.claimed_prompt_tokens,
            row.review
        ),
        (
            LedgerStatus::Settled,
            i64::MAX,
            Some(i64::MAX),
            Some(ReviewReason::UsageOverBound)
        )
    );
    let want = cost_of(top, 0, 1_000_000, 2_000_000);
    assert_eq!(row.cost_microcredits, want);
    assert_eq!(balance(store.as_ref(), team).await, 1_000 - want);
}

/// A settle whose debit would overflow the balance rolls back whole: the row stays open and
/// the balance unchanged, so a cancel can still close it.
async fn an_overflowing_debit_rolls_the_settle_back(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "deep", 1).await;
    let r = Reservation {
        price_input_per_mtok: i64::MAX,
        ..reservation("deep", team)
    };
    store.reserve(&r).await.unwrap();
    store.add_credits(team, -i64::MAX, "debt").await.unwrap();
    let before = balance(store.as_ref(), team).await;
    assert_eq!(before, 1 - i64::MAX);
    assert!(matches!(
        store.settle(&settlement("deep", 2_000_000, 0)).await,
        Err(LedgerError::Unavailable(_))
    ));
    let row = store.ledger_row("deep").await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.cost_microcredits),
        (LedgerStatus::Reserved, 0)
    );
    assert_eq!(balance(store.as_ref(), team).await, before);
    assert_eq!(store.cancel("deep").await.unwrap(), SettleOutcome::Applied);
    // In debt, the team can open nothing, not even a free request.
    assert_eq!(
        store
            .reserve(&Reservation {
                estimated_cost: 0,
                ..reservation("broke", team)
            })
            .await,
        Err(LedgerError::InsufficientBalance)
    );
}

/// PostgreSQL cannot store NUL in text; lookups of such keys answer "absent" on both
/// backends instead of failing.
async fn names_with_nul_are_absent(store: Arc<dyn Store>) {
    assert_eq!(store.team_by_name("a\0b").await.unwrap(), None);
    assert_eq!(store.api_key_by_hash("a\0b").await.unwrap(), None);
    assert_eq!(store.node("a\0b").await.unwrap(), None);
    assert!(!store.revoke_node_token("a\0b").await.unwrap());
    assert_eq!(store.ledger_row("a\0b").await.unwrap(), None);
    assert_eq!(
        store.settle(&settlement("a\0b", 1, 1)).await.unwrap(),
        SettleOutcome::Unknown
    );
    assert_eq!(store.cancel("a\0b").await.unwrap(), SettleOutcome::Unknown);
}

/// What the test expects of one row after its actions.
#[derive(Debug, Clone, Copy)]
enum Plan {
    Settle,
    Cancel,
    SettleTwice,
    CancelThenSettle,
    SettleThenCancel,
    LeaveOpen,
}

async fn balance_equals_credits_minus_settled_costs_after_a_random_mix(db: &Db) {
    const REQUESTS: usize = 500;
    let store = db.store();
    let mut rng = ChaCha8Rng::seed_from_u64(0x5717_c4ad);

    let mut teams = Vec::new();
    let mut credited: BTreeMap<i64, i64> = BTreeMap::new();
    for name in ["red", "green", "blue"] {
        let team = store.create_team(name).await.unwrap();
        store
            .add_credits(team.id, 50_000_000, "start")
            .await
            .unwrap();
        credited.insert(team.id, 50_000_000);
        teams.push(team.id);
    }

    // Reserve everything first, concurrently in batches.
    let mut rows = Vec::new();
    for i in 0..REQUESTS {
        let mut r = reservation(&format!("mix-{i}"), teams[rng.random_range(0..teams.len())]);
        r.price_input_per_mtok = rng.random_range(0..=5_000_000);
        r.price_output_per_mtok = rng.random_range(0..=20_000_000);
        r.estimated_cost = rng.random_range(0..=50_000);
        let plan = match rng.random_range(0..6) {
            0 => Plan::Settle,
            1 => Plan::Cancel,
            2 => Plan::SettleTwice,
            3 => Plan::CancelThenSettle,
            4 => Plan::SettleThenCancel,
            _ => Plan::LeaveOpen,
        };
        let usage = (rng.random_range(0..8_000), rng.random_range(0..2_000));
        rows.push((r, plan, usage));
    }
    for batch in rows.chunks(50) {
        let tasks: Vec<_> = batch
            .iter()
            .map(|(r, _, _)| {
                let (store, r) = (Arc::clone(&store), r.clone());
                tokio::spawn(async move { store.reserve(&r).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
    }
    assert_eq!(
        store.open_reservations().await.unwrap(),
        i64::try_from(REQUESTS).unwrap()
    );

    // Then finish them in a shuffled order, concurrently, with credits arriving meanwhile.
    let mut order: Vec<usize> = (0..REQUESTS).collect();
    order.shuffle(&mut rng);
    for batch in order.chunks(25) {
        let mut tasks = Vec::new();
        for &i in batch {
            let (r, plan, (p, c)) = rows[i].clone();
            let store = Arc::clone(&store);
            tasks.push(tokio::spawn(async move {
                let id = r.request_id.as_str();
                let s = settlement(id, p, c);
                let outcomes = match plan {
                    Plan::Settle => vec![store.settle(&s).await],
                    Plan::Cancel => vec![store.cancel(id).await],
                    Plan::SettleTwice => vec![
                        store.settle(&s).await,
                        store.settle(&settlement(id, p + 1, c + 1)).await,
                    ],
                    Plan::CancelThenSettle => vec![store.cancel(id).await, store.settle(&s).await],
                    Plan::SettleThenCancel => vec![store.settle(&s).await, store.cancel(id).await],
                    Plan::LeaveOpen => vec![],
                };
                outcomes.into_iter().map(|o| o.unwrap()).collect::<Vec<_>>()
            }));
        }
        if rng.random_bool(0.3) {
            let team = teams[rng.random_range(0..teams.len())];
            let amount = rng.random_range(1..1_000_000);
            store.add_credits(team, amount, "top-up").await.unwrap();
            *credited.get_mut(&team).unwrap() += amount;
        }
        for task in tasks {
            let outcomes = task.await.unwrap();
            if let Some((first, rest)) = outcomes.split_first() {
                assert_eq!(*first, SettleOutcome::Applied);
                assert!(rest.iter().all(|o| *o == SettleOutcome::AlreadyFinal));
            }
        }
    }

    // Every row ended as planned, priced from its own prices.
    let mut settled_cost: BTreeMap<i64, i64> = BTreeMap::new();
    let mut open = 0;
    for (r, plan, (p, c)) in &rows {
        let row = store.ledger_row(&r.request_id).await.unwrap().unwrap();
        let (status, cost) = match plan {
            Plan::Settle | Plan::SettleTwice | Plan::SettleThenCancel => (
                LedgerStatus::Settled,
                cost_of(*p, *c, r.price_input_per_mtok, r.price_output_per_mtok),
            ),
            Plan::Cancel | Plan::CancelThenSettle => (LedgerStatus::Cancelled, 0),
            Plan::LeaveOpen => (LedgerStatus::Reserved, 0),
        };
        assert_eq!(
            (row.status, row.cost_microcredits),
            (status, cost),
            "{row:?}"
        );
        *settled_cost.entry(r.team_id).or_insert(0) += cost;
        open += i64::from(status == LedgerStatus::Reserved);
    }
    assert_eq!(store.open_reservations().await.unwrap(), open);

    // balance = sum(credits) - sum(settled cost), by the test's own count and by the tables.
    let raw = db.raw().await;
    for team in &teams {
        let balance = store
            .team(*team)
            .await
            .unwrap()
            .unwrap()
            .balance_microcredits;
        let expected = credited[team] - settled_cost.get(team).copied().unwrap_or(0);
        assert_eq!(balance, expected, "team {team}");
        let from_tables = raw.credits_minus_settled(*team).await;
        assert_eq!(balance, from_tables, "team {team}");
    }
}
