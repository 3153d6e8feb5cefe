//! Deterministic simulation of the control plane (issue 14, item 3). Three replicas — the
//! actors a `switchyard serve` runs, with cluster-wide queue and budget ownership and the
//! node view — the coordinator and three node agents run as hosts of one turmoil simulation:
//! one thread, a simulated clock, a simulated network. Each seed draws a plan of requests
//! (teams, lengths, clients that hang up) and a schedule of faults (partitions between a
//! replica and the coordinator or between a node and the replicas, delayed links, replicas
//! and nodes crashed and restarted, the database away, Redis restarted empty, a replica
//! paused past its leases), and after every step of the simulation the books must balance;
//! at rest every client saw an end, no row is left reserved but those of a crashed replica's
//! clients (the sweeper's), every bill is what an engine produced and what the client was
//! streamed, and no node ran past its capacity. Once every fault has healed, a wave of
//! requests larger than the fleet must find every node's whole capacity usable within
//! [`CAPACITY_BACK_MS`] (each node running all its slots at some moment): no fault may
//! leave slots counted that nothing runs.
//!
//! A failing seed prints itself; `DST_SEED=n` replays exactly that seed, `DST_SEEDS=n`
//! runs more (the test command runs 200, in two halves at once; `DST_SEED_BASE` moves the
//! window). `DST_DEBUG=<request id>` replays with the actors' debug log and that request's
//! assignments, tokens and client events on stderr; `DST_NODE=<node id>` prints that node's
//! sessions and every assignment it starts and ends, beside every request issued and where.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod dst {
    pub mod agent;
    pub mod net;
    pub mod replica;
    pub mod world;
}

use std::sync::Arc;
use std::time::Duration;

use dst::agent::AgentSpec;
use dst::world::{Planned, Summary, World};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use switchyard::coord::MemoryCoordinator;
use switchyard_actors::tier::Tier;

const REPLICAS: [&str; 3] = ["r1", "r2", "r3"];
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Assignments a node runs at once.
const CAPACITY: u32 = 4;
/// Simulated time per step.
const TICK: Duration = Duration::from_millis(10);
/// Requests arrive and faults begin within this (ms).
const ACTIVE_MS: u64 = 15_000;
/// Every fault has healed by then.
const HEALED_MS: u64 = 25_000;
/// The wave that must fill every node arrives then, once every fault has healed and the
/// agents' reconnect backoff (2 s at most) and a lease (3 s) have passed.
const WAVE_MS: u64 = HEALED_MS + 5_000;
/// Requests of the wave: six times the fleet's slots, so that a node freeing a slot (an
/// agent picks each answer's length, some a token or two) has more to take, and the wave
/// lasts some 5 s: long enough for the owner to recall slots lent to a follower (grants
/// come back when something waits, at most once a renewal period).
const WAVE: usize = 6 * NODES.len() * CAPACITY as usize;
/// Every node runs its whole capacity within this of the wave.
const CAPACITY_BACK_MS: u64 = 10_000;
/// A run must have come to rest by then (the longest generation, the wait for its usage
/// and an agent's resend after the last fault); most do much sooner, and stop there.
const END_MS: u64 = 75_000;

/// A fault of the schedule.
#[derive(Debug, Clone)]
enum Fault {
    /// No traffic between the two hosts.
    Partition(String, String),
    /// Traffic again.
    Repair(String, String),
    /// Messages between them wait.
    Hold(String, String),
    /// And go.
    Release(String, String),
    /// The host stops (a replica's clients go with it).
    Crash(String),
    /// It starts again (a replica under a new id).
    Restart(String),
    /// The database refuses every call, or answers again.
    Database(bool),
    /// Redis goes down and loses everything it held (no persistence).
    RedisLost,
    /// Redis is back, empty.
    RedisBack,
    /// Every link of a replica holds its messages (the process stopped: a VM stall, a long
    /// pause); held past its leases.
    Pause(String),
    /// They flow again.
    Resume(String),
}

