//! The queue's owner shares a saturated model fairly whatever replica the work enters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Cluster, chat, cluster};
use crate::common::http;

/// A key of a new team `name`.
async fn team_key(c: &Cluster, name: &str) -> String {
    crate::common::new_team_key(&c.url(0, ""), &c.fleet.admin_token, name).await
}

/// `clients` closed-loop clients of `key`, spread over `replicas`, until `end`: the requests
/// each completed.
fn flood(
    c: &Cluster,
    key: &str,
    replicas: &[usize],
    clients: usize,
    end: Instant,
) -> (Arc<AtomicU64>, Vec<tokio::task::JoinHandle<()>>) {
    let done = Arc::new(AtomicU64::new(0));
    let tasks = (0..clients)
        .map(|i| {
            let url = c.url(replicas[i % replicas.len()], "/v1/chat/completions");
            let (key, done) = (key.to_owned(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < end {
                    let resp = http()
                        .post(&url)
                        .bearer_auth(&key)
                        .json(&chat(8))
                        .send()
                        .await;
                    // Streamed: complete once the whole answer is read.
                    let Ok(resp) = resp else { continue };
                    let ok = resp.status() == 200;
                    let body = resp.text().await.unwrap_or_default();
                    if ok && body.contains("[DONE]") && Instant::now() < end {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    (done, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_teams_share_a_saturated_node_equally_whatever_replicas_they_enter() {
    // One node running two at once; a team with 20 clients entering two replicas, another
    // with 2 entering the third. First come, first served would give the small one about a
    // tenth of the completions; fair between teams, it gets about half.
    let c = cluster(3, 1, 1.0, |cfg| {
        for m in &mut cfg.server.models {
            m.node_concurrency = 2;
        }
    })
    .await;
    c.wait_queue_owner().await;
    let big = team_key(&c, "big").await;
    let small = team_key(&c, "small").await;
    let end = Instant::now() + Duration::from_secs(8);
    let (big_done, mut tasks) = flood(&c, &big, &[0, 1], 20, end);
    let (small_done, small_tasks) = flood(&c, &small, &[2], 2, end);
    tasks.extend(small_tasks);
    for t in tasks {
        t.await.unwrap();
    }
    let (b, s) = (
        big_done.load(Ordering::Relaxed),
        small_done.load(Ordering::Relaxed),
    );
    let share = s as f64 / (b + s) as f64;
    eprintln!("completions: big {b}, small {s} ({:.0} %)", share * 100.0);
    assert!(b + s >= 10, "the node served {b} + {s}");
    assert!(share >= 0.35, "the small team got {:.0} %", share * 100.0);
    c.stop().await;
}
