//! The contract every [`GenerationStore`] must meet (SPEC section 5), as async checks any
//! implementation can run: the actors' in-memory reference, SQLite and PostgreSQL alike.
//! Compiled in every build so integration tests and other crates can call it.
//!
//! Each check works on principals named `{prefix}…` and generation ids starting with
//! `prefix`, so checks and suites sharing a store never collide. Time is passed in, never
//! read: windows start at multiples of three hours from [`T0`]. The sweeper is global, so
//! [`sweep_expires_and_forgets`] keeps to its own epoch ([`SWEEP_T0`], long before `T0`):
//! no other check's generation reaches its bound or retention by then.

use std::fmt::Debug;
use std::sync::Arc;

use switchyard_actors::lifecycle::{
    AttemptState, Decision, Effect, Event, GenerationRecord, GenerationStore, LifecycleError,
    MessagePolicy, MessageState, NewGeneration, Outcome as End, Refusal, Status, WindowCounters,
    window_start,
};

mod concurrent;
mod limits;

pub use concurrent::{
    concurrent_admissions_stop_at_the_limit, concurrent_events_apply_once,
    concurrent_fingerprints_conflict, concurrent_replays_admit_once,
};
pub use limits::{
    burst_bucket, concurrency_limit, fixed_window_boundary, reservation_stays_in_its_window,
    window_limit,
};

/// How a generation store conformance check failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerationConformanceError {
    /// The implementation returned an error where the contract expects an answer.
    #[error("generation store error: {0}")]
    Store(#[from] LifecycleError),
    /// The implementation answered, but not as the contract says.
    #[error("{check}: {detail}")]
    Violated {
        /// Which property was broken.
        check: &'static str,
        /// What was observed.
        detail: String,
    },
}

type Outcome = Result<(), GenerationConformanceError>;

/// A window boundary (a multiple of the default three hours): the checks' epoch.
pub const T0: i64 = 1_749_600_000_000;
/// The default window's length.
pub const WINDOW_MS: i64 = 3 * 3600 * 1000;
/// The sweeper check's epoch, thirty days before [`T0`].
pub const SWEEP_T0: i64 = T0 - 30 * 24 * 3600 * 1000;
/// Messages per window in the window checks (the SPEC's default).
pub const WINDOW_LIMIT: u32 = 40;

/// Runs every check in turn, stopping at the first failure. Suites with different prefixes
/// may share a store one after another, not at once: the sweeper check expires whatever is
/// past its bound, another suite's records included.
pub async fn generations_conformance_suite(s: Arc<dyn GenerationStore>, prefix: &str) -> Outcome {
    let g = s.as_ref();
    same_key_same_fingerprint_is_existing(g, prefix).await?;
    different_fingerprint_conflicts(g, prefix).await?;
    rejected_generation_readmits(g, prefix).await?;
    concurrency_limit(g, prefix).await?;
    burst_bucket(g, prefix).await?;
    window_limit(g, prefix).await?;
    fixed_window_boundary(g, prefix).await?;
    reservation_stays_in_its_window(g, prefix).await?;
    terminal_records_never_change(g, prefix).await?;
    outputs_keep_every_character(g, prefix).await?;
    unknown_generations(g, prefix).await?;
    sweep_expires_and_forgets(g, prefix).await?;
    concurrent_admissions_stop_at_the_limit(Arc::clone(&s), prefix).await?;
    concurrent_replays_admit_once(Arc::clone(&s), prefix).await?;
    concurrent_fingerprints_conflict(Arc::clone(&s), prefix).await?;
    concurrent_events_apply_once(s, prefix).await?;
    Ok(())
}

fn violated(check: &'static str, detail: String) -> GenerationConformanceError {
    GenerationConformanceError::Violated { check, detail }
}

fn expect_eq<T: PartialEq + Debug>(check: &'static str, what: &str, got: T, want: T) -> Outcome {
    if got == want {
        Ok(())
    } else {
        Err(violated(
            check,
            format!("{what}: got {got:?}, want {want:?}"),
        ))
    }
}

