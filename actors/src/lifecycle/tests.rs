#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

//! Property tests: random interleavings of submissions, retries, cancels, node frames of the
//! current and of older attempts, node loss, lease expiry, server-side ends and sweeps,
//! applied through [`MemoryGenerations`] (the same `apply` and `decide` the SQL stores run),
//! keep every invariant of SPEC section 5 after every step.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::admission::{Decision, MessagePolicy, NewGeneration};
use super::memory::MemoryGenerations;
use super::*;

const SUBJECTS: [&str; 2] = ["alice", "bob"];

#[derive(Debug, Clone)]
enum Op {
    Submit {
        subject: usize,
        key: u8,
        fp: u8,
    },
    Dispatch {
        g: usize,
    },
    Accept {
        g: usize,
        back: u64,
    },
    Refuse {
        g: usize,
        back: u64,
    },
    Cancel {
        g: usize,
    },
    LeaseExpired {
        g: usize,
        back: u64,
    },
    NodeDone {
        g: usize,
        back: u64,
        outcome: u8,
        tokens: u64,
    },
    ServerFinish {
        g: usize,
        outcome: u8,
    },
    Reject {
        g: usize,
    },
    Sweep,
    Advance {
        ms: i64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..4u8, 0..2u8).prop_map(|(subject, key, fp)| Op::Submit { subject, key, fp }),
        3 => (0..8usize).prop_map(|g| Op::Dispatch { g }),
        3 => (0..8usize, 0..2u64).prop_map(|(g, back)| Op::Accept { g, back }),
        1 => (0..8usize, 0..2u64).prop_map(|(g, back)| Op::Refuse { g, back }),
        2 => (0..8usize).prop_map(|g| Op::Cancel { g }),
        2 => (0..8usize, 0..2u64).prop_map(|(g, back)| Op::LeaseExpired { g, back }),
        3 => (0..8usize, 0..2u64, 0..3u8, 0..50u64)
            .prop_map(|(g, back, outcome, tokens)| Op::NodeDone { g, back, outcome, tokens }),
        1 => (0..8usize, 0..3u8).prop_map(|(g, outcome)| Op::ServerFinish { g, outcome }),
        1 => (0..8usize).prop_map(|g| Op::Reject { g }),
        1 => Just(Op::Sweep),
        2 => prop_oneof![Just(1_000i64), Just(60_000), Just(3 * 3600 * 1000)].prop_map(|ms| Op::Advance { ms }),
    ]
}

fn outcome(n: u8) -> Outcome {
    match n {
        0 => Outcome::Completed,
        1 => Outcome::Cancelled,
        _ => Outcome::Failed("model_backend_error".into()),
    }
}

/// What the test remembers of each generation, to check the store against.
#[derive(Debug, Default)]
struct Seen {
    /// The record when it first became terminal.
    terminal: Option<GenerationRecord>,
    /// Highest attempt seen.
    attempt: u64,
    consumed: u32,
    released: u32,
    /// An accept (or node `done`) succeeded at some point.
    accepted: bool,
    cancel_requested: bool,
}

struct World {
    store: MemoryGenerations,
    policy: MessagePolicy,
    now: i64,
    ids: Vec<String>,
    seen: BTreeMap<String, Seen>,
    next: u64,
}

impl World {
    fn id(&self, g: usize) -> Option<String> {
        if self.ids.is_empty() {
            None
        } else {
            Some(self.ids[g % self.ids.len()].clone())
        }
    }

