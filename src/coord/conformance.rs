//! The contract every [`Coordinator`] must meet, as async checks any implementation can run:
//! the in-process one on a paused clock, the Redis one against a live server. Compiled in
//! every build (not only `cfg(test)`) so other crates' and binaries' tests can call it.
//!
//! Time only passes through `tokio::time::sleep` with TTLs of a few hundred milliseconds and
//! margins of at least 100 ms on either side, so the same checks are instant on a paused
//! runtime and hold against a real server. Every key and channel starts with the caller's
//! `prefix`, so runs sharing a Redis do not collide.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

use switchyard_actors::ports::{CoordError, Coordinator};

/// How a conformance check failed.
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    /// The implementation returned an error where the contract expects success.
    #[error("coordinator error: {0}")]
    Coord(#[from] CoordError),
    /// The implementation answered, but not as the contract says.
    #[error("{check}: {detail}")]
    Violated {
        /// Which property was broken.
        check: &'static str,
        /// What was observed.
        detail: String,
    },
}

type Outcome = Result<(), ConformanceError>;

/// A TTL that must outlive the whole check.
const LONG: Duration = Duration::from_secs(30);
/// A TTL that must be gone after [`PAST`].
const SHORT: Duration = Duration::from_millis(100);
/// Waits long enough for a [`SHORT`] key to expire, with margin for a real server.
const PAST: Duration = Duration::from_millis(250);
/// A TTL checked at two points: still alive after [`HALF`], gone after [`HALF`] + [`PAST`].
const MEDIUM: Duration = Duration::from_millis(400);
/// Part of a [`MEDIUM`] TTL, leaving 200 ms of margin.
const HALF: Duration = Duration::from_millis(200);
/// How long a subscriber waits for a message that must arrive.
const DELIVERY: Duration = Duration::from_secs(5);

/// Runs every check in turn, stopping at the first failure.
pub async fn conformance_suite(c: &dyn Coordinator, prefix: &str) -> Outcome {
    hash_round_trip_and_replace(c, prefix).await?;
    hash_expiry(c, prefix).await?;
    fenced_hash_moves_to_the_newest_claim(c, prefix).await?;
    publish_counts_its_listeners(c, prefix).await?;
    lease_exclusive_and_renew(c, prefix).await?;
    lease_takeover_after_expiry(c, prefix).await?;
    lease_release(c, prefix).await?;
    lease_tokens_survive_delete(c, prefix).await?;
    counter_sums_and_keeps_first_expiry(c, prefix).await?;
    pubsub_order_and_late_subscribers(c, prefix).await?;
    pubsub_fans_out_and_survives_dropped_subscribers(c, prefix).await?;
    pubsub_late_subscriber_on_a_busy_channel(c, prefix).await?;
    delete_removes_any_kind(c, prefix).await?;
    wrong_kind_is_an_error(c, prefix).await?;
    leases_and_other_kinds_do_not_mix(c, prefix).await?;
    slots_bound_renew_release_and_expire(c, prefix).await?;
    sliding_window_is_exact_at_the_boundary(c, prefix).await?;
    journal_appends_in_order_skips_repeats_and_expires(c, prefix).await?;
    journal_reader_waits_for_the_next_append(c, prefix).await?;
    Ok(())
}

fn expect_eq<T: PartialEq + Debug>(check: &'static str, got: T, want: T) -> Outcome {
    if got == want {
        Ok(())
    } else {
        Err(ConformanceError::Violated {
            check,
            detail: format!("got {got:?}, want {want:?}"),
        })
    }
}

fn expect(check: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(ConformanceError::Violated {
            check,
            detail: detail(),
        })
    }
}

/// A token must be granted; returns it.
fn granted(check: &'static str, token: Option<u64>) -> Result<u64, ConformanceError> {
    token.ok_or_else(|| ConformanceError::Violated {
        check,
        detail: "lease refused to a free name".to_owned(),
    })
}

