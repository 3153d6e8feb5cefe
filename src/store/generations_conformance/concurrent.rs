//! The conformance checks that race: many tokio tasks calling the store at once, where the
//! store's locking (not the caller) must keep the rules exact.

use std::sync::Arc;

use switchyard_actors::lifecycle::{
    Applied, Decision, Effect, Event, GenerationStore, LifecycleError, MessagePolicy,
    NewGeneration, Refusal, Status,
};
use tokio::task::JoinSet;

use super::{
    GenerationConformanceError, Outcome, T0, WINDOW_LIMIT, admitted, applied, completed, counters,
    expect_eq, request, roomy, violated, window,
};

/// Submissions racing for [`WINDOW_LIMIT`] places in
/// [`concurrent_admissions_stop_at_the_limit`].
pub const SUBMISSIONS: usize = 60;
/// Replays of one key racing in [`concurrent_replays_admit_once`] and
/// [`concurrent_fingerprints_conflict`].
pub const REPLAYS: usize = 50;
/// Copies of one event racing in [`concurrent_events_apply_once`].
pub const DUPLICATES: usize = 20;

/// Admits every request at `now_ms` at once, each in its own task; the decisions come back
/// in the requests' order.
async fn admit_all(
    s: &Arc<dyn GenerationStore>,
    requests: Vec<NewGeneration>,
    policy: MessagePolicy,
    now_ms: i64,
) -> Result<Vec<(NewGeneration, Decision)>, GenerationConformanceError> {
    let mut tasks = JoinSet::new();
    for (i, new) in requests.into_iter().enumerate() {
        let s = Arc::clone(s);
        tasks.spawn(async move {
            let decision = s.admit_generation(&new, &policy, now_ms).await;
            (i, new, decision)
        });
    }
    let mut out = Vec::new();
    for (i, new, decision) in tasks.join_all().await {
        out.push((i, new, decision?));
    }
    out.sort_by_key(|(i, _, _)| *i);
    Ok(out.into_iter().map(|(_, new, d)| (new, d)).collect())
}

/// Applies `event` to `id` [`DUPLICATES`] times at once, each in its own task.
async fn apply_all(
    s: &Arc<dyn GenerationStore>,
    id: &str,
    event: &Event,
    now_ms: i64,
) -> Result<Vec<Applied>, LifecycleError> {
    let mut tasks = JoinSet::new();
    for _ in 0..DUPLICATES {
        let (s, id, event) = (Arc::clone(s), id.to_owned(), event.clone());
        tasks.spawn(async move { s.apply_generation(&id, &event, now_ms).await });
    }
    tasks.join_all().await.into_iter().collect()
}

/// [`SUBMISSIONS`] distinct keys of one principal at once against a window of
/// [`WINDOW_LIMIT`]: exactly that many are admitted, the rest `QuotaExhausted` and never
/// written; the window holds exactly that many reservations.
pub async fn concurrent_admissions_stop_at_the_limit(
    s: Arc<dyn GenerationStore>,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "concurrent_admissions_stop_at_the_limit";
    let policy = MessagePolicy {
        limit: WINDOW_LIMIT,
        ..roomy()
    };
    let requests = (0..SUBMISSIONS)
        .map(|n| request(prefix, "stampede", &format!("k{n}"), "fp", 0))
        .collect();
    let decisions = admit_all(&s, requests, policy, T0 + 1_000).await?;
    let (mut admitted_count, mut exhausted) = (0, 0);
    for (new, decision) in &decisions {
        let stored = s
            .find_generation(&new.subject, &new.idempotency_key)
            .await?;
        match decision {
            Decision::Admitted(rec) => {
                admitted_count += 1;
                expect_eq(CHECK, "stored", stored.as_ref(), Some(rec))?;
            }
            Decision::QuotaExhausted { .. } => {
                exhausted += 1;
                expect_eq(CHECK, "refused stored", stored, None)?;
            }
            other => return Err(violated(CHECK, format!("unexpected {other:?}"))),
        }
    }
    let limit = usize::try_from(WINDOW_LIMIT).unwrap_or(usize::MAX);
    expect_eq(
        CHECK,
        "admitted, exhausted",
        (admitted_count, exhausted),
        (limit, SUBMISSIONS - limit),
    )?;
    let subject = format!("{prefix}stampede");
    expect_eq(
        CHECK,
        "window",
        window(s.as_ref(), &subject, T0).await?,
        counters(0, WINDOW_LIMIT),
    )
}

/// [`REPLAYS`] submissions of one key and fingerprint at once (distinct generation ids, as
/// concurrent handlers would mint): exactly one is admitted, every other gets `Existing`
/// with its id, and one message is reserved.
pub async fn concurrent_replays_admit_once(s: Arc<dyn GenerationStore>, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrent_replays_admit_once";
    let requests = (0..REPLAYS)
        .map(|n| request(prefix, "replays", "key", "fp", n))
        .collect();
    let decisions = admit_all(&s, requests, roomy(), T0 + 1_000).await?;
    let winners: Vec<_> = decisions
        .iter()
        .filter_map(|(_, d)| match d {
            Decision::Admitted(rec) => Some(rec.clone()),
            _ => None,
        })
        .collect();
    let [winner] = winners.as_slice() else {
        return Err(violated(CHECK, format!("{} admitted", winners.len())));
    };
    for (new, decision) in &decisions {
        match decision {
            Decision::Admitted(_) => {}
            Decision::Existing(rec) => expect_eq(CHECK, "existing id", &rec.id, &winner.id)?,
            other => return Err(violated(CHECK, format!("unexpected {other:?}"))),
        }
        if new.id != winner.id {
            expect_eq(
                CHECK,
                "loser stored",
                s.get_generation(&new.id).await?,
                None,
            )?;
        }
    }
    expect_eq(
        CHECK,
        "window",
        window(s.as_ref(), &winner.subject, T0).await?,
        counters(0, 1),
    )
}

