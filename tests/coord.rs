//! Integration tests of the coordination port: the conformance suite against the in-process
//! coordinator and against a real Redis (127.0.0.1:6379, or `SWITCHYARD_TEST_REDIS_URL`),
//! then what only Redis can show — two replicas contending, cross-instance pub/sub, timeouts
//! against a dead or partitioned server (through a pausable TCP proxy) and recovery. Every
//! test works under its own random key prefix and deletes its keys afterwards.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use redis::aio::MultiplexedConnection;
use tokio::net::TcpListener;
use tokio::time::Instant;

use switchyard::coord::{
    CoordError, Coordinator, DEFAULT_COMMAND_TIMEOUT, MemoryCoordinator, RedisCoordinator,
    RedisCoordinatorOptions, conformance, connect_coordinator,
};

#[path = "coord/proxy.rs"]
mod proxy;
use proxy::Proxy;

const REDIS_URL_ENV: &str = "SWITCHYARD_TEST_REDIS_URL";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Short timeouts for the partition tests, so they fail over quickly.
const FAST: RedisCoordinatorOptions = RedisCoordinatorOptions {
    command_timeout: Duration::from_millis(500),
    health_interval: Duration::from_millis(200),
};

fn redis_url() -> String {
    std::env::var(REDIS_URL_ENV).unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}

fn fields(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) -> Vec<u8> {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("no message within 5 s")
        .expect("subscription closed")
}

/// One test's namespace on the shared Redis.
#[derive(Clone)]
struct Ns {
    url: String,
    prefix: String,
}

impl Ns {
    fn new(test: &str) -> Self {
        Self {
            url: redis_url(),
            prefix: format!("swtest:{test}:{:016x}:", rand::random::<u64>()),
        }
    }

    fn unreachable(&self, e: &CoordError) -> ! {
        panic!(
            "Redis at {} is unreachable ({e}). These tests need a real Redis: start one \
             (`redis-server --port 6379 --save '' --daemonize yes`, see ../shared/NOTES.md) \
             or point {REDIS_URL_ENV} at one.",
            self.url
        )
    }

    /// A coordinator ("replica") on this namespace.
    async fn connect(&self) -> RedisCoordinator {
        RedisCoordinator::connect(&self.url, &self.prefix)
            .await
            .unwrap_or_else(|e| self.unreachable(&e))
    }

    /// A plain connection, to look at what the coordinator left in Redis.
    async fn raw(&self) -> MultiplexedConnection {
        let client = redis::Client::open(self.url.as_str()).unwrap();
        tokio::time::timeout(
            Duration::from_secs(2),
            client.get_multiplexed_async_connection(),
        )
        .await
        .expect("raw connection timed out")
        .unwrap()
    }

    /// Every key under the prefix (SCAN, never KEYS).
    async fn keys(&self, raw: &mut MultiplexedConnection) -> Vec<String> {
        let mut cursor = 0u64;
        let mut keys = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(raw)
                .await
                .unwrap();
            keys.extend(batch);
            if next == 0 {
                keys.sort();
                return keys;
            }
            cursor = next;
        }
    }

    /// Deletes the namespace's keys; best effort, a failure only leaves garbage behind.
    async fn cleanup(&self) {
        let work = async {
            let mut raw = self.raw().await;
            let keys = self.keys(&mut raw).await;
            for chunk in keys.chunks(500) {
                let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(&mut raw).await;
            }
        };
        // A panic here (Redis gone) must not hide the test's own outcome.
        let _ = tokio::time::timeout(
            Duration::from_secs(3),
            AssertUnwindSafe(work).catch_unwind(),
        )
        .await;
    }
}