fn hash(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn next_message(
    check: &'static str,
    rx: &mut UnboundedReceiver<Vec<u8>>,
) -> Result<Vec<u8>, ConformanceError> {
    match tokio::time::timeout(DELIVERY, rx.recv()).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(ConformanceError::Violated {
            check,
            detail: "subscription closed".to_owned(),
        }),
        Err(_) => Err(ConformanceError::Violated {
            check,
            detail: format!("no message within {DELIVERY:?}"),
        }),
    }
}

/// `put_hash` replaces the whole hash (old fields vanish); `get_hash` returns it; a missing
/// key reads as `None`; an empty hash is no key at all.
pub async fn hash_round_trip_and_replace(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "hash_round_trip_and_replace";
    let key = format!("{prefix}hash:rt");
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;

    let first = hash(&[("owner", "replica-1"), ("queue_depth", "3")]);
    c.put_hash(&key, &first, LONG).await?;
    expect_eq(CHECK, c.get_hash(&key).await?, Some(first))?;

    let second = hash(&[("owner", "replica-2")]);
    c.put_hash(&key, &second, LONG).await?;
    expect_eq(CHECK, c.get_hash(&key).await?, Some(second))?;

    c.put_hash(&key, &BTreeMap::new(), LONG).await?;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;
    Ok(())
}

/// A claimed hash carries its fencing token; a newer claim moves it on, after which the
/// old holder can neither refresh nor delete it, while the holder can, also after expiry;
/// tokens never go back, even after the hash is gone.
pub async fn fenced_hash_moves_to_the_newest_claim(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "fenced_hash_moves_to_the_newest_claim";
    let key = format!("{prefix}hash:fenced");
    let first = c.claim_hash(&key, &hash(&[("owner", "a")]), LONG).await?;
    let with_fence =
        |owner: &str, fence: u64| Some(hash(&[("owner", owner), ("fence", &fence.to_string())]));
    expect_eq(CHECK, c.get_hash(&key).await?, with_fence("a", first))?;
    expect_eq(
        CHECK,
        c.put_hash_fenced(&key, &hash(&[("owner", "a2")]), first, LONG)
            .await?,
        true,
    )?;
    expect_eq(CHECK, c.get_hash(&key).await?, with_fence("a2", first))?;

    let second = c.claim_hash(&key, &hash(&[("owner", "b")]), LONG).await?;
    if second <= first {
        return Err(ConformanceError::Violated {
            check: CHECK,
            detail: format!("token {second} after {first}"),
        });
    }
    expect_eq(
        CHECK,
        c.put_hash_fenced(&key, &hash(&[("owner", "a")]), first, LONG)
            .await?,
        false,
    )?;
    expect_eq(CHECK, c.delete_fenced(&key, first).await?, false)?;
    expect_eq(CHECK, c.get_hash(&key).await?, with_fence("b", second))?;

    // The holder's refresh brings an expired hash back; its delete removes it.
    c.put_hash_fenced(&key, &hash(&[("owner", "b")]), second, SHORT)
        .await?;
    tokio::time::sleep(PAST).await;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;
    expect_eq(
        CHECK,
        c.put_hash_fenced(&key, &hash(&[("owner", "b")]), second, LONG)
            .await?,
        true,
    )?;
    expect_eq(CHECK, c.delete_fenced(&key, second).await?, true)?;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;
    let third = c.claim_hash(&key, &hash(&[("owner", "c")]), LONG).await?;
    if third <= second {
        return Err(ConformanceError::Violated {
            check: CHECK,
            detail: format!("token {third} after {second} and a delete"),
        });
    }
    c.delete(&key).await?;
    Ok(())
}