/// A policy no check reaches by accident: each narrows the limit it is about.
pub fn roomy() -> MessagePolicy {
    MessagePolicy {
        limit: 1_000,
        burst_capacity: 1_000,
        max_active: 1_000,
        ..MessagePolicy::default()
    }
}

/// A request of principal `{prefix}{subject}` with its own id (`n` tells attempts apart).
pub fn request(
    prefix: &str,
    subject: &str,
    key: &str,
    fingerprint: &str,
    n: usize,
) -> NewGeneration {
    NewGeneration {
        id: format!("{prefix}{subject}/{key}/{n}"),
        subject: format!("{prefix}{subject}"),
        idempotency_key: key.to_owned(),
        fingerprint: fingerprint.to_owned(),
        model: "conformance-model-v1".to_owned(),
    }
}

fn counters(used: u32, reserved: u32) -> WindowCounters {
    WindowCounters { used, reserved }
}

/// The finish a node reports for attempt `attempt`.
pub fn completed(attempt: u64, output: &str) -> Event {
    Event::Finish {
        attempt,
        from_node: true,
        outcome: End::Completed,
        input_tokens: 3,
        output_tokens: 5,
        output: Some(output.to_owned()),
        output_extra: None,
        finish_reason: Some("length".to_owned()),
    }
}

/// Admits `new`, or fails the check with what was decided instead.
async fn admitted(
    s: &dyn GenerationStore,
    check: &'static str,
    new: &NewGeneration,
    policy: &MessagePolicy,
    now_ms: i64,
) -> Result<GenerationRecord, GenerationConformanceError> {
    match s.admit_generation(new, policy, now_ms).await? {
        Decision::Admitted(rec) => Ok(rec),
        other => Err(violated(
            check,
            format!("{} was not admitted: {other:?}", new.id),
        )),
    }
}

/// Applies `event`, or fails the check with the refusal.
async fn applied(
    s: &dyn GenerationStore,
    check: &'static str,
    id: &str,
    event: &Event,
    now_ms: i64,
) -> Result<(GenerationRecord, Vec<Effect>), GenerationConformanceError> {
    let applied = s.apply_generation(id, event, now_ms).await?;
    match applied.result {
        Ok(effects) => Ok((applied.record, effects)),
        Err(refusal) => Err(violated(check, format!("{event:?} on {id}: {refusal}"))),
    }
}

/// Dispatches attempt 1 and has the node accept it.
async fn running(
    s: &dyn GenerationStore,
    check: &'static str,
    id: &str,
    now_ms: i64,
) -> Result<GenerationRecord, GenerationConformanceError> {
    applied(s, check, id, &Event::Dispatch { attempt: 1 }, now_ms).await?;
    Ok(applied(s, check, id, &Event::Accept { attempt: 1 }, now_ms)
        .await?
        .0)
}

async fn window(
    s: &dyn GenerationStore,
    subject: &str,
    start: i64,
) -> Result<WindowCounters, GenerationConformanceError> {
    Ok(s.message_window(subject, start).await?)
}

