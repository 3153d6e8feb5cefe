//! The conformance checks of the limits admission enforces: concurrency slots, the burst
//! bucket and the fixed message windows.

use switchyard_actors::lifecycle::{
    Decision, Effect, Event, GenerationStore, MessagePolicy, Outcome as End,
};

use super::{
    Outcome, T0, WINDOW_LIMIT, WINDOW_MS, admitted, applied, counters, expect_eq, request, roomy,
    running, violated, window,
};

/// At most `max_active` held slots: the next admission is `ConcurrencyLimited` and writes
/// nothing; an ended generation frees its slot at once, an expired bound frees it even
/// before the sweeper runs.
pub async fn concurrency_limit(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "concurrency_limit";
    let policy = MessagePolicy {
        max_active: 2,
        slot_ttl_ms: 60_000,
        ..roomy()
    };
    let now = T0 + 1_000;
    let a = admitted(
        s,
        CHECK,
        &request(prefix, "slots", "a", "fp", 0),
        &policy,
        now,
    )
    .await?;
    admitted(
        s,
        CHECK,
        &request(prefix, "slots", "b", "fp", 0),
        &policy,
        now,
    )
    .await?;
    let c = request(prefix, "slots", "c", "fp", 0);
    expect_eq(
        CHECK,
        "third",
        s.admit_generation(&c, &policy, now + 1).await?,
        Decision::ConcurrencyLimited { limit: 2 },
    )?;
    expect_eq(CHECK, "third written", s.get_generation(&c.id).await?, None)?;
    expect_eq(
        CHECK,
        "window",
        window(s, &a.subject, T0).await?,
        counters(0, 2),
    )?;
    // A pending cancel still holds the slot: the node has not confirmed the stop.
    applied(s, CHECK, &a.id, &Event::RequestCancel, now + 2).await?;
    expect_eq(
        CHECK,
        "while cancelling",
        s.admit_generation(&c, &policy, now + 3).await?,
        Decision::ConcurrencyLimited { limit: 2 },
    )?;
    let cancel = Event::Finish {
        attempt: 0,
        from_node: false,
        outcome: End::Cancelled,
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        finish_reason: None,
    };
    applied(s, CHECK, &a.id, &cancel, now + 4).await?;
    admitted(s, CHECK, &c, &policy, now + 5).await?;
    let d = request(prefix, "slots", "d", "fp", 0);
    expect_eq(
        CHECK,
        "fourth",
        s.admit_generation(&d, &policy, now + 6).await?,
        Decision::ConcurrencyLimited { limit: 2 },
    )?;
    // b's bound passes (not swept yet): its slot no longer counts.
    admitted(s, CHECK, &d, &policy, now + policy.slot_ttl_ms).await?;
    Ok(())
}

/// The burst bucket: `capacity` admissions at once, then `RateLimited` until the next token
/// (one per `burst_refill_ms`), never more than `capacity` saved up. Replays spend nothing,
/// and the bucket is the principal's own.
pub async fn burst_bucket(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "burst_bucket";
    let policy = MessagePolicy {
        burst_capacity: 3,
        burst_refill_ms: 3_000,
        ..roomy()
    };
    let now = T0 + 1_000;
    let req = |n: usize| request(prefix, "burst", &format!("k{n}"), "fp", 0);
    for n in 0..3 {
        admitted(s, CHECK, &req(n), &policy, now).await?;
    }
    let limited = |ms| Decision::RateLimited { retry_after_ms: ms };
    expect_eq(
        CHECK,
        "empty",
        s.admit_generation(&req(3), &policy, now).await?,
        limited(3_000),
    )?;
    expect_eq(
        CHECK,
        "refused written",
        s.get_generation(&req(3).id).await?,
        None,
    )?;
    expect_eq(
        CHECK,
        "half a token",
        s.admit_generation(&req(3), &policy, now + 1_500).await?,
        limited(1_500),
    )?;
    // 999 thousandths of a token: the missing thousandth takes 3 ms.
    expect_eq(
        CHECK,
        "almost",
        s.admit_generation(&req(3), &policy, now + 2_999).await?,
        limited(3),
    )?;
    match s.admit_generation(&req(0), &policy, now + 2_999).await? {
        Decision::Existing(_) => {}
        other => {
            return Err(violated(
                CHECK,
                format!("a replay spends a token: {other:?}"),
            ));
        }
    }
    admitted(s, CHECK, &req(3), &policy, now + 3_000).await?;
    expect_eq(
        CHECK,
        "spent again",
        s.admit_generation(&req(4), &policy, now + 3_000).await?,
        limited(3_000),
    )?;
    admitted(
        s,
        CHECK,
        &request(prefix, "burst-other", "k", "fp", 0),
        &policy,
        now,
    )
    .await?;
    // Long idle: the bucket fills to its capacity, no further.
    let later = now + 3_000 + 600_000;
    for n in 4..7 {
        admitted(s, CHECK, &req(n), &policy, later).await?;
    }
    expect_eq(
        CHECK,
        "capped",
        s.admit_generation(&req(7), &policy, later).await?,
        limited(3_000),
    )
}