/// One seed's plan and faults.
#[derive(Debug)]
struct Scenario {
    plan: Vec<Planned>,
    faults: Vec<(u64, Fault)>,
}

fn scenario(seed: u64) -> Scenario {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Tiers from a stream of their own: each seed keeps the plan it had before tiers.
    let mut tiers = ChaCha8Rng::seed_from_u64(seed ^ 0x7135_7135);
    let requests = rng.random_range(20..=40);
    let mut plan: Vec<Planned> = (0..requests)
        .map(|i| Planned {
            id: format!("req-{seed}-{i}"),
            replica: REPLICAS[rng.random_range(0..REPLICAS.len())].to_owned(),
            at_ms: rng.random_range(500..ACTIVE_MS),
            team: if rng.random_bool(0.8) { 1 } else { 2 },
            tier: Tier::ALL[tiers.random_range(0..Tier::ALL.len())],
            max_tokens: rng.random_range(1..=40),
            abandon_after: rng.random_bool(0.1).then(|| rng.random_range(0..5)),
        })
        .collect();
    plan.sort_by_key(|p| p.at_ms);
    let mut faults = Vec::new();
    for _ in 0..rng.random_range(1..=4) {
        let at = rng.random_range(1_000..ACTIVE_MS);
        let lasts = rng.random_range(300..8_000);
        let until = (at + lasts).min(HEALED_MS);
        let replica = REPLICAS[rng.random_range(0..REPLICAS.len())].to_owned();
        let node = NODES[rng.random_range(0..NODES.len())].to_owned();
        let (start, end) = match rng.random_range(0..6) {
            0 => (
                Fault::Partition(replica.clone(), "redis".into()),
                Fault::Repair(replica, "redis".into()),
            ),
            1 => (
                Fault::Partition(node.clone(), replica.clone()),
                Fault::Repair(node, replica),
            ),
            2 => (
                Fault::Hold(replica.clone(), "redis".into()),
                Fault::Release(replica, "redis".into()),
            ),
            3 => (Fault::Crash(replica.clone()), Fault::Restart(replica)),
            4 => (Fault::Crash(node.clone()), Fault::Restart(node)),
            _ => (Fault::Database(false), Fault::Database(true)),
        };
        faults.push((at, start));
        faults.push((until, end));
    }
    if !REGRESSIONS.contains(&seed) {
        faults.extend(owner_faults(seed));
    }
    faults.sort_by_key(|(at, _)| *at);
    plan.extend(wave(seed));
    Scenario { plan, faults }
}

/// Half the seeds meet a fault of the cluster's own ownership: Redis restarted empty, or a
/// replica paused past its leases. Drawn from a stream of their own, so the other faults and
/// the plan of every seed stay what they were (the regressions replay theirs exactly, and
/// meet none).
fn owner_faults(seed: u64) -> Vec<(u64, Fault)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6f77_6e65_7273);
    if !rng.random_bool(0.5) {
        return Vec::new();
    }
    let at = rng.random_range(1_000..ACTIVE_MS);
    if rng.random_bool(0.5) {
        let until = (at + rng.random_range(300..4_000)).min(HEALED_MS);
        vec![(at, Fault::RedisLost), (until, Fault::RedisBack)]
    } else {
        let replica = REPLICAS[rng.random_range(0..REPLICAS.len())].to_owned();
        let until = (at + rng.random_range(4_000..10_000)).min(HEALED_MS);
        vec![
            (at, Fault::Pause(replica.clone())),
            (until, Fault::Resume(replica)),
        ]
    }
}

/// The wave at [`WAVE_MS`]: [`WAVE`] long requests of the rich team, over every replica.
fn wave(seed: u64) -> Vec<Planned> {
    (0..WAVE)
        .map(|i| Planned {
            id: format!("wave-{seed}-{i}"),
            replica: REPLICAS[i % REPLICAS.len()].to_owned(),
            at_ms: WAVE_MS,
            team: 1,
            tier: Tier::Default,
            max_tokens: 40,
            abandon_after: None,
        })
        .collect()
}