/// The same key with the same fingerprint names the same generation: `Existing`, with the
/// same id, whatever state it reached, and nothing more is reserved. A finished generation
/// is never rerun.
pub async fn same_key_same_fingerprint_is_existing(
    s: &dyn GenerationStore,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "same_key_same_fingerprint_is_existing";
    let policy = roomy();
    let now = T0 + 1_000;
    let first = request(prefix, "idem", "key", "fp-a", 1);
    let rec = admitted(s, CHECK, &first, &policy, now).await?;
    let want = GenerationRecord {
        id: first.id.clone(),
        subject: first.subject.clone(),
        idempotency_key: "key".to_owned(),
        fingerprint: "fp-a".to_owned(),
        model: first.model.clone(),
        ledger_id: first.id.clone(),
        status: Status::Queued,
        cancel_requested: false,
        attempt: 0,
        attempt_state: AttemptState::None,
        message: MessageState::Reserved,
        window_start_ms: T0,
        slot_held: true,
        slot_expires_ms: now + policy.slot_ttl_ms,
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        error_code: None,
        finish_reason: None,
        created_ms: now,
        terminal_ms: None,
    };
    expect_eq(CHECK, "admitted record", &rec, &want)?;
    let replay = request(prefix, "idem", "key", "fp-a", 2);
    expect_eq(
        CHECK,
        "replay",
        s.admit_generation(&replay, &policy, now + 10).await?,
        Decision::Existing(want.clone()),
    )?;
    expect_eq(
        CHECK,
        "get",
        s.get_generation(&first.id).await?,
        Some(want.clone()),
    )?;
    expect_eq(
        CHECK,
        "find",
        s.find_generation(&first.subject, "key").await?,
        Some(want.clone()),
    )?;
    expect_eq(
        CHECK,
        "replay's id",
        s.get_generation(&replay.id).await?,
        None,
    )?;
    expect_eq(
        CHECK,
        "window",
        window(s, &first.subject, T0).await?,
        counters(0, 1),
    )?;

    running(s, CHECK, &first.id, now + 20).await?;
    let (done, _) = applied(s, CHECK, &first.id, &completed(1, "hello"), now + 30).await?;
    match s.admit_generation(&replay, &policy, now + 40).await? {
        Decision::Existing(r) if r == done && r.status == Status::Completed => {}
        other => return Err(violated(CHECK, format!("replay after the end: {other:?}"))),
    }
    expect_eq(
        CHECK,
        "window after",
        window(s, &first.subject, T0).await?,
        counters(1, 0),
    )
}

/// The same key with another fingerprint is a `Conflict` naming the original, whether it
/// is active or was rejected; nothing is written.
pub async fn different_fingerprint_conflicts(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "different_fingerprint_conflicts";
    let policy = roomy();
    let now = T0 + 1_000;
    let first = request(prefix, "conflict", "key", "fp-a", 1);
    let rec = admitted(s, CHECK, &first, &policy, now).await?;
    let other = request(prefix, "conflict", "key", "fp-b", 2);
    expect_eq(
        CHECK,
        "conflict",
        s.admit_generation(&other, &policy, now).await?,
        Decision::Conflict(rec.clone()),
    )?;
    expect_eq(
        CHECK,
        "other's id",
        s.get_generation(&other.id).await?,
        None,
    )?;
    expect_eq(
        CHECK,
        "window",
        window(s, &first.subject, T0).await?,
        counters(0, 1),
    )?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    let (rejected, _) = applied(s, CHECK, &first.id, &reject, now + 1).await?;
    expect_eq(
        CHECK,
        "conflict with a rejected one",
        s.admit_generation(&other, &policy, now + 2).await?,
        Decision::Conflict(rejected),
    )?;
    expect_eq(
        CHECK,
        "window after",
        window(s, &first.subject, T0).await?,
        counters(0, 0),
    )
}