/// `publish` says how many listeners got the message: none on a silent channel, at least
/// one while someone subscribes, none again once every subscriber dropped its receiver.
pub async fn publish_counts_its_listeners(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "publish_counts_its_listeners";
    let channel = format!("{prefix}count");
    expect_eq(CHECK, c.publish(&channel, b"nobody".to_vec()).await?, 0)?;
    let mut rx = c.subscribe(&channel).await?;
    let heard = c.publish(&channel, b"one".to_vec()).await?;
    if heard == 0 {
        return Err(ConformanceError::Violated {
            check: CHECK,
            detail: "a subscribed channel counted no listener".to_owned(),
        });
    }
    expect_eq(CHECK, next_message(CHECK, &mut rx).await?, b"one".to_vec())?;
    drop(rx);
    // Unsubscribing is asynchronous on a real server: wait until it took effect.
    let mut heard = usize::MAX;
    for _ in 0..50 {
        heard = c.publish(&channel, b"gone".to_vec()).await?;
        if heard == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    expect_eq(CHECK, heard, 0)
}

/// A hash is gone once its TTL passes; each write restarts the TTL (a heartbeat keeps a
/// node alive).
pub async fn hash_expiry(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "hash_expiry";
    let key = format!("{prefix}hash:exp");
    let fields = hash(&[("owner", "replica-1")]);

    c.put_hash(&key, &fields, SHORT).await?;
    expect_eq(CHECK, c.get_hash(&key).await?, Some(fields.clone()))?;
    tokio::time::sleep(PAST).await;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;

    c.put_hash(&key, &fields, MEDIUM).await?;
    tokio::time::sleep(HALF).await;
    c.put_hash(&key, &fields, MEDIUM).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 500 ms after the first write: alive only because the second write restarted the TTL.
    expect_eq(CHECK, c.get_hash(&key).await?, Some(fields))?;
    tokio::time::sleep(PAST).await;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;
    Ok(())
}

/// One holder at a time; renewal by the holder keeps the token and extends the lease.
pub async fn lease_exclusive_and_renew(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "lease_exclusive_and_renew";
    let name = format!("{prefix}lease:renew");

    let t1 = granted(CHECK, c.acquire_lease(&name, "a", MEDIUM).await?)?;
    expect_eq(CHECK, c.acquire_lease(&name, "b", MEDIUM).await?, None)?;

    tokio::time::sleep(HALF).await;
    expect_eq(CHECK, c.acquire_lease(&name, "a", MEDIUM).await?, Some(t1))?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 500 ms after the first acquisition: still held thanks to the renewal.
    expect_eq(CHECK, c.acquire_lease(&name, "b", MEDIUM).await?, None)?;

    tokio::time::sleep(PAST).await;
    let t2 = granted(CHECK, c.acquire_lease(&name, "b", MEDIUM).await?)?;
    expect(CHECK, t2 > t1, || {
        format!("new holder got token {t2}, not above {t1}")
    })?;
    c.release_lease(&name, "b").await?;
    Ok(())
}

/// An expired lease goes to the next asker with a larger token; the old holder, coming back,
/// is refused.
pub async fn lease_takeover_after_expiry(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "lease_takeover_after_expiry";
    let name = format!("{prefix}lease:takeover");

    let t1 = granted(CHECK, c.acquire_lease(&name, "a", SHORT).await?)?;
    expect_eq(CHECK, c.acquire_lease(&name, "b", SHORT).await?, None)?;
    tokio::time::sleep(PAST).await;

    let t2 = granted(CHECK, c.acquire_lease(&name, "b", LONG).await?)?;
    expect(CHECK, t2 > t1, || {
        format!("takeover token {t2} not above {t1}")
    })?;
    expect_eq(CHECK, c.acquire_lease(&name, "a", LONG).await?, None)?;
    c.release_lease(&name, "b").await?;
    Ok(())
}

/// Only the holder can release; after a release the next holder (even the same owner
/// again) gets a larger token.
pub async fn lease_release(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "lease_release";
    let name = format!("{prefix}lease:release");

    // Releasing what nobody holds is harmless.
    c.release_lease(&name, "a").await?;

    let t1 = granted(CHECK, c.acquire_lease(&name, "a", LONG).await?)?;
    c.release_lease(&name, "b").await?;
    expect_eq(CHECK, c.acquire_lease(&name, "b", LONG).await?, None)?;

    expect_eq(CHECK, c.lease_holder(&name).await?, Some("a".to_owned()))?;
    c.release_lease(&name, "a").await?;
    expect_eq(CHECK, c.lease_holder(&name).await?, None)?;
    let t2 = granted(CHECK, c.acquire_lease(&name, "b", LONG).await?)?;
    expect(CHECK, t2 > t1, || format!("token {t2} not above {t1}"))?;
    expect_eq(CHECK, c.lease_holder(&name).await?, Some("b".to_owned()))?;

    c.release_lease(&name, "b").await?;
    let t3 = granted(CHECK, c.acquire_lease(&name, "b", LONG).await?)?;
    expect(CHECK, t3 > t2, || {
        format!("re-acquisition after release got {t3}, not above {t2}")
    })?;
    c.release_lease(&name, "b").await?;
    Ok(())
}

/// Tokens keep increasing across many holders, and deleting the lease key does not reset
/// them (a fenced-out holder must stay fenced out).
pub async fn lease_tokens_survive_delete(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "lease_tokens_survive_delete";
    let name = format!("{prefix}lease:fence");

    let mut last = granted(CHECK, c.acquire_lease(&name, "owner-0", LONG).await?)?;
    for i in 1..10 {
        if i % 2 == 0 {
            c.delete(&name).await?;
        } else {
            c.release_lease(&name, &format!("owner-{}", i - 1)).await?;
        }
        let next = granted(
            CHECK,
            c.acquire_lease(&name, &format!("owner-{i}"), LONG).await?,
        )?;
        expect(CHECK, next > last, || {
            format!("holder {i} got token {next}, not above {last}")
        })?;
        last = next;
    }
    c.delete(&name).await?;
    Ok(())
}

/// The store loses everything (a Redis without persistence restarted, a node replaced):
/// every token issued afterwards, a lease's or a claimed hash's, is above every token issued
/// before — replicas remember those, and would refuse a new owner's messages as old for
/// good — and the holder of a claimed hash that nobody claimed since may still refresh it,
/// while a later claim still fences it out. `lose` empties the store the caller's way.
pub async fn tokens_survive_losing_everything<F, Fut>(
    c: &dyn Coordinator,
    prefix: &str,
    lose: F,
) -> Outcome
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    const CHECK: &str = "tokens_survive_losing_everything";
    let lease = format!("{prefix}lease:amnesia");
    let key = format!("{prefix}hash:amnesia");
    let mut before = 0;
    for i in 0..3 {
        let holder = format!("owner-{i}");
        before = granted(CHECK, c.acquire_lease(&lease, &holder, LONG).await?)?;
        c.release_lease(&lease, &holder).await?;
    }
    before = before.max(granted(
        CHECK,
        c.acquire_lease(&lease, "held", LONG).await?,
    )?);
    c.claim_hash(&key, &hash(&[("owner", "a")]), LONG).await?;
    let held = c.claim_hash(&key, &hash(&[("owner", "b")]), LONG).await?;
    before = before.max(held);

    lose().await;
    expect_eq(CHECK, c.get_hash(&key).await?, None)?;
    expect_eq(CHECK, c.lease_holder(&lease).await?, None)?;
    // The holder of the claim refreshes it: nobody claimed it since.
    expect_eq(
        CHECK,
        c.put_hash_fenced(&key, &hash(&[("owner", "b")]), held, LONG)
            .await?,
        true,
    )?;
    let claimed = c.claim_hash(&key, &hash(&[("owner", "c")]), LONG).await?;
    expect(CHECK, claimed > before, || {
        format!("a claim after the loss got {claimed}, not above {before}")
    })?;
    expect_eq(
        CHECK,
        c.put_hash_fenced(&key, &hash(&[("owner", "b")]), held, LONG)
            .await?,
        false,
    )?;
    let taken = granted(CHECK, c.acquire_lease(&lease, "after", LONG).await?)?;
    expect(CHECK, taken > before, || {
        format!("a lease after the loss got {taken}, not above {before}")
    })?;
    c.release_lease(&lease, "after").await?;
    c.delete(&key).await?;
    Ok(())
}