    async fn event(&mut self, g: usize, event: impl FnOnce(&GenerationRecord) -> Event) {
        let Some(id) = self.id(g) else { return };
        let before = self.store.get_generation(&id).await.unwrap().unwrap();
        let event = event(&before);
        let applied = self
            .store
            .apply_generation(&id, &event, self.now)
            .await
            .unwrap();
        let seen = self.seen.entry(id.clone()).or_default();
        match &applied.result {
            Err(_) => assert_eq!(applied.record, before, "a refused event changed {id}"),
            Ok(effects) => {
                // Frames of another attempt, or of a fenced or refused one, never apply.
                match &event {
                    Event::Accept { attempt }
                    | Event::Refuse { attempt }
                    | Event::LeaseExpired { attempt }
                    | Event::Finish {
                        attempt,
                        from_node: true,
                        ..
                    } => {
                        assert_eq!(*attempt, before.attempt, "stale epoch applied");
                        assert!(
                            before.attempt_state.may_run(),
                            "a fenced attempt's frame applied"
                        );
                    }
                    Event::Dispatch { attempt } => {
                        assert!(*attempt > before.attempt);
                        assert!(
                            !before.attempt_state.may_run(),
                            "two attempts may run at once"
                        );
                        assert!(!before.cancel_requested);
                    }
                    Event::Finish {
                        from_node: false, ..
                    } => {
                        assert!(
                            !before.attempt_state.may_run(),
                            "server ended a running attempt"
                        );
                    }
                    _ => {}
                }
                if matches!(
                    event,
                    Event::Accept { .. }
                        | Event::Finish {
                            from_node: true,
                            ..
                        }
                ) {
                    seen.accepted = true;
                }
                if event == Event::RequestCancel {
                    seen.cancel_requested = true;
                }
                if applied.record.status == Status::Cancelled && !before.status.is_terminal() {
                    assert!(seen.cancel_requested, "cancelled without a request");
                    let confirmed = matches!(
                        event,
                        Event::Finish {
                            from_node: true,
                            ..
                        }
                    ) || !before.attempt_state.may_run();
                    assert!(
                        confirmed,
                        "cancelled before the node confirmed or was fenced"
                    );
                }
                for e in effects {
                    match e {
                        Effect::ConsumeMessage { window_start_ms } => {
                            seen.consumed += 1;
                            assert_eq!(*window_start_ms, before.window_start_ms);
                        }
                        Effect::ReleaseMessage { window_start_ms } => {
                            seen.released += 1;
                            assert_eq!(*window_start_ms, before.window_start_ms);
                        }
                    }
                }
            }
        }
    }

    async fn check(&mut self) {
        let records = self.store.records();
        let mut windows: BTreeMap<(String, i64), (u32, u32)> = BTreeMap::new();
        let mut active: BTreeMap<String, u32> = BTreeMap::new();
        for r in &records {
            let seen = self.seen.entry(r.id.clone()).or_default();
            // Terminal states never change.
            if let Some(t) = &seen.terminal {
                assert_eq!(t, r, "terminal generation {} changed", r.id);
            } else if r.status.is_terminal() {
                seen.terminal = Some(r.clone());
            }
            assert!(r.attempt >= seen.attempt, "attempt went backwards");
            seen.attempt = r.attempt;
            assert_eq!(
                r.slot_held,
                r.status.is_active(),
                "slot held iff active: {r:?}"
            );
            if r.slot_held && r.slot_expires_ms > self.now {
                *active.entry(r.subject.clone()).or_default() += 1;
            }
            // A message is consumed or released at most once, never both; released only if
            // nothing was ever accepted.
            assert!(seen.consumed <= 1 && seen.released <= 1);
            assert!(
                seen.consumed + seen.released <= 1,
                "consumed and released: {r:?}"
            );
            if r.status == Status::Rejected {
                // A rejected generation never started: the key may admit it again.
                assert_eq!(
                    r.message,
                    MessageState::Released,
                    "rejected without release: {r:?}"
                );
                assert!(!seen.accepted, "an accepted generation was rejected: {r:?}");
            }
            if r.message == MessageState::Released {
                assert!(!seen.accepted, "released after acceptance: {r:?}");
            }
            if seen.accepted {
                assert_eq!(r.message, MessageState::Consumed);
            }
            let w = windows
                .entry((r.subject.clone(), r.window_start_ms))
                .or_default();
            match r.message {
                MessageState::Reserved => w.1 += 1,
                MessageState::Consumed => w.0 += 1,
                MessageState::Released => {}
            }
        }
        for ((subject, start), (used, reserved)) in windows {
            let c = self.store.message_window(&subject, start).await.unwrap();
            assert_eq!(
                (c.used, c.reserved),
                (used, reserved),
                "window counters drifted"
            );
            assert!(
                used + reserved <= self.policy.limit,
                "window over its limit"
            );
        }
        for (subject, n) in active {
            assert!(n <= self.policy.max_active, "{subject} holds {n} slots");
        }
    }