/// A rejected generation is readmitted by the same key and fingerprint: the same id and
/// model resolution, a new reservation and slot, its attempt epoch kept.
pub async fn rejected_generation_readmits(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "rejected_generation_readmits";
    let policy = roomy();
    let now = T0 + 1_000;
    let first = request(prefix, "readmit", "key", "fp", 1);
    let rec = admitted(s, CHECK, &first, &policy, now).await?;
    applied(s, CHECK, &first.id, &Event::Dispatch { attempt: 1 }, now).await?;
    applied(s, CHECK, &first.id, &Event::Refuse { attempt: 1 }, now).await?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    let (rejected, effects) = applied(s, CHECK, &first.id, &reject, now + 5).await?;
    expect_eq(
        CHECK,
        "reject's effects",
        effects,
        vec![Effect::ReleaseMessage {
            window_start_ms: T0,
        }],
    )?;
    expect_eq(
        CHECK,
        "rejected",
        (rejected.status, rejected.slot_held, rejected.terminal_ms),
        (Status::Rejected, false, Some(now + 5)),
    )?;
    expect_eq(
        CHECK,
        "window",
        window(s, &first.subject, T0).await?,
        counters(0, 0),
    )?;

    let retry = NewGeneration {
        model: "conformance-model-v2".to_owned(),
        ..request(prefix, "readmit", "key", "fp", 2)
    };
    let later = now + 60_000;
    let again = admitted(s, CHECK, &retry, &policy, later).await?;
    let want = GenerationRecord {
        status: Status::Queued,
        message: MessageState::Reserved,
        slot_held: true,
        slot_expires_ms: later + policy.slot_ttl_ms,
        error_code: None,
        terminal_ms: None,
        attempt: 1,
        attempt_state: AttemptState::Refused,
        // The first admission's row is final: the new one is keyed by the fresh id too.
        ledger_id: format!("{}#{}", rec.id, retry.id),
        ..rec
    };
    expect_eq(CHECK, "readmitted", &again, &want)?;
    expect_eq(
        CHECK,
        "stored",
        s.get_generation(&first.id).await?,
        Some(want),
    )?;
    expect_eq(
        CHECK,
        "retry's id",
        s.get_generation(&retry.id).await?,
        None,
    )?;
    expect_eq(
        CHECK,
        "window again",
        window(s, &first.subject, T0).await?,
        counters(0, 1),
    )?;
    let stale = s
        .apply_generation(&first.id, &Event::Dispatch { attempt: 1 }, later)
        .await?;
    expect_eq(CHECK, "old epoch", stale.result, Err(Refusal::Stale))?;
    applied(s, CHECK, &first.id, &Event::Dispatch { attempt: 2 }, later).await?;
    Ok(())
}

/// A completed, cancelled, failed or rejected generation refuses every event with
/// `Final` and never changes; nor do the counters.
pub async fn terminal_records_never_change(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "terminal_records_never_change";
    let policy = roomy();
    let now = T0 + 1_000;
    let done = admitted(
        s,
        CHECK,
        &request(prefix, "final", "done", "fp", 0),
        &policy,
        now,
    )
    .await?;
    running(s, CHECK, &done.id, now).await?;
    let (ended, _) = applied(s, CHECK, &done.id, &completed(1, "the end"), now + 1).await?;
    expect_eq(
        CHECK,
        "the finish reason is kept",
        ended.finish_reason.as_deref(),
        Some("length"),
    )?;
    let rejected = admitted(
        s,
        CHECK,
        &request(prefix, "final", "rej", "fp", 0),
        &policy,
        now,
    )
    .await?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    applied(s, CHECK, &rejected.id, &reject, now + 1).await?;
    let failed = admitted(
        s,
        CHECK,
        &request(prefix, "final", "failed", "fp", 0),
        &policy,
        now,
    )
    .await?;
    applied(
        s,
        CHECK,
        &failed.id,
        &Event::Expire,
        now + policy.slot_ttl_ms,
    )
    .await?;
    let before = window(s, &done.subject, T0).await?;
    let events = [
        Event::Dispatch { attempt: 2 },
        Event::Accept { attempt: 1 },
        Event::Refuse { attempt: 1 },
        Event::RequestCancel,
        Event::LeaseExpired { attempt: 1 },
        completed(1, "again"),
        Event::Finish {
            attempt: 1,
            from_node: false,
            outcome: End::Failed("internal_error".to_owned()),
            input_tokens: 9,
            output_tokens: 9,
            output: None,
            output_extra: None,
            finish_reason: None,
        },
        reject,
        Event::Expire,
    ];
    for id in [&done.id, &rejected.id, &failed.id] {
        let snapshot = s.get_generation(id).await?;
        for event in &events {
            let later = now + 10 * policy.slot_ttl_ms;
            let refused = s.apply_generation(id, event, later).await?;
            expect_eq(CHECK, "result", refused.result, Err(Refusal::Final))?;
            expect_eq(CHECK, "returned", Some(refused.record), snapshot.clone())?;
            expect_eq(
                CHECK,
                "stored",
                s.get_generation(id).await?,
                snapshot.clone(),
            )?;
        }
    }
    expect_eq(CHECK, "window", window(s, &done.subject, T0).await?, before)
}