/// `used + reserved` reaching the limit refuses with `QuotaExhausted` and the next window's
/// start; a released message gives its place back, a consumed one does not.
pub async fn window_limit(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "window_limit";
    let policy = MessagePolicy {
        limit: 3,
        ..roomy()
    };
    let now = T0 + 5_000;
    let req = |n: usize| request(prefix, "quota", &format!("k{n}"), "fp", 0);
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(admitted(s, CHECK, &req(n), &policy, now).await?.id);
    }
    let exhausted = Decision::QuotaExhausted {
        limit: 3,
        remaining: 0,
        reset_at_ms: T0 + WINDOW_MS,
    };
    expect_eq(
        CHECK,
        "fourth",
        s.admit_generation(&req(3), &policy, now).await?,
        exhausted.clone(),
    )?;
    expect_eq(
        CHECK,
        "refused written",
        s.get_generation(&req(3).id).await?,
        None,
    )?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    applied(s, CHECK, &ids[0], &reject, now + 1).await?;
    admitted(s, CHECK, &req(3), &policy, now + 2).await?;
    running(s, CHECK, &ids[1], now + 3).await?;
    expect_eq(
        CHECK,
        "fifth",
        s.admit_generation(&req(4), &policy, now + 4).await?,
        exhausted,
    )?;
    let subject = format!("{prefix}quota");
    expect_eq(
        CHECK,
        "window",
        window(s, &subject, T0).await?,
        counters(1, 2),
    )
}

/// Fixed, UTC-aligned windows: the whole allowance just before a boundary and again just
/// after it.
pub async fn fixed_window_boundary(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "fixed_window_boundary";
    let policy = MessagePolicy {
        limit: WINDOW_LIMIT,
        ..roomy()
    };
    let boundary = T0 + WINDOW_MS;
    let limit = usize::try_from(WINDOW_LIMIT).unwrap_or(usize::MAX);
    let req = |n: usize| request(prefix, "boundary", &format!("k{n}"), "fp", 0);
    // Just before the boundary, a millisecond apart.
    for (n, t) in (0..limit).zip(boundary - 1_000..) {
        let rec = admitted(s, CHECK, &req(n), &policy, t).await?;
        expect_eq(CHECK, "window before", rec.window_start_ms, T0)?;
    }
    expect_eq(
        CHECK,
        "before the boundary",
        s.admit_generation(&req(limit), &policy, boundary - 1)
            .await?,
        Decision::QuotaExhausted {
            limit: WINDOW_LIMIT,
            remaining: 0,
            reset_at_ms: boundary,
        },
    )?;
    for (n, t) in (limit..2 * limit).zip(boundary..) {
        let rec = admitted(s, CHECK, &req(n), &policy, t).await?;
        expect_eq(CHECK, "window after", rec.window_start_ms, boundary)?;
    }
    expect_eq(
        CHECK,
        "after the boundary",
        s.admit_generation(&req(2 * limit), &policy, boundary + 1_000)
            .await?,
        Decision::QuotaExhausted {
            limit: WINDOW_LIMIT,
            remaining: 0,
            reset_at_ms: boundary + WINDOW_MS,
        },
    )?;
    let subject = format!("{prefix}boundary");
    expect_eq(
        CHECK,
        "first window",
        window(s, &subject, T0).await?,
        counters(0, WINDOW_LIMIT),
    )?;
    expect_eq(
        CHECK,
        "second window",
        window(s, &subject, boundary).await?,
        counters(0, WINDOW_LIMIT),
    )
}

/// A reservation taken before a boundary is consumed or released in its own window, even
/// when the node's answer comes after the boundary.
pub async fn reservation_stays_in_its_window(s: &dyn GenerationStore, prefix: &str) -> Outcome {
    const CHECK: &str = "reservation_stays_in_its_window";
    let policy = MessagePolicy {
        limit: 2,
        ..roomy()
    };
    let boundary = T0 + WINDOW_MS;
    let x = admitted(
        s,
        CHECK,
        &request(prefix, "carry", "x", "fp", 0),
        &policy,
        boundary - 1,
    )
    .await?;
    let y = admitted(
        s,
        CHECK,
        &request(prefix, "carry", "y", "fp", 0),
        &policy,
        boundary - 1,
    )
    .await?;
    applied(
        s,
        CHECK,
        &x.id,
        &Event::Dispatch { attempt: 1 },
        boundary - 1,
    )
    .await?;
    let (_, effects) = applied(
        s,
        CHECK,
        &x.id,
        &Event::Accept { attempt: 1 },
        boundary + 10,
    )
    .await?;
    expect_eq(
        CHECK,
        "consumed in",
        effects,
        vec![Effect::ConsumeMessage {
            window_start_ms: T0,
        }],
    )?;
    let reject = Event::Reject {
        code: "no_capacity".to_owned(),
    };
    let (_, effects) = applied(s, CHECK, &y.id, &reject, boundary + 10).await?;
    expect_eq(
        CHECK,
        "released in",
        effects,
        vec![Effect::ReleaseMessage {
            window_start_ms: T0,
        }],
    )?;
    expect_eq(
        CHECK,
        "old window",
        window(s, &x.subject, T0).await?,
        counters(1, 0),
    )?;
    expect_eq(
        CHECK,
        "new window",
        window(s, &x.subject, boundary).await?,
        counters(0, 0),
    )?;
    // The new window holds the whole allowance.
    for key in ["z1", "z2"] {
        admitted(
            s,
            CHECK,
            &request(prefix, "carry", key, "fp", 0),
            &policy,
            boundary + 20,
        )
        .await?;
    }
    expect_eq(
        CHECK,
        "new window after",
        window(s, &x.subject, boundary).await?,
        counters(0, 2),
    )
}