/// [`REPLAYS`] submissions of one key at once with five different fingerprints: exactly
/// one is admitted; the others with its fingerprint get `Existing`, the rest `Conflict`,
/// all naming the winner.
pub async fn concurrent_fingerprints_conflict(
    s: Arc<dyn GenerationStore>,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "concurrent_fingerprints_conflict";
    const FINGERPRINTS: usize = 5;
    let requests = (0..REPLAYS)
        .map(|n| {
            request(
                prefix,
                "fingerprints",
                "key",
                &format!("fp-{}", n % FINGERPRINTS),
                n,
            )
        })
        .collect();
    let decisions = admit_all(&s, requests, roomy(), T0 + 1_000).await?;
    let winners: Vec<_> = decisions
        .iter()
        .filter_map(|(_, d)| match d {
            Decision::Admitted(rec) => Some(rec.clone()),
            _ => None,
        })
        .collect();
    let [winner] = winners.as_slice() else {
        return Err(violated(CHECK, format!("{} admitted", winners.len())));
    };
    let (mut existing, mut conflicts) = (0, 0);
    for (new, decision) in &decisions {
        match decision {
            Decision::Admitted(_) => {}
            Decision::Existing(rec) => {
                existing += 1;
                expect_eq(CHECK, "existing id", &rec.id, &winner.id)?;
                expect_eq(
                    CHECK,
                    "existing fingerprint",
                    &new.fingerprint,
                    &winner.fingerprint,
                )?;
            }
            Decision::Conflict(rec) => {
                conflicts += 1;
                expect_eq(CHECK, "conflict id", &rec.id, &winner.id)?;
                if new.fingerprint == winner.fingerprint {
                    return Err(violated(
                        CHECK,
                        "a conflict with its own fingerprint".to_owned(),
                    ));
                }
            }
            other => return Err(violated(CHECK, format!("unexpected {other:?}"))),
        }
    }
    let same = REPLAYS / FINGERPRINTS;
    expect_eq(
        CHECK,
        "existing, conflicts",
        (existing, conflicts),
        (same - 1, REPLAYS - same),
    )?;
    expect_eq(
        CHECK,
        "window",
        window(s.as_ref(), &winner.subject, T0).await?,
        counters(0, 1),
    )
}

/// The same event applied [`DUPLICATES`] times at once takes effect once: one accept
/// consumes the message (the others change nothing more), one finish ends the generation
/// (the others are refused as final), one reject releases the message.
pub async fn concurrent_events_apply_once(s: Arc<dyn GenerationStore>, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrent_events_apply_once";
    let g = s.as_ref();
    let now = T0 + 1_000;
    let policy = roomy();
    let rec = admitted(
        g,
        CHECK,
        &request(prefix, "once", "run", "fp", 0),
        &policy,
        now,
    )
    .await?;
    applied(g, CHECK, &rec.id, &Event::Dispatch { attempt: 1 }, now).await?;

    let consume = vec![Effect::ConsumeMessage {
        window_start_ms: T0,
    }];
    let accepts = apply_all(&s, &rec.id, &Event::Accept { attempt: 1 }, now + 1).await?;
    let mut consumed = 0;
    for a in &accepts {
        match &a.result {
            Ok(effects) if *effects == consume => consumed += 1,
            Ok(effects) if effects.is_empty() => {}
            other => return Err(violated(CHECK, format!("accept: {other:?}"))),
        }
        expect_eq(CHECK, "accepted", a.record.status, Status::Running)?;
    }
    expect_eq(CHECK, "consumed", consumed, 1)?;
    expect_eq(
        CHECK,
        "window",
        window(g, &rec.subject, T0).await?,
        counters(1, 0),
    )?;

    let finishes = apply_all(&s, &rec.id, &completed(1, "once"), now + 2).await?;
    expect_once(CHECK, "finish", &finishes, &[])?;
    let stored = g.get_generation(&rec.id).await?;
    expect_eq(
        CHECK,
        "finished",
        stored.map(|r| (r.status, r.output)),
        Some((Status::Completed, Some("once".to_owned()))),
    )?;

    let other = admitted(
        g,
        CHECK,
        &request(prefix, "once", "rej", "fp", 0),
        &policy,
        now,
    )
    .await?;
    expect_eq(
        CHECK,
        "window",
        window(g, &rec.subject, T0).await?,
        counters(1, 1),
    )?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    let rejects = apply_all(&s, &other.id, &reject, now + 3).await?;
    expect_once(
        CHECK,
        "reject",
        &rejects,
        &[Effect::ReleaseMessage {
            window_start_ms: T0,
        }],
    )?;
    expect_eq(
        CHECK,
        "window at the end",
        window(g, &rec.subject, T0).await?,
        counters(1, 0),
    )
}

/// Exactly one of `results` applied, with `effects`; every other was refused as final.
fn expect_once(
    check: &'static str,
    what: &str,
    results: &[Applied],
    effects: &[Effect],
) -> Outcome {
    let mut applied_count = 0;
    for a in results {
        match &a.result {
            Ok(e) if e.as_slice() == effects => applied_count += 1,
            Err(Refusal::Final) => {}
            other => return Err(violated(check, format!("{what}: {other:?}"))),
        }
    }
    expect_eq(check, what, applied_count, 1)
}