fn apply(sim: &mut turmoil::Sim<'_>, world: &World, coord: &MemoryCoordinator, fault: &Fault) {
    match fault {
        Fault::RedisLost => {
            sim.crash("redis");
            coord.lose_everything();
        }
        Fault::RedisBack => sim.bounce("redis"),
        Fault::Pause(r) => {
            for other in NODES.iter().chain(["redis"].iter()) {
                sim.hold(r.as_str(), *other);
            }
        }
        Fault::Resume(r) => {
            for other in NODES.iter().chain(["redis"].iter()) {
                sim.release(r.as_str(), *other);
            }
        }
        Fault::Partition(a, b) => sim.partition(a.as_str(), b.as_str()),
        Fault::Repair(a, b) => sim.repair(a.as_str(), b.as_str()),
        Fault::Hold(a, b) => sim.hold(a.as_str(), b.as_str()),
        Fault::Release(a, b) => sim.release(a.as_str(), b.as_str()),
        Fault::Crash(h) => {
            if sim.is_host_running(h.as_str()) {
                sim.crash(h.as_str());
                if h.starts_with('r') {
                    world.crashed(h);
                } else {
                    world.node_crashed(h);
                }
            }
        }
        Fault::Restart(h) => {
            if !sim.is_host_running(h.as_str()) {
                sim.bounce(h.as_str());
            }
        }
        Fault::Database(up) => world.ledger.set_unavailable(!up),
    }
}

/// Runs one seed: its summary and its fingerprint, or the first broken invariant.
fn run(seed: u64) -> Result<(Summary, String), String> {
    run_with(seed, true)
}

/// [`run`], with the agents' resending of unacked `done`s while connected on or off.
fn run_with(seed: u64, resend: bool) -> Result<(Summary, String), String> {
    if std::env::var("DST_DEBUG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("switchyard_actors=debug")
            .with_writer(std::io::stderr)
            .try_init();
    }
    let Scenario { plan, faults } = scenario(seed);
    let plan = Arc::new(plan);
    let world = Arc::new(World::new(CAPACITY));
    // Its tokens floored at the simulation's wall clock, as Redis floors them at its own.
    let coord = Arc::new(MemoryCoordinator::with_clock(Arc::new(
        dst::replica::SimClock,
    )));
    let redis = coord.clone();
    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_millis(END_MS + 10_000))
        .tick_duration(TICK)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(8))
        .rng_seed(seed)
        .build();
    sim.host("redis", move || dst::net::serve(coord.clone()));
    for r in REPLICAS {
        let (world, plan) = (world.clone(), plan.clone());
        sim.host(r, move || {
            dst::replica::run(r.to_owned(), world.clone(), plan.clone())
        });
    }
    for (i, n) in NODES.iter().enumerate() {
        let world = world.clone();
        // Each node prefers a different replica first.
        let mut replicas: Vec<String> = REPLICAS.iter().map(|r| (*r).to_owned()).collect();
        replicas.rotate_left(i);
        let spec = AgentSpec {
            node_id: (*n).to_owned(),
            model: dst::replica::MODEL.to_owned(),
            replicas,
            seed: seed ^ (i as u64 + 1),
            resend,
        };
        sim.host(*n, move || dst::agent::run(spec.clone(), world.clone()));
    }
    let mut faults = faults.into_iter().peekable();
    loop {
        let now = u64::try_from(sim.elapsed().as_millis()).unwrap_or(u64::MAX);
        while let Some((_, fault)) = faults.next_if(|(at, _)| *at <= now) {
            apply(&mut sim, &world, &redis, &fault);
        }
        sim.step()
            .map_err(|e| format!("the simulation failed at {now} ms: {e}"))?;
        world
            .check_step()
            .map_err(|e| format!("at {now} ms: {e}\nfaults: {:#?}", scenario(seed).faults))?;
        if now >= WAVE_MS {
            world.note_full(&NODES, now);
        }
        if now >= END_MS || (now > WAVE_MS && world.at_rest(&plan)) {
            break;
        }
    }
    let summary = world
        .check_end(&plan)
        .and_then(|s| {
            world
                .check_capacity_back(&NODES, WAVE_MS, CAPACITY_BACK_MS)
                .map(|()| s)
        })
        .map_err(|e| format!("{e}\nfaults: {:#?}", scenario(seed).faults))?;
    Ok((summary, world.fingerprint()))
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Seeds that once broke an invariant (each names what it found), run every time.
const REGRESSIONS: [u64; 15] = [
    // A resent `done` settled as an orphan while its relayed first copy awaited the ack of
    // a generation that lived on and fenced that attempt.
    217, 711,
    // A relayed `done` whose replica was lost without closing its connections, never
    // settled once resent copies followed the first forever.
    204, 706,
    // A `done` from a node's new connection, on another replica than its generation's,
    // settled there as an orphan while the live generation fenced that attempt and retried:
    // the retry's row was billed the fenced attempt's tokens.
    336, 640,
    // Chunks lost with a crashed owner, and the `done` resent on the node's new connection
    // finished the stream as if whole.
    517, 1093,
    // A partition left a node's connection half-open, and the simulated agent (which did not
    // ping, unlike the real one, and could block on a write forever) kept its `done` on it.
    1446, 523,
    // A replica's link to Redis stalled: the other replicas dropped the node whose socket
    // it held and forgot the slots counted there, and filled it from zero on its return
    // while the assignments relayed before the stall arrived and ran (5 on a node of 4).
    1170, 1307,
    // The same stall, with the node's generations told it was lost and their slots counted
    // free before their relayed `assign`s arrived: the node's socket now refuses an `assign`
    // past its capacity.
    1195, 1675, 2195,
];