    async fn run(&mut self, op: Op) {
        match op {
            Op::Submit { subject, key, fp } => {
                self.next += 1;
                let new = NewGeneration {
                    id: format!("gen_{}", self.next),
                    subject: SUBJECTS[subject].into(),
                    idempotency_key: format!("k{key}"),
                    fingerprint: format!("fp{fp}"),
                    model: "m".into(),
                };
                let before = self
                    .store
                    .find_generation(&new.subject, &new.idempotency_key)
                    .await
                    .unwrap();
                match self
                    .store
                    .admit_generation(&new, &self.policy, self.now)
                    .await
                    .unwrap()
                {
                    Decision::Admitted(r) => {
                        if let Some(b) = &before {
                            assert_eq!(
                                b.status,
                                Status::Rejected,
                                "a live or terminal generation was rerun"
                            );
                            assert_eq!(b.id, r.id);
                            // A readmission is a new reservation.
                            let seen = self.seen.entry(r.id.clone()).or_default();
                            seen.released = 0;
                        } else {
                            self.ids.push(r.id.clone());
                        }
                        assert_eq!(r.message, MessageState::Reserved);
                    }
                    Decision::Existing(r) => {
                        let b = before.unwrap();
                        assert_eq!(b.id, r.id);
                        assert_eq!(r.fingerprint, new.fingerprint);
                    }
                    Decision::Conflict(r) => assert_ne!(r.fingerprint, new.fingerprint),
                    Decision::QuotaExhausted { reset_at_ms, .. } => assert!(reset_at_ms > self.now),
                    Decision::RateLimited { retry_after_ms } => assert!(retry_after_ms > 0),
                    Decision::ConcurrencyLimited { .. } => {}
                }
            }
            Op::Dispatch { g } => {
                self.event(g, |r| Event::Dispatch {
                    attempt: r.attempt + 1,
                })
                .await
            }
            Op::Accept { g, back } => {
                self.event(g, |r| Event::Accept {
                    attempt: r.attempt.saturating_sub(back),
                })
                .await
            }
            Op::Refuse { g, back } => {
                self.event(g, |r| Event::Refuse {
                    attempt: r.attempt.saturating_sub(back),
                })
                .await
            }
            Op::Cancel { g } => self.event(g, |_| Event::RequestCancel).await,
            Op::LeaseExpired { g, back } => {
                self.event(g, |r| Event::LeaseExpired {
                    attempt: r.attempt.saturating_sub(back),
                })
                .await
            }
            Op::NodeDone {
                g,
                back,
                outcome: o,
                tokens,
            } => {
                self.event(g, |r| Event::Finish {
                    attempt: r.attempt.saturating_sub(back),
                    from_node: true,
                    outcome: outcome(o),
                    input_tokens: 10,
                    output_tokens: tokens,
                    output: Some("x".repeat(tokens as usize)),
                    output_extra: None,
                    finish_reason: Some("stop".into()),
                })
                .await
            }
            Op::ServerFinish { g, outcome: o } => {
                self.event(g, |r| Event::Finish {
                    attempt: r.attempt,
                    from_node: false,
                    outcome: outcome(o),
                    input_tokens: 0,
                    output_tokens: 0,
                    output: None,
                    output_extra: None,
                    finish_reason: None,
                })
                .await
            }
            Op::Reject { g } => {
                self.event(g, |_| Event::Reject {
                    code: "capacity_exhausted".into(),
                })
                .await
            }
            Op::Sweep => {
                self.store
                    .sweep_generations(self.now, 24 * 3600 * 1000)
                    .await
                    .unwrap();
            }
            Op::Advance { ms } => self.now += ms,
        }
        self.check().await;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_interleaving_keeps_the_invariants(ops in proptest::collection::vec(op(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut world = World {
                store: MemoryGenerations::default(),
                policy: MessagePolicy { limit: 5, max_active: 2, burst_capacity: 4, ..MessagePolicy::default() },
                now: 1_800_000_000_000,
                ids: Vec::new(),
                seen: BTreeMap::new(),
                next: 0,
            };
            for op in ops {
                world.run(op).await;
            }
        });
    }
}

fn record() -> GenerationRecord {
    GenerationRecord {
        id: "gen_1".into(),
        subject: "alice".into(),
        idempotency_key: "k".into(),
        fingerprint: "fp".into(),
        model: "m".into(),
        ledger_id: "gen_1".into(),
        status: Status::Queued,
        cancel_requested: false,
        attempt: 0,
        attempt_state: AttemptState::None,
        message: MessageState::Reserved,
        window_start_ms: 0,
        slot_held: true,
        slot_expires_ms: 1_000,
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        error_code: None,
        finish_reason: None,
        created_ms: 0,
        terminal_ms: None,
    }
}

fn done(attempt: u64, outcome: Outcome) -> Event {
    Event::Finish {
        attempt,
        from_node: true,
        outcome,
        input_tokens: 3,
        output_tokens: 4,
        output: Some("text".into()),
        output_extra: None,
        finish_reason: Some("stop".into()),
    }
}

#[test]
fn cancel_racing_completion_in_both_orders() {
    // Completion commits first: the cancel changes nothing, the generation stays completed.
    let mut r = record();
    apply(&mut r, &Event::Dispatch { attempt: 1 }, 1).unwrap();
    apply(&mut r, &Event::Accept { attempt: 1 }, 2).unwrap();
    apply(&mut r, &done(1, Outcome::Completed), 3).unwrap();
    assert_eq!(apply(&mut r, &Event::RequestCancel, 4), Err(Refusal::Final));
    assert_eq!(r.status, Status::Completed);

    // The cancel commits first: the node's confirmation makes it cancelled; a late `done`
    // saying "stop" would have completed it only if it came first.
    let mut r = record();
    apply(&mut r, &Event::Dispatch { attempt: 1 }, 1).unwrap();
    apply(&mut r, &Event::Accept { attempt: 1 }, 2).unwrap();
    apply(&mut r, &Event::RequestCancel, 3).unwrap();
    assert_eq!(r.api_status(), "cancel_requested");
    assert!(r.slot_held, "the slot waits for the node's confirmation");
    apply(&mut r, &done(1, Outcome::Cancelled), 4).unwrap();
    assert_eq!(r.status, Status::Cancelled);
    assert!(!r.slot_held);
    assert_eq!(
        apply(&mut r, &done(1, Outcome::Completed), 5),
        Err(Refusal::Final)
    );
    assert_eq!(
        apply(&mut r, &Event::Accept { attempt: 1 }, 5),
        Err(Refusal::Final)
    );
}

#[test]
fn a_cancel_is_confirmed_by_fencing_when_the_node_is_silent() {
    let mut r = record();
    apply(&mut r, &Event::Dispatch { attempt: 1 }, 1).unwrap();
    apply(&mut r, &Event::RequestCancel, 2).unwrap();
    let server_cancel = Event::Finish {
        attempt: 1,
        from_node: false,
        outcome: Outcome::Cancelled,
        input_tokens: 0,
        output_tokens: 0,
        output: None,
        output_extra: None,
        finish_reason: None,
    };
    assert!(matches!(
        apply(&mut r, &server_cancel, 3),
        Err(Refusal::NotAllowed(_))
    ));
    // Fencing spends the message: nothing proved the attempt never started.
    let effects = apply(&mut r, &Event::LeaseExpired { attempt: 1 }, 4).unwrap();
    assert_eq!(effects, vec![Effect::ConsumeMessage { window_start_ms: 0 }]);
    assert!(matches!(
        apply(&mut r.clone(), &Event::Reject { code: "x".into() }, 5),
        Err(Refusal::NotAllowed(_))
    ));
    assert!(apply(&mut r, &server_cancel, 5).unwrap().is_empty());
    assert_eq!(r.status, Status::Cancelled);

    // A refused attempt proved it never started: that message goes back.
    let mut r = record();
    apply(&mut r, &Event::Dispatch { attempt: 1 }, 1).unwrap();
    apply(&mut r, &Event::Refuse { attempt: 1 }, 2).unwrap();
    let effects = apply(&mut r, &Event::Reject { code: "x".into() }, 3).unwrap();
    assert_eq!(effects, vec![Effect::ReleaseMessage { window_start_ms: 0 }]);
    assert_eq!(r.status, Status::Rejected);
}

#[test]
fn a_lost_accepted_never_allows_a_second_attempt_until_fenced() {
    let mut r = record();
    apply(&mut r, &Event::Dispatch { attempt: 1 }, 1).unwrap();
    assert!(matches!(
        apply(&mut r, &Event::Dispatch { attempt: 2 }, 2),
        Err(Refusal::NotAllowed(_))
    ));
    apply(&mut r, &Event::LeaseExpired { attempt: 1 }, 3).unwrap();
    apply(&mut r, &Event::Dispatch { attempt: 2 }, 4).unwrap();
    // The fenced attempt's frames are stale.
    assert_eq!(
        apply(&mut r, &Event::Accept { attempt: 1 }, 5),
        Err(Refusal::Stale)
    );
    assert_eq!(
        apply(&mut r, &done(1, Outcome::Completed), 5),
        Err(Refusal::Stale)
    );
    // The message was spent when attempt 1 was fenced, once.
    assert!(
        apply(&mut r, &done(2, Outcome::Completed), 6)
            .unwrap()
            .is_empty()
    );
    assert_eq!(r.message, MessageState::Consumed);
}