/// `incr` adds (also negative amounts), starts from zero, and keeps the expiry it got at
/// creation: a fixed window ends on time however often it is hit.
pub async fn counter_sums_and_keeps_first_expiry(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "counter_sums_and_keeps_first_expiry";
    let key = format!("{prefix}ctr:window");
    let other = format!("{prefix}ctr:other");

    expect_eq(CHECK, c.incr(&key, 1, MEDIUM).await?, 1)?;
    expect_eq(CHECK, c.incr(&key, 5, MEDIUM).await?, 6)?;
    expect_eq(CHECK, c.incr(&key, -2, MEDIUM).await?, 4)?;
    expect_eq(CHECK, c.incr(&other, 7, LONG).await?, 7)?;

    tokio::time::sleep(HALF).await;
    expect_eq(CHECK, c.incr(&key, 1, MEDIUM).await?, 5)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 500 ms after creation: a TTL of 400 ms from the first write has run out, although
    // the last write was only 300 ms ago.
    expect_eq(CHECK, c.incr(&key, 1, MEDIUM).await?, 1)?;
    expect_eq(CHECK, c.incr(&other, 0, LONG).await?, 7)?;

    c.delete(&key).await?;
    c.delete(&other).await?;
    Ok(())
}

/// Messages arrive in publish order; a subscriber sees only what was published after it
/// subscribed; channels are separate.
pub async fn pubsub_order_and_late_subscribers(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "pubsub_order_and_late_subscribers";
    let channel = format!("{prefix}ch:order");
    let elsewhere = format!("{prefix}ch:elsewhere");

    // Publishing with nobody listening is fine and reaches nobody later.
    c.publish(&channel, b"before".to_vec()).await?;

    let mut early = c.subscribe(&channel).await?;
    let mut other = c.subscribe(&elsewhere).await?;
    for i in 0..100 {
        c.publish(&channel, format!("m{i}").into_bytes()).await?;
    }
    for i in 0..100 {
        let got = next_message(CHECK, &mut early).await?;
        expect_eq(CHECK, got, format!("m{i}").into_bytes())?;
    }

    let mut late = c.subscribe(&channel).await?;
    c.publish(&channel, b"late".to_vec()).await?;
    c.publish(&elsewhere, b"other".to_vec()).await?;
    expect_eq(
        CHECK,
        next_message(CHECK, &mut early).await?,
        b"late".to_vec(),
    )?;
    expect_eq(
        CHECK,
        next_message(CHECK, &mut late).await?,
        b"late".to_vec(),
    )?;
    expect_eq(
        CHECK,
        next_message(CHECK, &mut other).await?,
        b"other".to_vec(),
    )?;
    Ok(())
}