/// Runs `body` in a fresh namespace and cleans it afterwards, whether `body` passed or not.
async fn in_namespace<F, Fut>(test: &str, body: F)
where
    F: FnOnce(Ns) -> Fut,
    Fut: Future<Output = ()>,
{
    let ns = Ns::new(test);
    let outcome = AssertUnwindSafe(body(ns.clone())).catch_unwind().await;
    ns.cleanup().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

// ---------------------------------------------------------------------------------------------
// The contract, against both implementations.

#[tokio::test(start_paused = true)]
async fn memory_passes_the_conformance_suite() {
    conformance::conformance_suite(&MemoryCoordinator::new(), "conf:")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test]
async fn redis_passes_the_conformance_suite() {
    in_namespace("conformance", |ns| async move {
        let c = ns.connect().await;
        conformance::conformance_suite(&c, "conf:")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    })
    .await;
}

#[tokio::test]
async fn memory_tokens_survive_losing_everything() {
    let c = MemoryCoordinator::new();
    conformance::tokens_survive_losing_everything(&c, "amnesia:", || async {
        c.lose_everything();
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Redis restarted empty, as far as one coordinator's keys go: every key of the namespace
/// deleted under it (the shared test Redis cannot be flushed).
#[tokio::test]
async fn redis_tokens_survive_losing_everything() {
    in_namespace("amnesia", |ns| async move {
        let c = ns.connect().await;
        let lose = || async {
            let mut raw = ns.raw().await;
            let keys = ns.keys(&mut raw).await;
            assert!(!keys.is_empty(), "the check wrote nothing to lose");
            let _: () = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut raw)
                .await
                .unwrap();
        };
        conformance::tokens_survive_losing_everything(&c, "amnesia:", lose)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    })
    .await;
}

#[tokio::test]
async fn connect_coordinator_picks_redis_when_given_a_url() {
    let memory = connect_coordinator(None, "ignored:").await.unwrap();
    memory
        .put_hash(
            "node:m",
            &fields(&[("owner", "r1")]),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(
        memory.get_hash("node:m").await.unwrap(),
        Some(fields(&[("owner", "r1")]))
    );

    in_namespace("factory", |ns| async move {
        let shared = connect_coordinator(Some(&ns.url), &ns.prefix)
            .await
            .unwrap_or_else(|e| ns.unreachable(&e));
        shared
            .put_hash(
                "node:r",
                &fields(&[("owner", "r2")]),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        // Another replica on the same prefix sees it: this one is Redis.
        let other = ns.connect().await;
        assert_eq!(
            other.get_hash("node:r").await.unwrap(),
            Some(fields(&[("owner", "r2")]))
        );
    })
    .await;

    let refused = connect_coordinator(Some("redis://127.0.0.1:1"), "x:").await;
    assert!(matches!(refused, Err(CoordError::Unavailable(_))));
}

// ---------------------------------------------------------------------------------------------
// Two replicas.

#[tokio::test]
async fn two_replicas_contending_for_a_lease_get_one_holder_and_rising_tokens() {
    in_namespace("lease", |ns| async move {
        let a = ns.connect().await;
        let b = ns.connect().await;
        let name = "lease:queue:llama";
        let long = Duration::from_secs(10);

        let mut last = 0;
        for round in 0..25 {
            let (ra, rb) = tokio::join!(
                a.acquire_lease(name, "replica-a", long),
                b.acquire_lease(name, "replica-b", long)
            );
            let (winner, owner, loser, loser_owner, token) = match (ra.unwrap(), rb.unwrap()) {
                (Some(t), None) => (&a, "replica-a", &b, "replica-b", t),
                (None, Some(t)) => (&b, "replica-b", &a, "replica-a", t),
                other => panic!("round {round}: both or neither got the lease: {other:?}"),
            };
            assert!(
                token > last,
                "round {round}: token {token} not above {last}"
            );
            last = token;
            // The loser can neither free nor take the lease; the winner renews its token.
            loser.release_lease(name, loser_owner).await.unwrap();
            assert_eq!(
                loser.acquire_lease(name, loser_owner, long).await.unwrap(),
                None
            );
            assert_eq!(
                winner.acquire_lease(name, owner, long).await.unwrap(),
                Some(token)
            );
            winner.release_lease(name, owner).await.unwrap();
        }

        // Takeover after the holder stops renewing: a larger token; the old holder, back
        // from a pause, is refused and cannot release its successor's lease.
        let ta = a
            .acquire_lease(name, "replica-a", Duration::from_millis(300))
            .await
            .unwrap()
            .unwrap();
        assert!(ta > last);
        assert_eq!(
            b.acquire_lease(name, "replica-b", long).await.unwrap(),
            None
        );
        tokio::time::sleep(Duration::from_millis(450)).await;
        let tb = b
            .acquire_lease(name, "replica-b", long)
            .await
            .unwrap()
            .expect("expired lease not taken over");
        assert!(tb > ta, "takeover token {tb} not above {ta}");
        assert_eq!(
            a.acquire_lease(name, "replica-a", long).await.unwrap(),
            None
        );
        a.release_lease(name, "replica-a").await.unwrap();
        assert_eq!(
            b.acquire_lease(name, "replica-b", long).await.unwrap(),
            Some(tb)
        );
    })
    .await;
}

#[tokio::test]
async fn a_subscriber_gets_a_thousand_messages_from_another_replica_in_order() {
    in_namespace("pubsub", |ns| async move {
        let a = ns.connect().await;
        let b = ns.connect().await;
        let mut rx = a.subscribe("node:n1").await.unwrap();
        let publisher = tokio::spawn(async move {
            for i in 0..1000 {
                b.publish("node:n1", format!("chunk-{i}").into_bytes())
                    .await
                    .unwrap();
            }
            b
        });
        for i in 0..1000 {
            assert_eq!(recv(&mut rx).await, format!("chunk-{i}").into_bytes());
        }
        let b = publisher.await.unwrap();
        // Nothing more, and the channel is not shared with another prefix.
        let elsewhere = RedisCoordinator::connect(&ns.url, &format!("{}other:", ns.prefix))
            .await
            .unwrap();
        elsewhere
            .publish("node:n1", b"foreign".to_vec())
            .await
            .unwrap();
        b.publish("node:n1", b"last".to_vec()).await.unwrap();
        assert_eq!(recv(&mut rx).await, b"last".to_vec());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_sees_nothing_published_before_it_subscribed() {
    in_namespace("late", |ns| async move {
        let a = ns.connect().await;
        let b = ns.connect().await;
        // A busy channel the connection already listens to: messages are always in flight
        // between Redis and the subscriber side when the late subscriber joins.
        let mut early = a.subscribe("node:busy").await.unwrap();
        let completed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            let (completed, stop) = (Arc::clone(&completed), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut seq = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    seq += 1;
                    b.publish("node:busy", seq.to_string().into_bytes())
                        .await
                        .unwrap();
                    completed.store(seq, Ordering::SeqCst);
                }
            })
        };
        let drain = tokio::spawn(async move { while early.recv().await.is_some() {} });

        for round in 0..30 {
            tokio::time::sleep(Duration::from_millis(3)).await;
            let published_before = completed.load(Ordering::SeqCst);
            let mut late = a.subscribe("node:busy").await.unwrap();
            let first: u64 = String::from_utf8(recv(&mut late).await)
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                first > published_before,
                "round {round}: got message {first}, published before subscribing \
                 (up to {published_before})"
            );
            // In order from there on.
            let second: u64 = String::from_utf8(recv(&mut late).await)
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(second, first + 1, "round {round}");
        }
        stop.store(true, Ordering::SeqCst);
        publisher.await.unwrap();
        drop(a);
        drain.await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn keys_live_under_the_prefix_and_prefixes_do_not_collide() {
    in_namespace("layout", |ns| async move {
        let c = ns.connect().await;
        let ttl = Duration::from_secs(30);
        c.put_hash("node:a", &fields(&[("owner", "r1")]), ttl)
            .await
            .unwrap();
        c.incr("rl:7:rpm", 2, ttl).await.unwrap();
        c.acquire_lease("lease:budget:3", "r1", ttl).await.unwrap();

        let mut raw = ns.raw().await;
        let p = &ns.prefix;
        assert_eq!(
            ns.keys(&mut raw).await,
            vec![
                format!("{p}f:lease:budget:3"),
                format!("{p}k:lease:budget:3"),
                format!("{p}k:node:a"),
                format!("{p}k:rl:7:rpm"),
            ]
        );
        let ttl_ms: i64 = redis::cmd("PTTL")
            .arg(format!("{p}k:node:a"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!((29_000..=30_000).contains(&ttl_ms), "PTTL {ttl_ms}");
        let fence_ttl: i64 = redis::cmd("PTTL")
            .arg(format!("{p}f:lease:budget:3"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(fence_ttl, -1, "a fencing counter must never expire");

        // A neighbour with a longer prefix sees none of it.
        let neighbour = RedisCoordinator::connect(&ns.url, &format!("{p}n:"))
            .await
            .unwrap();
        assert_eq!(neighbour.get_hash("node:a").await.unwrap(), None);
        assert_eq!(neighbour.incr("rl:7:rpm", 1, ttl).await.unwrap(), 1);
        // Its own counter: a fresh token, floored at Redis's clock, never the neighbour's
        // next one.
        let mine = raw_fence(&mut raw, &format!("{p}f:lease:budget:3")).await;
        let theirs = neighbour
            .acquire_lease("lease:budget:3", "r2", ttl)
            .await
            .unwrap()
            .unwrap();
        assert!(theirs > 0);
        assert_eq!(
            raw_fence(&mut raw, &format!("{p}f:lease:budget:3")).await,
            mine
        );
    })
    .await;
}

/// The fencing counter at `key`, read straight from Redis.
async fn raw_fence(raw: &mut MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("GET").arg(key).query_async(raw).await.unwrap()
}

#[tokio::test]
async fn foreign_values_are_errors_not_panics() {
    in_namespace("foreign", |ns| async move {
        let c = ns.connect().await;
        let mut raw = ns.raw().await;
        let p = &ns.prefix;
        let set = |key: &str, value: &str| {
            redis::cmd("SET")
                .arg(format!("{p}k:{key}"))
                .arg(value)
                .clone()
        };
        let _: () = set("garbage", "not a number")
            .query_async(&mut raw)
            .await
            .unwrap();
        let _: () = set("bad-lease", "lease:x:owner")
            .query_async(&mut raw)
            .await
            .unwrap();
        let _: () = set("huge-lease", "lease:99999999999999999999999:owner")
            .query_async(&mut raw)
            .await
            .unwrap();
        let _: () = redis::cmd("RPUSH")
            .arg(format!("{p}k:list"))
            .arg("x")
            .query_async(&mut raw)
            .await
            .unwrap();
        let ttl = Duration::from_secs(5);
        let unavailable = |r: Result<(), CoordError>| matches!(r, Err(CoordError::Unavailable(_)));

        assert!(unavailable(c.incr("garbage", 1, ttl).await.map(drop)));
        assert!(unavailable(
            c.acquire_lease("garbage", "a", ttl).await.map(drop)
        ));
        assert!(unavailable(
            c.acquire_lease("bad-lease", "a", ttl).await.map(drop)
        ));
        assert!(unavailable(c.release_lease("bad-lease", "a").await));
        assert!(unavailable(c.get_hash("list").await.map(drop)));
        assert!(unavailable(c.incr("list", 1, ttl).await.map(drop)));
        assert!(unavailable(
            c.acquire_lease("list", "a", ttl).await.map(drop)
        ));
        // Held by someone else, however absurd its token: refused, or an error; never a panic.
        let huge = c.acquire_lease("huge-lease", "a", ttl).await;
        assert!(
            matches!(huge, Ok(None) | Err(CoordError::Unavailable(_))),
            "{huge:?}"
        );
        assert!(c.acquire_lease("huge-lease", "owner", ttl).await.is_err());
        // A counter without expiry (written by something else) gets one.
        let _: () = set("eternal", "5").query_async(&mut raw).await.unwrap();
        assert_eq!(c.incr("eternal", 1, ttl).await.unwrap(), 6);
        let pttl: i64 = redis::cmd("PTTL")
            .arg(format!("{p}k:eternal"))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!((1..=5_000).contains(&pttl), "PTTL {pttl}");
        // Counters beyond 2^53 keep every digit (Lua numbers are doubles).
        let big = (1i64 << 53) + 1;
        assert_eq!(c.incr("big", big, ttl).await.unwrap(), big);
        assert_eq!(c.incr("big", 2, ttl).await.unwrap(), big + 2);
        assert!(c.incr("big", i64::MAX, ttl).await.is_err(), "overflow");
        assert_eq!(c.incr("big", 0, ttl).await.unwrap(), big + 2);
    })
    .await;
}

#[tokio::test]
async fn dropped_subscribers_release_the_redis_subscription() {
    in_namespace("unsub", |ns| async move {
        let c = ns.connect().await;
        let mut raw = ns.raw().await;
        let channel = format!("{}c:node:u", ns.prefix);
        let numsub = |raw: &mut MultiplexedConnection| {
            let mut raw = raw.clone();
            let channel = channel.clone();
            async move {
                let (_, n): (String, i64) = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(&channel)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                n
            }
        };

        let first = c.subscribe("node:u").await.unwrap();
        let mut second = c.subscribe("node:u").await.unwrap();
        assert_eq!(numsub(&mut raw).await, 1, "one connection serves both");
        drop(first);
        c.publish("node:u", b"still".to_vec()).await.unwrap();
        assert_eq!(recv(&mut second).await, b"still".to_vec());
        assert_eq!(numsub(&mut raw).await, 1);

        drop(second);
        let deadline = Instant::now() + Duration::from_secs(2);
        while numsub(&mut raw).await != 0 {
            assert!(
                Instant::now() < deadline,
                "still subscribed after the last drop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // And the channel works again for a new subscriber.
        let mut again = c.subscribe("node:u").await.unwrap();
        c.publish("node:u", b"again".to_vec()).await.unwrap();
        assert_eq!(recv(&mut again).await, b"again".to_vec());

        // Dropping the coordinator ends its subscriptions.
        drop(c);
        let end = tokio::time::timeout(Duration::from_secs(2), again.recv()).await;
        assert_eq!(end, Ok(None));
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// A dead, silent or partitioned Redis.

#[tokio::test]
async fn an_unreachable_redis_is_unavailable_within_the_timeout() {
    let started = Instant::now();
    let refused = RedisCoordinator::connect("redis://127.0.0.1:1", "x:").await;
    assert!(
        matches!(refused, Err(CoordError::Unavailable(_))),
        "{refused:?}"
    );
    assert!(
        started.elapsed() <= DEFAULT_COMMAND_TIMEOUT + Duration::from_millis(500),
        "took {:?}",
        started.elapsed()
    );

    // A server that accepts connections and never answers (a black hole).
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let started = Instant::now();
    let silent = RedisCoordinator::connect_with(&format!("redis://{addr}"), "x:", FAST).await;
    assert!(
        matches!(silent, Err(CoordError::Unavailable(_))),
        "{silent:?}"
    );
    // Connect is two steps (commands, then pub/sub), each bounded by the timeout.
    assert!(
        started.elapsed() <= 2 * FAST.command_timeout + Duration::from_millis(500),
        "took {:?}",
        started.elapsed()
    );
    holder.abort();
}

#[tokio::test]
async fn a_partition_fails_calls_fast_and_the_coordinator_recovers() {
    in_namespace("partition", |ns| async move {
        let proxy = Proxy::start(&ns.url).await;
        let c = RedisCoordinator::connect_with(&proxy.url, &ns.prefix, FAST)
            .await
            .unwrap_or_else(|e| ns.unreachable(&e));
        let direct = ns.connect().await;
        let node = fields(&[("owner", "r1")]);
        c.put_hash("node:p", &node, Duration::from_secs(30))
            .await
            .unwrap();
        let mut rx = c.subscribe("node:p").await.unwrap();

        proxy.pause(true);
        let started = Instant::now();
        let r = c.get_hash("node:p").await;
        assert!(matches!(r, Err(CoordError::Unavailable(_))), "{r:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took <= Duration::from_millis(1500),
            "partitioned call took {took:?}"
        );
        let started = Instant::now();
        let r = c
            .acquire_lease("lease:p", "r1", Duration::from_secs(5))
            .await;
        assert!(matches!(r, Err(CoordError::Unavailable(_))), "{r:?}");
        assert!(started.elapsed() <= Duration::from_millis(1500));
        // The pub/sub connection misses its ping: the subscriber learns it may miss messages.
        let closed = tokio::time::timeout(Duration::from_secs(3), rx.recv()).await;
        assert_eq!(closed, Ok(None), "subscription not closed by the partition");
        let started = Instant::now();
        assert!(c.subscribe("node:p").await.is_err());
        assert!(started.elapsed() <= Duration::from_millis(1500));

        proxy.pause(false);
        assert_eq!(c.get_hash("node:p").await.unwrap(), Some(node));
        let mut rx = c.subscribe("node:p").await.unwrap();
        direct.publish("node:p", b"healed".to_vec()).await.unwrap();
        assert_eq!(recv(&mut rx).await, b"healed".to_vec());
    })
    .await;
}

#[tokio::test]
async fn a_dropped_connection_closes_subscriptions_and_reconnects() {
    in_namespace("cut", |ns| async move {
        let proxy = Proxy::start(&ns.url).await;
        let c = RedisCoordinator::connect_with(&proxy.url, &ns.prefix, FAST)
            .await
            .unwrap_or_else(|e| ns.unreachable(&e));
        let direct = ns.connect().await;
        let mut rx = c.subscribe("node:c").await.unwrap();

        proxy.cut();
        let closed = tokio::time::timeout(Duration::from_secs(3), rx.recv()).await;
        assert_eq!(closed, Ok(None), "subscription not closed by the cut");

        // The command connection reconnects by itself: at most a call or two fail.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match c.incr("ctr:c", 1, Duration::from_secs(30)).await {
                Ok(_) => break,
                Err(e) => assert!(Instant::now() < deadline, "no recovery: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut rx = c.subscribe("node:c").await.unwrap();
        direct.publish("node:c", b"back".to_vec()).await.unwrap();
        assert_eq!(recv(&mut rx).await, b"back".to_vec());
    })
    .await;
}

#[tokio::test]
async fn a_half_open_connection_is_replaced_after_a_timeout() {
    in_namespace("half-open", |ns| async move {
        let proxy = Proxy::start(&ns.url).await;
        let c = RedisCoordinator::connect_with(&proxy.url, &ns.prefix, FAST)
            .await
            .unwrap_or_else(|e| ns.unreachable(&e));
        let direct = ns.connect().await;
        let node = fields(&[("owner", "r1")]);
        c.put_hash("node:h", &node, Duration::from_secs(30))
            .await
            .unwrap();
        let mut rx = c.subscribe("node:h").await.unwrap();

        // The sockets open now never carry another byte, yet never report an error.
        proxy.strand();
        let r = c.get_hash("node:h").await;
        assert!(matches!(r, Err(CoordError::Unavailable(_))), "{r:?}");
        // The timeout retired that connection: the next call gets a fresh one.
        assert_eq!(c.get_hash("node:h").await.unwrap(), Some(node));
        let closed = tokio::time::timeout(Duration::from_secs(3), rx.recv()).await;
        assert_eq!(closed, Ok(None), "stranded subscription not closed");
        let mut rx = c.subscribe("node:h").await.unwrap();
        direct.publish("node:h", b"fresh".to_vec()).await.unwrap();
        assert_eq!(recv(&mut rx).await, b"fresh".to_vec());
    })
    .await;
}