/// A retained output comes back exactly as the node sent it, NUL and every other character
/// included (PostgreSQL's TEXT cannot hold NUL; the store must not lose or replace it).
pub async fn outputs_keep_every_character(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "outputs_keep_every_character";
    const OUTPUT: &str = "\0starts, a\0b\0\0c, \u{1}\u{7f} \u{fffd} é ✓ 😀 \r\n\t\\0 ends\0";
    let policy = roomy();
    let now = T0 + 1_000;
    let new = request(prefix, "nul", "key", "fp", 0);
    let rec = admitted(s, CHECK, &new, &policy, now).await?;
    running(s, CHECK, &rec.id, now).await?;
    // Tool calls and reasoning beside the text, as JSON (which escapes NUL).
    const EXTRA: &str = r#"{"reasoning":"\u0000think","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\":\"\u0000é\"}"}}]}"#;
    let finish = match completed(1, OUTPUT) {
        Event::Finish {
            attempt,
            from_node,
            outcome,
            input_tokens,
            output_tokens,
            output,
            finish_reason,
            ..
        } => Event::Finish {
            attempt,
            from_node,
            outcome,
            input_tokens,
            output_tokens,
            output,
            output_extra: Some(EXTRA.to_owned()),
            finish_reason,
        },
        other => other,
    };
    let (ended, _) = applied(s, CHECK, &rec.id, &finish, now + 1).await?;
    expect_eq(CHECK, "returned", ended.output.as_deref(), Some(OUTPUT))?;
    expect_eq(CHECK, "extra", ended.output_extra.as_deref(), Some(EXTRA))?;
    let stored = s.get_generation(&rec.id).await?;
    expect_eq(
        CHECK,
        "get",
        stored.as_ref().and_then(|r| r.output.as_deref()),
        Some(OUTPUT),
    )?;
    expect_eq(CHECK, "whole record", stored, Some(ended.clone()))?;
    expect_eq(
        CHECK,
        "find",
        s.find_generation(&new.subject, "key").await?,
        Some(ended.clone()),
    )?;
    // A replay of the key hands back the same output.
    match s.admit_generation(&new, &policy, now + 2).await? {
        Decision::Existing(r) if r.output.as_deref() == Some(OUTPUT) => Ok(()),
        other => Err(violated(CHECK, format!("replay: {other:?}"))),
    }
}

/// Unknown ids, keys and windows: `Unknown` for an event, absent or zero otherwise.
pub async fn unknown_generations(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "unknown_generations";
    let id = format!("{prefix}never-admitted");
    expect_eq(
        CHECK,
        "apply",
        s.apply_generation(&id, &Event::RequestCancel, T0).await,
        Err(LifecycleError::Unknown),
    )?;
    expect_eq(CHECK, "get", s.get_generation(&id).await?, None)?;
    let subject = format!("{prefix}nobody");
    expect_eq(
        CHECK,
        "find",
        s.find_generation(&subject, "key").await?,
        None,
    )?;
    expect_eq(
        CHECK,
        "window",
        window(s, &subject, T0).await?,
        counters(0, 0),
    )
}

