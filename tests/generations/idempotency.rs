//! One logical generation per (principal, Idempotency-Key).

use std::time::Duration;

use serde_json::Value;
use switchyard::store::LedgerStatus;

use crate::harness::{Events, body, pg_fleet, until};

/// The seed scenario: the user sees the first words and clicks Stop; meanwhile their phone
/// retries the same request after a timeout; the node accepted it but its `accepted` frame
/// was lost. One generation, one message consumed, the retry sees the existing generation,
/// and the engine ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_after_the_first_words_a_retry_and_a_lost_accepted() {
    let f = pg_fleet(&[("small", 1)], 2.0, |_| {}).await;
    f.nodes[0].faults.drop_accepted(1);
    let request = body("Explain TCP congestion control.", 3000, true);

    let mut events = Events::new(f.submit("phone-1", &request).await);
    let (name, created) = events.next().await.unwrap();
    assert_eq!(name, "generation.created");
    assert_eq!(
        (created["sequence"].as_u64(), created["status"].as_str()),
        (Some(0), Some("queued"))
    );
    let id = created["generation_id"].as_str().unwrap().to_owned();
    let (name, first) = events.next().await.unwrap();
    assert_eq!(name, "generation.text.delta", "the first words");
    assert_eq!(first["sequence"], 1);
    assert_eq!(
        f.nodes[0].faults.pending_dropped_accepted(),
        0,
        "the node's `accepted` was dropped"
    );

    // The phone's retry, on a second connection, while it runs.
    let retry = f
        .submit(
            "phone-1",
            &body("Explain TCP congestion control.", 3000, false),
        )
        .await;
    assert_eq!(retry.status(), 409);
    let err: Value = retry.json().await.unwrap();
    assert_eq!(err["error"]["code"], "generation_in_progress");
    assert_eq!(err["error"]["details"]["generation_id"], id.as_str());
    assert_eq!(
        err["error"]["details"]["status"], "running",
        "the output proved it started"
    );

    // Stop.
    let (status, cancel) = f.cancel(&id).await;
    assert_eq!(
        (status, cancel["status"].as_str()),
        (202, Some("cancel_requested"))
    );
    let rest = events.rest().await;
    let (last, data) = rest.last().unwrap();
    assert_eq!(last, "generation.cancelled", "confirmed by the node");
    let sequences: Vec<u64> = rest
        .iter()
        .map(|(_, d)| d["sequence"].as_u64().unwrap())
        .collect();
    assert!(sequences.windows(2).all(|w| w[1] == w[0] + 1) && sequences[0] == 2);
    let output_tokens = data["usage"]["output_tokens"].as_u64().unwrap();
    assert!(output_tokens > 0 && output_tokens < 3000);

    let (status, doc) = f.get(&id).await;
    assert_eq!((status, doc["status"].as_str()), (200, Some("cancelled")));
    assert_eq!(doc["usage"]["output_tokens"], output_tokens);

    // Retrying the same key after the end returns the same generation, never a rerun.
    let again = f
        .submit(
            "phone-1",
            &body("Explain TCP congestion control.", 3000, false),
        )
        .await;
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(
        (again["id"].as_str(), again["status"].as_str()),
        (Some(id.as_str()), Some("cancelled"))
    );

    until(Duration::from_secs(5), "the engine to stop", || async {
        f.engine_running() == 0
    })
    .await;
    let input_tokens = doc["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input_tokens > 0);
    assert_eq!(
        f.engine_prompt_tokens(),
        input_tokens,
        "the engine ran it once"
    );
    let w = f.window().await;
    assert_eq!((w.used, w.reserved), (1, 0), "one message consumed");
    let row = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.completion_tokens),
        (LedgerStatus::Settled, output_tokens as i64)
    );
    f.stop().await;
}