/// Every live subscriber gets every message, in order; a dropped subscriber harms nobody.
pub async fn pubsub_fans_out_and_survives_dropped_subscribers(
    c: &dyn Coordinator,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "pubsub_fans_out_and_survives_dropped_subscribers";
    let channel = format!("{prefix}ch:fanout");

    let mut first = c.subscribe(&channel).await?;
    let dropped = c.subscribe(&channel).await?;
    let mut third = c.subscribe(&channel).await?;
    drop(dropped);

    for i in 0..20 {
        c.publish(&channel, format!("f{i}").into_bytes()).await?;
    }
    for rx in [&mut first, &mut third] {
        for i in 0..20 {
            let got = next_message(CHECK, rx).await?;
            expect_eq(CHECK, got, format!("f{i}").into_bytes())?;
        }
    }

    drop(first);
    drop(third);
    // Nobody left: publishing still succeeds.
    c.publish(&channel, b"void".to_vec()).await?;
    Ok(())
}

/// A subscriber joining a channel that already has a subscriber sees nothing published
/// before it subscribed, even messages not yet delivered to the earlier subscriber.
pub async fn pubsub_late_subscriber_on_a_busy_channel(
    c: &dyn Coordinator,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "pubsub_late_subscriber_on_a_busy_channel";
    let channel = format!("{prefix}ch:busy");

    let mut early = c.subscribe(&channel).await?;
    for i in 0..200 {
        c.publish(&channel, format!("b{i}").into_bytes()).await?;
    }
    // Nothing read yet: the burst may still be on its way to `early`.
    let mut late = c.subscribe(&channel).await?;
    c.publish(&channel, b"after".to_vec()).await?;

    expect_eq(
        CHECK,
        next_message(CHECK, &mut late).await?,
        b"after".to_vec(),
    )?;
    for i in 0..200 {
        let got = next_message(CHECK, &mut early).await?;
        expect_eq(CHECK, got, format!("b{i}").into_bytes())?;
    }
    expect_eq(
        CHECK,
        next_message(CHECK, &mut early).await?,
        b"after".to_vec(),
    )?;
    Ok(())
}

