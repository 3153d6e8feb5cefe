//! Every replica restarted at once with 200 agents connected (issue 13, item 5): three
//! `switchyard serve` processes are killed together and started again under new names, as a
//! deploy that lost its pods would. The agents reconnect with full-jitter backoff; each replica
//! accepts `RATE` registrations a second and answers the rest `rejected {retry_after_ms}`.
//! Every node comes back within a bound; no replica routes to a node before its agent has
//! registered again; the requests sent meanwhile complete or are refused before any output.
//! The replicas' CPU over the storm is printed (`--no-capture`): docs/capacity.md records it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use switchyard::config::Config;
use switchyard::node_agent::{self, AgentConfig, AgentStats};
use switchyard::sim::{SimConfig, SimServer};
use switchyard::store::{
    API_KEY_PREFIX, NODE_TOKEN_PREFIX, NewApiKey, display_prefix, hash_secret, new_secret,
};
use switchyard_actors::protocol::Location;
use tokio_util::sync::CancellationToken;

use super::{Process, chat, free_port, has_error_event, serve_process, wait_serving};
use crate::common::{clean_redis, drop_pg, fresh_pg, http, wait_for};

const AGENTS: usize = 200;
const REPLICAS: usize = 3;
const ENGINES: usize = 4;
/// Registrations each replica accepts a second (and at once, from idle).
const RATE: u32 = 20;

struct Agent {
    stats: Arc<AgentStats>,
    task: tokio::task::JoinHandle<()>,
}

/// CPU time, user plus system, of process `pid` so far, in seconds (Linux: `/proc`, 100
/// ticks a second).
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(close) = stat.rfind(')') else {
        return 0.0;
    };
    // After the command's closing parenthesis: state (field 3), …, utime (14), stime (15).
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) / 100.0
}

