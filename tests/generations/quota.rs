//! The message quota (fixed UTC-aligned windows), the burst bucket and the concurrent
//! generations of a principal, admitted in one transaction with the request record.

use futures::StreamExt;
use serde_json::Value;
use switchyard::store::{LedgerStatus, NewApiKey, display_prefix, hash_secret, new_secret};

use crate::harness::{Events, PgFleet, body, pg_fleet, until};

async fn key(f: &PgFleet, template: NewApiKey) -> String {
    let secret = new_secret("sk-").unwrap();
    f.store
        .create_api_key(NewApiKey {
            team_id: f.team_id,
            hash: hash_secret(&secret),
            prefix: display_prefix(&secret),
            ..template
        })
        .await
        .unwrap();
    secret
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_concurrent_submissions_against_forty_messages_admit_exactly_forty() {
    let f = pg_fleet(&[("small", 1)], 20.0, |_| {}).await;
    let k = key(
        &f,
        NewApiKey {
            message_quota: Some(40),
            burst_capacity: Some(100),
            max_streams: Some(100),
            ..NewApiKey::default()
        },
    )
    .await;
    let answers = futures::future::join_all((0..60).map(|i| {
        let (f, k) = (&f, &k);
        async move {
            let resp = f
                .submit_as(k, &format!("m-{i}"), &body("one", 1, false))
                .await;
            let retry_after = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            (
                resp.status().as_u16(),
                retry_after,
                resp.json::<Value>().await.unwrap(),
            )
        }
    }))
    .await;
    let ok = answers.iter().filter(|(s, _, _)| *s == 200).count();
    let exhausted: Vec<_> = answers.iter().filter(|(s, _, _)| *s == 429).collect();
    assert_eq!((ok, exhausted.len()), (40, 20), "{answers:?}");
    let now = chrono::Utc::now();
    for (_, retry_after, v) in exhausted {
        let e = &v["error"];
        assert_eq!(e["code"], "quota_exhausted");
        assert_eq!(e["retryable"], false);
        assert_eq!(
            (
                e["details"]["limit"].as_u64(),
                e["details"]["remaining"].as_u64()
            ),
            (Some(40), Some(0))
        );
        let reset =
            chrono::DateTime::parse_from_rfc3339(e["details"]["reset_at"].as_str().unwrap())
                .unwrap();
        assert_eq!(
            reset.timestamp() % (3 * 3600),
            0,
            "UTC-aligned 3-hour windows"
        );
        assert!(reset > now && (reset.with_timezone(&chrono::Utc) - now).num_hours() < 3);
        let secs: i64 = retry_after.as_deref().unwrap().parse().unwrap();
        assert!(
            (secs - (reset.timestamp() - now.timestamp())).abs() <= 5,
            "Retry-After is the reset"
        );
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_burst_bucket_and_concurrent_generations_are_enforced() {
    let f = pg_fleet(&[("small", 1)], 5.0, |_| {}).await;
    let bursty = key(
        &f,
        NewApiKey {
            burst_capacity: Some(3),
            burst_refill_seconds: Some(30),
            max_streams: Some(10),
            ..NewApiKey::default()
        },
    )
    .await;
    for i in 0..3 {
        let resp = f
            .submit_as(&bursty, &format!("b-{i}"), &body("x", 1, false))
            .await;
        assert_eq!(resp.status(), 200);
    }
    let resp = f.submit_as(&bursty, "b-3", &body("x", 1, false)).await;
    assert_eq!(resp.status(), 429);
    let secs: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1..=30).contains(&secs),
        "a token is at most 30 s away: {secs}"
    );
    let v: Value = resp.json().await.unwrap();
    assert_eq!(
        (
            v["error"]["code"].as_str(),
            v["error"]["retryable"].as_bool()
        ),
        (Some("rate_limited"), Some(true))
    );

    // A key whose max_streams is 2 has 2 active generations.
    let two = key(
        &f,
        NewApiKey {
            max_streams: Some(2),
            ..NewApiKey::default()
        },
    )
    .await;
    let mut first = Events::new(f.submit_as(&two, "c-1", &body("long", 5000, true)).await);
    let mut second = Events::new(f.submit_as(&two, "c-2", &body("long", 5000, true)).await);
    let resp = f.submit_as(&two, "c-3", &body("long", 5000, true)).await;
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"));
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "concurrency_limited");
    // A refused submission left no record: the same key is admitted once a slot frees.
    let id = first.next().await.unwrap().1["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(f.cancel_as(&two, &id).await.0, 202);
    assert_eq!(first.rest().await.last().unwrap().0, "generation.cancelled");
    let third = f.submit_as(&two, "c-3", &body("short", 2, false)).await;
    assert_eq!(
        third.status(),
        200,
        "the slot came back after the confirmed stop"
    );
    let id2 = second.next().await.unwrap().1["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(f.cancel_as(&two, &id2).await.0, 202);
    second.rest().await;
    f.stop().await;
}

/// A metered principal's chat completions spend the same messages, with or without a key;
/// an unmetered key's chat completions create no record at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_share_the_message_quota() {
    let f = pg_fleet(&[("small", 1)], 20.0, |_| {}).await;
    let metered = key(
        &f,
        NewApiKey {
            message_quota: Some(2),
            ..NewApiKey::default()
        },
    )
    .await;
    let chat = |bearer: String, idem: Option<&'static str>| {
        let url = f.url("/v1/chat/completions");
        async move {
            let mut req = crate::common::http()
                .post(url)
                .bearer_auth(bearer)
                .json(&serde_json::json!({"model": "small", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}));
            if let Some(k) = idem {
                req = req.header("idempotency-key", k);
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let body = resp.json::<Value>().await.unwrap();
            // The completion's id (`x-request-id` names the HTTP request).
            let id = body["id"].as_str().map(str::to_owned);
            (status, id, body)
        }
    };
    let (s1, id1, _) = chat(metered.clone(), None).await;
    let (s2, _, _) = chat(metered.clone(), Some("with-key")).await;
    let (s3, _, err) = chat(metered.clone(), None).await;
    assert_eq!((s1, s2, s3), (200, 200, 429), "{err}");
    assert_eq!(err["error"]["code"], "quota_exhausted");
    // The keyless request has a record of its own, readable by its id.
    let resp = crate::common::http()
        .get(f.url(&format!("/v1/generations/{}", id1.unwrap())))
        .bearer_auth(&metered)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The fleet's key meters nothing: no record.
    let (s, id, _) = chat(f.api_key.clone(), None).await;
    assert_eq!(s, 200);
    assert!(
        f.store
            .get_generation(&id.unwrap())
            .await
            .unwrap()
            .is_none()
    );
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metered_chat_completion_its_client_abandons_stops_on_the_engine_at_once() {
    // A key with a burst bucket: its requests are admitted through a record, but a chat
    // completion without Idempotency-Key is one nobody can come back to.
    let f = pg_fleet(&[("small", 1)], 1.0, |_| {}).await;
    let k = key(
        &f,
        NewApiKey {
            burst_capacity: Some(100),
            ..NewApiKey::default()
        },
    )
    .await;
    let resp = crate::common::http()
        .post(f.url("/v1/chat/completions"))
        .bearer_auth(&k)
        .json(&serde_json::json!({
            "model": "small", "stream": true, "max_tokens": 2000,
            "messages": [{"role": "user", "content": "tell me a long story"}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    let chunks = |text: &str| -> Vec<Value> {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .collect()
    };
    let tokens = |text: &str| {
        chunks(text)
            .iter()
            .filter(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
            .count()
    };
    while tokens(&text) < 5 {
        let bytes = stream.next().await.unwrap().unwrap();
        text.push_str(&String::from_utf8_lossy(&bytes));
    }
    let id = chunks(&text)[0]["id"].as_str().unwrap().to_owned();
    drop(stream);
    let left = std::time::Instant::now();
    // With the 2 s cancel grace of a resumable generation it ran on; now it stops at once
    // (measured 0.03–0.05 s for a key without limits). 1 s keeps a busy machine out of it.
    until(
        std::time::Duration::from_secs(1),
        "the engine to stop the abandoned request",
        || async { f.engine_running() == 0 },
    )
    .await;
    eprintln!("engine idle {:?} after the client left", left.elapsed());
    let settled = std::time::Instant::now();
    let row = loop {
        let row = f.store.ledger_row(&id).await.unwrap();
        if let Some(row) = row.filter(|r| r.status == LedgerStatus::Settled) {
            break row;
        }
        assert!(
            settled.elapsed() < std::time::Duration::from_secs(10),
            "settled"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(
        (5..2000).contains(&row.completion_tokens),
        "billed for what was produced: {}",
        row.completion_tokens
    );
    f.stop().await;
}