/// `delete` removes a hash, a counter or a lease alike; deleting nothing is fine.
pub async fn delete_removes_any_kind(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "delete_removes_any_kind";
    let h = format!("{prefix}del:hash");
    let n = format!("{prefix}del:ctr");
    let l = format!("{prefix}del:lease");

    c.delete(&format!("{prefix}del:missing")).await?;

    c.put_hash(&h, &hash(&[("f", "v")]), LONG).await?;
    c.incr(&n, 9, LONG).await?;
    granted(CHECK, c.acquire_lease(&l, "a", LONG).await?)?;

    c.delete(&h).await?;
    c.delete(&n).await?;
    c.delete(&l).await?;

    expect_eq(CHECK, c.get_hash(&h).await?, None)?;
    expect_eq(CHECK, c.incr(&n, 1, LONG).await?, 1)?;
    granted(CHECK, c.acquire_lease(&l, "b", LONG).await?)?;

    c.delete(&n).await?;
    c.delete(&l).await?;
    Ok(())
}

/// Hashes and counters share one keyspace: reading a counter as a hash, or counting on a
/// hash, is an error (Redis's WRONGTYPE), never a silent overwrite.
pub async fn wrong_kind_is_an_error(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "wrong_kind_is_an_error";
    let h = format!("{prefix}kind:hash");
    let n = format!("{prefix}kind:ctr");
    let fields = hash(&[("f", "v")]);

    c.put_hash(&h, &fields, LONG).await?;
    c.incr(&n, 1, LONG).await?;

    expect(CHECK, c.incr(&h, 1, LONG).await.is_err(), || {
        "incr on a hash succeeded".to_owned()
    })?;
    expect(CHECK, c.get_hash(&n).await.is_err(), || {
        "get_hash on a counter succeeded".to_owned()
    })?;
    // The failed calls changed nothing.
    expect_eq(CHECK, c.get_hash(&h).await?, Some(fields))?;
    expect_eq(CHECK, c.incr(&n, 0, LONG).await?, 1)?;

    c.delete(&h).await?;
    c.delete(&n).await?;
    Ok(())
}

/// Leases share the keyspace too: a lease is neither a hash nor a counter, a hash or a
/// counter is no lease, and `put_hash` over a lease replaces it without resetting its fence.
pub async fn leases_and_other_kinds_do_not_mix(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "leases_and_other_kinds_do_not_mix";
    let l = format!("{prefix}mix:lease");
    let h = format!("{prefix}mix:hash");
    let n = format!("{prefix}mix:ctr");
    let fields = hash(&[("f", "v")]);

    let t1 = granted(CHECK, c.acquire_lease(&l, "a", LONG).await?)?;
    c.put_hash(&h, &fields, LONG).await?;
    c.incr(&n, 3, LONG).await?;

    expect(CHECK, c.get_hash(&l).await.is_err(), || {
        "get_hash on a lease succeeded".to_owned()
    })?;
    expect(CHECK, c.incr(&l, 1, LONG).await.is_err(), || {
        "incr on a lease succeeded".to_owned()
    })?;
    expect(CHECK, c.acquire_lease(&h, "a", LONG).await.is_err(), || {
        "acquire_lease on a hash succeeded".to_owned()
    })?;
    expect(CHECK, c.acquire_lease(&n, "a", LONG).await.is_err(), || {
        "acquire_lease on a counter succeeded".to_owned()
    })?;
    expect(CHECK, c.release_lease(&n, "a").await.is_err(), || {
        "release_lease on a counter succeeded".to_owned()
    })?;
    // The failed calls changed nothing.
    expect_eq(CHECK, c.acquire_lease(&l, "a", LONG).await?, Some(t1))?;
    expect_eq(CHECK, c.get_hash(&h).await?, Some(fields.clone()))?;
    expect_eq(CHECK, c.incr(&n, 0, LONG).await?, 3)?;

    // Overwritten by a hash, the lease is gone; once the hash goes too, the next holder's
    // token is still above the overwritten one.
    c.put_hash(&l, &fields, LONG).await?;
    expect_eq(CHECK, c.get_hash(&l).await?, Some(fields))?;
    c.delete(&l).await?;
    let t2 = granted(CHECK, c.acquire_lease(&l, "b", LONG).await?)?;
    expect(CHECK, t2 > t1, || {
        format!("token {t2} after an overwrite not above {t1}")
    })?;

    c.delete(&l).await?;
    c.delete(&h).await?;
    c.delete(&n).await?;
    Ok(())
}