/// The node ids replica `base` shows `ready` in `GET /admin/nodes` (it routes to them).
async fn ready_on(base: &str, admin: &str) -> Option<BTreeSet<String>> {
    let body: Value = http()
        .get(format!("{base}/admin/nodes"))
        .bearer_auth(admin)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    Some(
        body["data"]
            .as_array()?
            .iter()
            .filter(|n| n["health"] == "ready")
            .filter_map(|n| n["node_id"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// How a request sent during the storm ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// `[DONE]`, no error event.
    Completed,
    /// Refused before any output (a 503 while no node serves the model yet, a 429).
    Refused(u16),
    /// Anything else: an error event in a stream, another status, no answer in time.
    Failed(String),
}

async fn request(url: String, key: String) -> Option<Outcome> {
    let sent = http()
        .post(url)
        .bearer_auth(key)
        .json(&chat(8))
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    // The replica is not listening yet: nothing was admitted.
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) if e.is_connect() => return None,
        Err(e) => return Some(Outcome::Failed(e.to_string())),
    };
    let status = resp.status().as_u16();
    let body = resp.text().await.unwrap_or_default();
    Some(match status {
        200 if body.contains("[DONE]") && !has_error_event(&body) => Outcome::Completed,
        503 | 429 => Outcome::Refused(status),
        _ => Outcome::Failed(format!("{status}: {body}")),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_replica_restarted_at_once_takes_its_nodes_back_at_the_registration_rate() {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swcl:{:08x}:", rand::random::<u32>());
    let admin = format!("adm-{:08x}", rand::random::<u32>());
    let store = switchyard::store::connect_store(&db_url).await.unwrap();
    store.migrate().await.unwrap();
    let team = store.create_team("storm").await.unwrap();
    store
        .add_credits(team.id, 1_000_000_000_000, "storm")
        .await
        .unwrap();
    let key = new_secret(API_KEY_PREFIX).unwrap();
    store
        .create_api_key(NewApiKey {
            team_id: team.id,
            hash: hash_secret(&key),
            prefix: display_prefix(&key),
            ..NewApiKey::default()
        })
        .await
        .unwrap();
    let config_file = std::env::temp_dir().join(format!(
        "switchyard-storm-{:08x}.toml",
        rand::random::<u32>()
    ));
    std::fs::write(
        &config_file,
        format!("[nodes]\nregistrations_per_second = {RATE}\n"),
    )
    .unwrap();
    let config_arg = config_file.to_str().unwrap().to_owned();
    let ports: Vec<u16> = (0..REPLICAS).map(|_| free_port()).collect();
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let start = |generation: &str| -> Vec<Process> {
        ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let name = format!("{generation}-{i}");
                let extra = ["--config", config_arg.as_str()];
                serve_process(&db_url, &prefix, *port, &admin, &name, &extra)
            })
            .collect()
    };
    let mut replicas = start("first");
    for url in &urls {
        wait_serving(url).await;
    }

    // 200 nodes, a third dialing each replica first, on four shared engines.
    let model = Config::default()
        .resolve_model("small")
        .unwrap()
        .name
        .clone();
    let mut engines = Vec::new();
    for _ in 0..ENGINES {
        let sim = SimConfig {
            model: model.clone(),
            time_scale: 10.0,
            ..SimConfig::default()
        };
        engines.push(SimServer::start(sim).await.unwrap());
    }
    let stop = CancellationToken::new();
    let mut agents = Vec::new();
    for i in 0..AGENTS {
        let node_id = format!("storm-{i:03}");
        let token = new_secret(NODE_TOKEN_PREFIX).unwrap();
        store
            .create_node(&node_id, "onprem", &hash_secret(&token))
            .await
            .unwrap();
        let servers: Vec<&str> = (0..REPLICAS)
            .map(|r| urls[(i + r) % REPLICAS].as_str())
            .collect();
        let mut agent = AgentConfig::new(
            servers.join(","),
            &node_id,
            token,
            engines[i % ENGINES].base_url(),
        );
        agent.location = Location::Onprem;
        agent.backoff_min = Duration::from_millis(100);
        agent.backoff_max = Duration::from_secs(2);
        agent.heartbeat_interval = Duration::from_secs(1);
        agent.seed = Some(i as u64);
        let stats = Arc::new(AgentStats::default());
        let task = tokio::spawn({
            let (stop, stats) = (stop.clone(), stats.clone());
            async move {
                let _ = node_agent::run_with_stats(agent, stop, stats).await;
            }
        });
        agents.push(Agent { stats, task });
    }
    let agents = Arc::new(agents);
    let all_routed = || {
        let (urls, admin) = (urls.clone(), admin.clone());
        move || {
            let (urls, admin) = (urls.clone(), admin.clone());
            async move {
                for url in &urls {
                    if ready_on(url, &admin).await.map(|r| r.len()) != Some(AGENTS) {
                        return false;
                    }
                }
                true
            }
        }
    };
    wait_for(
        Duration::from_secs(60),
        "every node routable on every replica",
        all_routed(),
    )
    .await;

    // Every replica dies at once, and comes back under a new name.
    for r in &mut replicas {
        let _ = r.0.kill();
    }
    for r in &mut replicas {
        r.kill();
    }
    let before: Vec<(u64, u64)> = agents
        .iter()
        .map(|a| (a.stats.registrations(), a.stats.rejections()))
        .collect();
    let restarted = Instant::now();
    let replicas = start("second");
    let pids: Vec<u32> = replicas.iter().map(|r| r.0.id()).collect();

    // Meanwhile: the replicas' CPU every 100 ms, a request every 50 ms through each replica in
    // turn, and which nodes each replica routes to.
    let done = CancellationToken::new();
    let cpu = tokio::spawn({
        let (done, pids) = (done.clone(), pids.clone());
        async move {
            let mut samples = Vec::new();
            while !done.is_cancelled() {
                let at = restarted.elapsed().as_secs_f64();
                samples.push((at, pids.iter().map(|p| cpu_secs(*p)).collect::<Vec<_>>()));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        }
    });
    let requests = tokio::spawn({
        let (done, urls, key) = (done.clone(), urls.clone(), key.clone());
        async move {
            let mut sent = Vec::new();
            let mut i = 0;
            while !done.is_cancelled() {
                let url = format!("{}/v1/chat/completions", urls[i % REPLICAS]);
                sent.push(tokio::spawn(request(url, key.clone())));
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let mut outcomes = Vec::new();
            for s in sent {
                if let Some(o) = s.await.unwrap() {
                    outcomes.push(o);
                }
            }
            outcomes
        }
    });
    // A node a replica shows ready is one it routes to: its agent must have registered again
    // (its `registered` frame is on its way when the replica starts routing, hence the second).
    let early = Arc::new(Mutex::new(Vec::<String>::new()));
    let watch = tokio::spawn({
        let (done, urls, admin, agents, early) = (
            done.clone(),
            urls.clone(),
            admin.clone(),
            agents.clone(),
            early.clone(),
        );
        let before = before.clone();
        async move {
            let mut checked = 0usize;
            let mut r = 0;
            while !done.is_cancelled() {
                if let Some(ready) = ready_on(&urls[r % REPLICAS], &admin).await {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    for node in ready {
                        let i: usize = node["storm-".len()..].parse().unwrap();
                        if agents[i].stats.registrations() <= before[i].0 {
                            early.lock().unwrap().push(node);
                        }
                        checked += 1;
                    }
                }
                r += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            checked
        }
    });

    let reregistered = {
        let agents = agents.clone();
        let before = before.clone();
        move || {
            let (agents, before) = (agents.clone(), before.clone());
            async move {
                agents
                    .iter()
                    .zip(&before)
                    .all(|(a, b)| a.stats.registrations() > b.0)
            }
        }
    };
    wait_for(
        Duration::from_secs(90),
        "every agent registered again",
        reregistered,
    )
    .await;
    let registered_after = restarted.elapsed();
    wait_for(
        Duration::from_secs(60),
        "every node routable on every restarted replica",
        all_routed(),
    )
    .await;
    let routed_after = restarted.elapsed();
    // A little more traffic on the converged cluster, then the tallies.
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.cancel();
    let samples = cpu.await.unwrap();
    let outcomes = requests.await.unwrap();
    let checked = watch.await.unwrap();

    let rejected: u64 = agents
        .iter()
        .zip(&before)
        .map(|(a, b)| a.stats.rejections() - b.1)
        .sum();
    let completed = outcomes
        .iter()
        .filter(|o| **o == Outcome::Completed)
        .count();
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Failed(_)))
        .collect();
    // CPU: each replica's total over the storm and its busiest second.
    let mut report = Vec::new();
    for r in 0..REPLICAS {
        let total = samples.last().map_or(0.0, |s| s.1[r]);
        let peak = samples
            .iter()
            .zip(samples.iter().skip(10))
            .map(|(a, b)| (b.1[r] - a.1[r]) / (b.0 - a.0))
            .fold(0.0, f64::max);
        report.push(format!(
            "replica {r}: {total:.2} CPU-s, peak {peak:.2} cores"
        ));
    }
    eprintln!(
        "storm: {AGENTS} agents, {REPLICAS} replicas at {RATE} registrations/s: all registered \
         {registered_after:?} and routed everywhere {routed_after:?} after the restart; \
         {rejected} registrations rejected; {} requests ({completed} completed); {checked} ready \
         nodes checked; {}",
        outcomes.len(),
        report.join("; ")
    );

    assert!(
        early.lock().unwrap().is_empty(),
        "routed before registering again: {:?}",
        early.lock().unwrap()
    );
    assert!(
        checked > 0,
        "no replica showed a ready node while the watch ran"
    );
    assert!(
        failed.is_empty(),
        "requests failed during the storm: {failed:?}"
    );
    assert!(completed > 0, "no request completed after the restart");
    // 200 agents arrive within a couple of seconds of the restart; three replicas accept at
    // most 3 × RATE at once and 3 × RATE a second after.
    assert!(rejected > 0, "the registration rate limit never answered");
    // No agent gave up.
    assert!(agents.iter().all(|a| !a.task.is_finished()));

    stop.cancel();
    drop(replicas);
    for e in engines {
        e.shutdown().await;
    }
    let _ = std::fs::remove_file(&config_file);
    drop_pg(&db_name).await;
    clean_redis(&prefix).await;
}