/// 50 concurrent submissions with one key: with the same fingerprint, one generation; with
/// different ones, one generation and the rest `idempotency_conflict`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_submissions_make_one_generation() {
    let f = pg_fleet(&[("small", 1)], 20.0, |_| {}).await;
    let same = body("same words", 40, false);
    let answers = futures::future::join_all((0..50).map(|_| async {
        let resp = f.submit("same-key", &same).await;
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    }))
    .await;
    let mut ids = std::collections::BTreeSet::new();
    let mut ran = 0;
    for (status, v) in &answers {
        match status {
            200 => {
                ran += 1;
                ids.insert(v["id"].as_str().unwrap().to_owned());
            }
            409 => {
                assert_eq!(v["error"]["code"], "generation_in_progress");
                ids.insert(
                    v["error"]["details"]["generation_id"]
                        .as_str()
                        .unwrap()
                        .to_owned(),
                );
            }
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert_eq!(ids.len(), 1, "every answer names the one generation");
    assert!(ran >= 1, "the first submission ran");
    until(Duration::from_secs(10), "the generation to end", || async {
        f.engine_running() == 0
    })
    .await;
    assert_eq!(f.engine_requests(), 1);

    let answers = futures::future::join_all((0..50).map(|i| {
        let req = body(&format!("different words {i}"), 40, false);
        let f = &f;
        async move {
            let resp = f.submit("other-key", &req).await;
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    }))
    .await;
    let admitted = answers.iter().filter(|(s, _)| *s == 200).count();
    let conflicts = answers
        .iter()
        .filter(|(s, v)| *s == 409 && v["error"]["code"] == "idempotency_conflict")
        .count();
    assert_eq!((admitted, conflicts), (1, 49), "{answers:?}");
    until(Duration::from_secs(10), "the generation to end", || async {
        f.engine_requests() == 2
    })
    .await;
    let w = f.window().await;
    assert_eq!((w.used, w.reserved), (2, 0));
    f.stop().await;
}

/// The key is required, and a chat completion honours it the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_honour_an_idempotency_key() {
    let f = pg_fleet(&[("small", 1)], 20.0, |_| {}).await;
    let resp = crate::common::http()
        .post(f.url("/v1/generations"))
        .bearer_auth(&f.api_key)
        .json(&body("hi", 5, false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "Idempotency-Key is required");
    assert_eq!(f.engine_requests(), 0);

    let chat = serde_json::json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7});
    let send = || async {
        crate::common::http()
            .post(f.url("/v1/chat/completions"))
            .bearer_auth(&f.api_key)
            .header("idempotency-key", "chat-1")
            .json(&chat)
            .send()
            .await
            .unwrap()
    };
    let first: Value = send().await.json().await.unwrap();
    let second: Value = send().await.json().await.unwrap();
    assert_eq!(first["id"], second["id"]);
    assert_eq!(
        first["choices"][0]["message"]["content"],
        second["choices"][0]["message"]["content"]
    );
    assert_eq!(second["usage"]["completion_tokens"], 7);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(
        second["choices"][0]["finish_reason"], "length",
        "the replay keeps it"
    );
    assert_eq!(f.engine_requests(), 1, "the replay did not run the engine");
    let other = crate::common::http()
        .post(f.url("/v1/chat/completions"))
        .bearer_auth(&f.api_key)
        .header("idempotency-key", "chat-1")
        .json(&serde_json::json!({"model": "small", "messages": [{"role": "user", "content": "bye"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let (status, doc) = f.get(first["id"].as_str().unwrap()).await;
    assert_eq!((status, doc["status"].as_str()), (200, Some("completed")));
    f.stop().await;
}

/// Refused before anything ran (no node yet): the message goes back, the record is
/// `rejected`, and the same key is admitted again later as the same generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_admission_is_admitted_again_under_the_same_key() {
    let f = pg_fleet(&[], 20.0, |_| {}).await;
    let resp = f.submit("again", &body("hi", 3, false)).await;
    assert_eq!(resp.status(), 503);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "no_healthy_node");
    let id = err["error"]["details"]["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, doc) = f.get(&id).await;
    assert_eq!((status, doc["status"].as_str()), (200, Some("rejected")));
    assert_eq!(doc["error"]["code"], "no_healthy_node");
    let w = f.window().await;
    assert_eq!((w.used, w.reserved), (0, 0), "the message was released");

    let config = switchyard::demo::FleetConfig {
        time_scale: 20.0,
        agent_backoff_min: Duration::from_millis(100),
        ..Default::default()
    };
    let mut node = f
        .add_node(&config, "small-late", "llama-3.1-8b-instruct")
        .await
        .unwrap();
    until(Duration::from_secs(10), "the node to register", || async {
        f.server.state().view.local_count() == 1
    })
    .await;
    let resp = f.submit("again", &body("hi", 3, false)).await;
    assert_eq!(resp.status(), 200);
    let doc: Value = resp.json().await.unwrap();
    assert_eq!(
        (doc["id"].as_str(), doc["status"].as_str()),
        (Some(id.as_str()), Some("completed"))
    );
    let w = f.window().await;
    assert_eq!((w.used, w.reserved), (1, 0));
    // The first admission's ledger row stays cancelled; the second has a row of its own.
    let first = f.store.ledger_row(&id).await.unwrap().unwrap();
    assert_eq!(first.status, LedgerStatus::Cancelled);
    node.stop_agent().await;
    node.sim.shutdown().await;
    f.stop().await;
}