/// A bounded set admits `limit` members, renews a present one, frees a released place, and
/// drops members whose time ran out (a crashed holder cannot keep a place).
pub async fn slots_bound_renew_release_and_expire(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "slots";
    let key = format!("{prefix}slots");
    let ttl = Duration::from_secs(60);
    let at = 1_000_000;
    for m in ["a", "b"] {
        let v = c.acquire_slot(&key, m, 2, at, ttl).await?;
        expect(CHECK, v.admitted, || format!("{m} refused below the limit"))?;
    }
    let full = c.acquire_slot(&key, "c", 2, at + 10, ttl).await?;
    expect_eq(CHECK, (full.admitted, full.count), (false, 2))?;
    expect_eq(CHECK, full.wait_ms, 59_990)?;
    let again = c.acquire_slot(&key, "a", 2, at + 20, ttl).await?;
    expect(CHECK, again.admitted, || {
        "a present member is renewed".into()
    })?;
    c.release_slot(&key, "b").await?;
    let freed = c.acquire_slot(&key, "c", 2, at + 30, ttl).await?;
    expect(CHECK, freed.admitted, || "a released place is free".into())?;
    let later = at + 61_000;
    let expired = c.acquire_slot(&key, "d", 2, later, ttl).await?;
    expect_eq(CHECK, (expired.admitted, expired.count), (true, 1))?;
    c.delete(&key).await.map_err(ConformanceError::from)
}

/// The sliding window admits `limit` per window, refuses the next with the wait until the
/// oldest leaves, and admits again exactly when it has left.
pub async fn sliding_window_is_exact_at_the_boundary(c: &dyn Coordinator, prefix: &str) -> Outcome {
    const CHECK: &str = "sliding_window";
    let key = format!("{prefix}window");
    let window = Duration::from_secs(60);
    let t0 = 5_000_000;
    for i in 0..3 {
        let v = c
            .window_admit(&key, &format!("r{i}"), t0 + i * 1000, window, 3)
            .await?;
        expect(CHECK, v.admitted, || {
            format!("request {i} refused below the limit")
        })?;
    }
    let refused = c.window_admit(&key, "r3", t0 + 59_999, window, 3).await?;
    expect_eq(CHECK, (refused.admitted, refused.wait_ms), (false, 1))?;
    let admitted = c.window_admit(&key, "r4", t0 + 60_000, window, 3).await?;
    expect(CHECK, admitted.admitted, || {
        "the oldest left the window at exactly 60 s".into()
    })?;
    expect_eq(CHECK, admitted.count, 3)?;
    c.delete(&key).await.map_err(ConformanceError::from)
}

fn numbered(events: &[(u64, Vec<u8>)]) -> Vec<(u64, String)> {
    events
        .iter()
        .map(|(n, e)| (*n, String::from_utf8_lossy(e).into_owned()))
        .collect()
}

fn payloads(from: u64, to: u64) -> Vec<Vec<u8>> {
    (from..to).map(|n| format!("e{n}").into_bytes()).collect()
}

