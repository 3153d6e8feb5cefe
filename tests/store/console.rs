//! The console's reads on both backends: usage per UTC day, team and model (settled rows
//! only, by the day the request was admitted, of one team or of all); a team's credit
//! history, newest first and capped; when each key last admitted a request.

use super::*;
use switchyard::store::usage::UsageDay;

on_both!(db:
    usage_is_summed_per_admission_day_team_and_model,
    keys_last_used_names_each_used_key_with_its_newest_request,
);
on_both!(store:
    credit_history_is_newest_first_and_capped,
);

/// `n` requests of `team` for `model` admitted (and, unless `open`, settled with `p` and `c`
/// tokens each) by `store`, whose clock says when.
async fn requests(
    store: &Arc<dyn Store>,
    tag: &str,
    team: i64,
    key: Option<i64>,
    model: &str,
    n: usize,
    (p, c): (u64, u64),
) {
    for i in 0..n {
        let id = format!("{tag}-{model}-{i}");
        let r = Reservation {
            key_id: key,
            model: model.to_owned(),
            ..reservation(&id, team)
        };
        store.reserve(&r).await.unwrap();
        store.settle(&settlement(&id, p, c)).await.unwrap();
    }
}

/// A store on `db` whose clock says `at`.
async fn clocked(db: &Db, at: DateTime<Utc>) -> Arc<dyn Store> {
    db.concrete()
        .await
        .with_clock(Arc::new(FixedClock(at)))
        .store()
}

fn day(y: i32, m: u32, d: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, m, d, 0, 0, 0).unwrap()
}

async fn usage_is_summed_per_admission_day_team_and_model(db: &Db) {
    let first = day(2026, 11, 30) + chrono::TimeDelta::hours(23);
    let second = day(2026, 12, 1) + chrono::TimeDelta::minutes(5);
    let on_first = clocked(db, first).await;
    let on_second = clocked(db, second).await;
    let a = funded(on_first.as_ref(), "usage-a", 1_000_000).await;
    let b = funded(on_first.as_ref(), "usage-b", 1_000_000).await;
    requests(&on_first, "a1", a, None, "m1", 2, (10, 5)).await;
    requests(&on_first, "a1", a, None, "m2", 1, (7, 0)).await;
    requests(&on_second, "a2", a, None, "m1", 3, (1, 1)).await;
    requests(&on_second, "b2", b, None, "m1", 1, (100, 100)).await;
    // Open and cancelled rows are not usage.
    on_second.reserve(&reservation("open", a)).await.unwrap();
    on_second.reserve(&reservation("gone", a)).await.unwrap();
    on_second.cancel("gone").await.unwrap();

    let row = |d: DateTime<Utc>, team, model: &str, requests, p, c| UsageDay {
        day: d.date_naive(),
        team_id: team,
        model: model.to_owned(),
        requests,
        prompt_tokens: p,
        completion_tokens: c,
        // 1 microcredit per prompt token, 2 per completion token.
        cost_microcredits: p + 2 * c,
    };
    let all = on_first
        .usage_by_day(day(2026, 11, 30), day(2026, 12, 2), None)
        .await
        .unwrap();
    assert_eq!(
        all,
        vec![
            row(first, a, "m1", 2, 20, 10),
            row(first, a, "m2", 1, 7, 0),
            row(second, a, "m1", 3, 3, 3),
            row(second, b, "m1", 1, 100, 100),
        ]
    );
    let only_a = on_first
        .usage_by_day(day(2026, 11, 30), day(2026, 12, 2), Some(a))
        .await
        .unwrap();
    assert_eq!(only_a.len(), 3, "{only_a:?}");
    assert!(only_a.iter().all(|r| r.team_id == a));
    // The range is by admission time, half-open.
    let first_day = on_first
        .usage_by_day(day(2026, 11, 30), day(2026, 12, 1), None)
        .await
        .unwrap();
    assert_eq!(first_day.len(), 2, "{first_day:?}");
    assert!(matches!(
        on_first
            .usage_by_day(day(2026, 12, 1), day(2026, 12, 1), None)
            .await,
        Err(StoreError::Invalid(_))
    ));
}

async fn credit_history_is_newest_first_and_capped(store: Arc<dyn Store>) {
    let team = funded(store.as_ref(), "history", 5).await;
    let other = funded(store.as_ref(), "history-other", 9).await;
    store.add_credits(team, 7, "more").await.unwrap();
    store.add_credits(team, -2, "correction").await.unwrap();
    let entries = store.credit_entries(team, 10).await.unwrap();
    let amounts: Vec<(i64, &str)> = entries
        .iter()
        .map(|e| (e.amount_microcredits, e.note.as_str()))
        .collect();
    assert_eq!(amounts, vec![(-2, "correction"), (7, "more"), (5, "start")]);
    assert!(entries.iter().all(|e| e.team_id == team));
    assert_eq!(store.credit_entries(team, 2).await.unwrap().len(), 2);
    assert_eq!(store.credit_entries(other, 10).await.unwrap().len(), 1);
}

async fn keys_last_used_names_each_used_key_with_its_newest_request(db: &Db) {
    let early = day(2026, 11, 2);
    let late = day(2026, 11, 3) + chrono::TimeDelta::milliseconds(1_234);
    let then = clocked(db, early).await;
    let now = clocked(db, late).await;
    let team = funded(then.as_ref(), "last-used", 1_000_000).await;
    let used = then
        .create_api_key(new_key(team, "sk-sy-used-key"))
        .await
        .unwrap();
    let idle = then
        .create_api_key(new_key(team, "sk-sy-idle-key"))
        .await
        .unwrap();
    requests(&then, "u1", team, Some(used.id), "m", 2, (1, 1)).await;
    requests(&now, "u2", team, Some(used.id), "m", 1, (1, 1)).await;
    let last = then.keys_last_used(team).await.unwrap();
    assert_eq!(last, BTreeMap::from([(used.id, late)]));
    assert!(!last.contains_key(&idle.id));
}