/// The seeds of one half of the run: `DST_SEED` alone (in the first half), or `DST_SEEDS`
/// seeds (140 by default: the two halves take about a quarter of `scripts/test`'s 25
/// minutes on two cores) from `DST_SEED_BASE` (1), split in two halves that run at once,
/// the second with the [`REGRESSIONS`].
fn seeds(half: u64) -> Vec<u64> {
    if let Some(seed) = env_u64("DST_SEED") {
        return if half == 0 { vec![seed] } else { Vec::new() };
    }
    let base = env_u64("DST_SEED_BASE").unwrap_or(1);
    let count = env_u64("DST_SEEDS").unwrap_or(140);
    let mid = base + count / 2;
    if half == 0 {
        (base..mid).collect()
    } else {
        (mid..base + count).chain(REGRESSIONS).collect()
    }
}

fn check_seeds(half: u64) {
    let mut totals = Summary::default();
    for seed in seeds(half) {
        match run(seed) {
            Ok((s, _)) => totals.add(&s),
            Err(e) => panic!(
                "seed {seed} broke an invariant: {e}\nreplay: DST_SEED={seed} cargo nextest run --test dst"
            ),
        }
    }
    println!("{totals:#?}");
}

#[test]
fn seeds_keep_every_invariant_under_faults() {
    check_seeds(0);
}

#[test]
fn more_seeds_keep_every_invariant_under_faults() {
    check_seeds(1);
}

#[test]
fn a_seed_replays_exactly() {
    for seed in [3, 5, 7, 43] {
        let (_, first) = run(seed).unwrap();
        let (_, second) = run(seed).unwrap();
        assert_eq!(first, second, "seed {seed} ran differently twice");
    }
}

#[test]
fn the_invariants_catch_usage_a_connected_agent_never_sends_again() {
    // Seed 11 leaves a generation's `done` unacked, and an agent that resends only after a
    // reconnect never brings it back (about one seed in twelve meets this; which ones moves
    // whenever the simulated schedule does).
    let broken = run_with(11, false).expect_err("the lost usage is caught");
    assert!(
        broken.contains("row still reserved at rest after engines produced"),
        "{broken}"
    );
    run_with(11, true).expect("the resend settles it");
}