/// The sweeper expires active generations whose bound passed (`failed`,
/// `generation_timeout`; the message released if nothing was dispatched, consumed
/// otherwise, the attempt fenced) and leaves the others; it forgets outputs once their
/// retention passed and changes nothing else.
pub async fn sweep_expires_and_forgets(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "sweep_expires_and_forgets";
    let policy = MessagePolicy {
        slot_ttl_ms: 1_000,
        ..roomy()
    };
    let retention = 10_000;
    let t = SWEEP_T0 + 7_000;
    let ws = window_start(t, WINDOW_MS);
    let req = |key: &str| request(prefix, "sweep", key, "fp", 0);
    let idle = admitted(s, CHECK, &req("idle"), &policy, t).await?;
    let sent = admitted(s, CHECK, &req("sent"), &policy, t).await?;
    applied(s, CHECK, &sent.id, &Event::Dispatch { attempt: 1 }, t).await?;
    let run = admitted(s, CHECK, &req("run"), &policy, t).await?;
    running(s, CHECK, &run.id, t).await?;
    let late = admitted(s, CHECK, &req("late"), &policy, t + 500).await?;
    let done = admitted(s, CHECK, &req("done"), &policy, t).await?;
    running(s, CHECK, &done.id, t).await?;
    let (finished, _) = applied(s, CHECK, &done.id, &completed(1, "kept a while"), t + 100).await?;
    expect_eq(
        CHECK,
        "window before",
        window(s, &idle.subject, ws).await?,
        counters(2, 3),
    )?;

    expect_eq(
        CHECK,
        "expired",
        s.sweep_generations(t + 1_000, retention).await?,
        3,
    )?;
    for (id, message, attempt_state) in [
        (&idle.id, MessageState::Released, AttemptState::None),
        (&sent.id, MessageState::Consumed, AttemptState::Fenced),
        (&run.id, MessageState::Consumed, AttemptState::Fenced),
    ] {
        let rec = s
            .get_generation(id)
            .await?
            .ok_or_else(|| violated(CHECK, format!("{id} vanished")))?;
        expect_eq(
            CHECK,
            "expired record",
            (
                rec.status,
                rec.error_code.as_deref(),
                rec.message,
                rec.attempt_state,
            ),
            (
                Status::Failed,
                Some("generation_timeout"),
                message,
                attempt_state,
            ),
        )?;
        expect_eq(
            CHECK,
            "expired slot",
            (rec.slot_held, rec.terminal_ms),
            (false, Some(t + 1_000)),
        )?;
    }
    let waiting = s.get_generation(&late.id).await?;
    expect_eq(CHECK, "before its bound", waiting, Some(late.clone()))?;
    expect_eq(
        CHECK,
        "finished",
        s.get_generation(&done.id).await?,
        Some(finished.clone()),
    )?;
    expect_eq(
        CHECK,
        "window after",
        window(s, &idle.subject, ws).await?,
        counters(3, 1),
    )?;
    expect_eq(
        CHECK,
        "again",
        s.sweep_generations(t + 1_000, retention).await?,
        0,
    )?;

    // Retention counts from the end: kept one millisecond before, gone at it.
    let ended = t + 100;
    expect_eq(
        CHECK,
        "late expired",
        s.sweep_generations(ended + retention - 1, retention)
            .await?,
        1,
    )?;
    expect_eq(
        CHECK,
        "retained",
        s.get_generation(&done.id).await?,
        Some(finished.clone()),
    )?;
    expect_eq(
        CHECK,
        "nothing left",
        s.sweep_generations(ended + retention, retention).await?,
        0,
    )?;
    let forgotten = GenerationRecord {
        output: None,
        output_extra: None,
        ..finished
    };
    expect_eq(
        CHECK,
        "forgotten",
        s.get_generation(&done.id).await?,
        Some(forgotten.clone()),
    )?;
    expect_eq(
        CHECK,
        "replay after retention",
        s.admit_generation(&req("done"), &policy, ended + retention)
            .await?,
        Decision::Existing(forgotten),
    )?;
    expect_eq(
        CHECK,
        "window at the end",
        window(s, &idle.subject, ws).await?,
        counters(3, 0),
    )
}