/// A journal reads back in number order from any point, in pages of `max`; a repeated or
/// overlapping append adds only what is new; a gap stays visible; a missing journal reads
/// empty; it expires `ttl` after its last append; it is a kind of its own in the keyspace.
pub async fn journal_appends_in_order_skips_repeats_and_expires(
    c: &dyn Coordinator,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "journal_appends_in_order_skips_repeats_and_expires";
    let key = format!("{prefix}journal:a");
    let none = Duration::ZERO;
    expect_eq(CHECK, c.read_events(&key, None, 10, none).await?, vec![])?;
    c.append_events(&key, 0, payloads(0, 3), LONG).await?;
    // A retried batch overlapping what is there adds only 3 and 4.
    c.append_events(&key, 1, payloads(1, 5), LONG).await?;
    let want: Vec<(u64, String)> = (0..5).map(|n| (n, format!("e{n}"))).collect();
    expect_eq(
        CHECK,
        numbered(&c.read_events(&key, None, 100, none).await?),
        want.clone(),
    )?;
    expect_eq(
        CHECK,
        numbered(&c.read_events(&key, Some(1), 2, none).await?),
        want[2..4].to_vec(),
    )?;
    expect_eq(CHECK, c.read_events(&key, Some(4), 10, none).await?, vec![])?;
    // Binary-safe, and a gap (events never journaled) shows as a jump in numbers.
    c.append_events(&key, 7, vec![vec![0, 255, b'\n', 0]], LONG)
        .await?;
    expect_eq(
        CHECK,
        c.read_events(&key, Some(4), 10, none).await?,
        vec![(7, vec![0, 255, b'\n', 0])],
    )?;
    // Another kind at the key is an error both ways.
    let counter = format!("{prefix}journal:counter");
    c.incr(&counter, 1, LONG).await?;
    expect(
        CHECK,
        c.append_events(&counter, 0, payloads(0, 1), LONG)
            .await
            .is_err(),
        || "append on a counter succeeded".to_owned(),
    )?;
    expect(
        CHECK,
        c.read_events(&counter, None, 1, none).await.is_err(),
        || "read of a counter as a journal succeeded".to_owned(),
    )?;
    // Expiry counts from the last append.
    let short = format!("{prefix}journal:short");
    c.append_events(&short, 0, payloads(0, 1), MEDIUM).await?;
    tokio::time::sleep(HALF).await;
    c.append_events(&short, 1, payloads(1, 2), MEDIUM).await?;
    tokio::time::sleep(HALF).await;
    expect_eq(CHECK, c.read_events(&short, None, 10, none).await?.len(), 2)?;
    tokio::time::sleep(PAST).await;
    expect_eq(CHECK, c.read_events(&short, None, 10, none).await?, vec![])?;
    c.delete(&key).await?;
    c.delete(&counter).await?;
    expect_eq(CHECK, c.read_events(&key, None, 10, none).await?, vec![])?;
    Ok(())
}

/// A reader that is caught up waits for the next append and gets it at once; with nothing
/// appended it answers empty after `block`; a reader behind never waits.
pub async fn journal_reader_waits_for_the_next_append(
    c: &dyn Coordinator,
    prefix: &str,
) -> Outcome {
    const CHECK: &str = "journal_reader_waits_for_the_next_append";
    let key = format!("{prefix}journal:wait");
    c.append_events(&key, 0, payloads(0, 1), LONG).await?;
    // Nothing comes: empty after the block.
    let started = tokio::time::Instant::now();
    expect_eq(
        CHECK,
        c.read_events(&key, Some(0), 10, SHORT).await?,
        vec![],
    )?;
    expect(CHECK, started.elapsed() >= SHORT, || {
        format!("answered after {:?}, before the block", started.elapsed())
    })?;
    // Behind: answered without waiting for the long block.
    let behind = tokio::time::timeout(DELIVERY, c.read_events(&key, None, 10, LONG)).await;
    expect(CHECK, matches!(&behind, Ok(Ok(e)) if e.len() == 1), || {
        format!("a reader behind got {behind:?}")
    })?;
    // Caught up: woken by the append, long before its block of 30 s.
    let appender = async {
        tokio::time::sleep(HALF).await;
        c.append_events(&key, 1, payloads(1, 3), LONG).await
    };
    let reader = tokio::time::timeout(DELIVERY, c.read_events(&key, Some(0), 10, LONG));
    let (appended, read) = tokio::join!(appender, reader);
    appended?;
    let read = read.map_err(|_| ConformanceError::Violated {
        check: CHECK,
        detail: format!("no event within {DELIVERY:?}"),
    })??;
    expect_eq(
        CHECK,
        numbered(&read),
        vec![(1, "e1".to_owned()), (2, "e2".to_owned())],
    )?;
    c.delete(&key).await?;
    Ok(())
}
