//! Resumable streams (SPEC section 5): a generation's events are journaled through the
//! coordinator, so a client that lost its stream resumes it after its `Last-Event-ID` — on
//! the replica it started on or another one sharing PostgreSQL and Redis — and gets every
//! event once, in order; a reader that comes back within the cancel grace keeps the
//! generation running. Compared against an uninterrupted run of the same seeded simulator.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use switchyard::demo::{Fleet, FleetConfig};
use switchyard::server::Server;
use switchyard::store::{NewApiKey, display_prefix, hash_secret, new_secret};
use switchyard_actors::generation::GenEvent;
use switchyard_actors::generation::events::{Journal, JournalSpec, read_journal};
use switchyard_actors::ports::Coordinator;

use common::{clean_redis, drop_pg, fresh_pg, http, redis_url};

/// Two replicas on one PostgreSQL database and one Redis prefix; the simulated nodes dial
/// replica `a`, so every generation runs there.
struct TwoReplicas {
    a: Fleet,
    b: Server,
    db_name: String,
    prefix: String,
}

async fn two_replicas(cancel_grace_ms: u64) -> TwoReplicas {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swres:{:08x}:", rand::random::<u32>());
    let mut config = FleetConfig {
        nodes: vec![("small".to_owned(), 1)],
        time_scale: 1.0,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    config.server.timeouts.cancel_grace_ms = cancel_grace_ms;
    let server_b = config.server.clone();
    let a = Fleet::start(config, &db_url).await.unwrap();
    assert!(a.wait_registered(Duration::from_secs(10)).await);
    let store_b = switchyard::store::connect_store(&db_url).await.unwrap();
    let coord_b = switchyard::coord::connect_coordinator(Some(&redis_url()), &prefix)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let b = Server::start(server_b, store_b, coord_b, listener)
        .await
        .unwrap();
    TwoReplicas {
        a,
        b,
        db_name,
        prefix,
    }
}

impl TwoReplicas {
    async fn stop(self) {
        self.b.shutdown(Duration::from_secs(1)).await;
        self.a.shutdown(Duration::from_secs(2)).await;
        drop_pg(&self.db_name).await;
        clean_redis(&self.prefix).await;
    }

    fn url_a(&self, path: &str) -> String {
        format!("{}{path}", self.a.server.base_url())
    }

    fn url_b(&self, path: &str) -> String {
        format!("{}{path}", self.b.base_url())
    }
}

/// A seeded generation request: the simulator's text depends only on the seed and length.
fn body(max_output_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "small",
        "messages": [{"role": "user", "content": "Tell me about railway switchyards."}],
        "max_output_tokens": max_output_tokens,
        "seed": 7,
        "stream": stream,
    })
}

/// One SSE event as sent: its `id:`, its name (`event:`) and its `data:`.
#[derive(Debug, Clone, PartialEq)]
struct Frame {
    id: Option<u64>,
    name: Option<String>,
    data: String,
}

/// Reads SSE frames as they arrive.
struct Frames {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl Frames {
    fn new(resp: reqwest::Response) -> Self {
        assert_eq!(resp.status(), 200);
        Self {
            stream: resp.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    /// The next frame with data (comments skipped); `None` at EOF.
    async fn next(&mut self) -> Option<Frame> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let raw: String = self.buf.drain(..end + 2).collect();
                let mut frame = Frame {
                    id: None,
                    name: None,
                    data: String::new(),
                };
                for line in raw.lines() {
                    if let Some(v) = line.strip_prefix("id: ") {
                        frame.id = Some(v.parse().unwrap());
                    } else if let Some(v) = line.strip_prefix("event: ") {
                        frame.name = Some(v.to_owned());
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        frame.data.push_str(v);
                    }
                }
                if frame.data.is_empty() {
                    continue;
                }
                return Some(frame);
            }
            let chunk = tokio::time::timeout(Duration::from_secs(30), self.stream.next())
                .await
                .expect("an event within 30 s")?
                .ok()?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }

    async fn rest(&mut self) -> Vec<Frame> {
        let mut out = Vec::new();
        while let Some(f) = self.next().await {
            out.push(f);
        }
        out
    }
}

fn json_of(f: &Frame) -> Value {
    serde_json::from_str(&f.data).unwrap()
}

/// The text of Generations API frames.
fn text(frames: &[Frame]) -> String {
    frames
        .iter()
        .filter(|f| f.name.as_deref() == Some("generation.text.delta"))
        .map(|f| json_of(f)["delta"].as_str().unwrap().to_owned())
        .collect()
}

/// The text of chat completion chunks.
fn chat_text(frames: &[Frame]) -> String {
    frames
        .iter()
        .filter(|f| f.data != "[DONE]")
        .filter_map(|f| {
            json_of(f)["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

async fn submit(url: &str, bearer: &str, key: &str, body: &Value) -> reqwest::Response {
    http()
        .post(url)
        .bearer_auth(bearer)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap()
}

async fn events(url: &str, bearer: &str, last: Option<u64>) -> reqwest::Response {
    let mut req = http().get(url).bearer_auth(bearer);
    if let Some(last) = last {
        req = req.header("last-event-id", last.to_string());
    }
    req.send().await.unwrap()
}

/// Every frame is numbered by its `id:`, which is also its `sequence`, from 0 without a gap
/// or a repeat, and the stream ends with `generation.completed`.
fn assert_whole(frames: &[Frame]) {
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f.id, Some(i as u64), "frame {i}: {f:?}");
        assert_eq!(json_of(f)["sequence"], i as u64);
    }
    assert_eq!(
        frames.last().unwrap().name.as_deref(),
        Some("generation.completed")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_resumes_on_the_other_replica_with_every_event_once() {
    // A grace far shorter than the generation: only the reader's return keeps it running.
    let r = two_replicas(300).await;
    let key = &r.a.api_key;
    let generations_a = r.url_a("/v1/generations");

    let whole = Frames::new(submit(&generations_a, key, "whole", &body(120, true)).await)
        .rest()
        .await;
    assert_whole(&whole);
    let expected = text(&whole);
    assert!(!expected.is_empty());

    // The same generation, read for a few events and dropped mid-stream.
    let mut first = Frames::new(submit(&generations_a, key, "dropped", &body(120, true)).await);
    let mut seen = Vec::new();
    for _ in 0..6 {
        seen.push(first.next().await.unwrap());
    }
    drop(first);
    let id = json_of(&seen[0])["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let last = seen.last().unwrap().id.unwrap();

    // Resumed through replica b, after the last event seen; well past the grace.
    let path = format!("/v1/generations/{id}/events");
    let rest = Frames::new(events(&r.url_b(&path), key, Some(last)).await)
        .rest()
        .await;
    assert_eq!(rest[0].id, Some(last + 1), "nothing seen is sent again");
    let all: Vec<Frame> = seen.iter().chain(&rest).cloned().collect();
    assert_whole(&all);
    assert_eq!(
        text(&all),
        expected,
        "the same text as the uninterrupted run"
    );
    assert_eq!(
        json_of(all.last().unwrap())["usage"]["output_tokens"],
        120,
        "not cancelled: the reader came back within the grace"
    );
    let status: Value = http()
        .get(r.url_b(&format!("/v1/generations/{id}")))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["status"], "completed");

    // Within retention after the end: from any point, on either replica, and whole.
    let from_3 = Frames::new(events(&r.url_a(&path), key, Some(3)).await)
        .rest()
        .await;
    assert_eq!(from_3, all[4..].to_vec());
    let again = Frames::new(events(&r.url_b(&path), key, None).await)
        .rest()
        .await;
    assert_eq!(again, all);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_returning_reader_the_grace_still_cancels() {
    let r = two_replicas(300).await;
    let key = &r.a.api_key;
    let mut first =
        Frames::new(submit(&r.url_a("/v1/generations"), key, "gone", &body(400, true)).await);
    let created = first.next().await.unwrap();
    first.next().await.unwrap();
    drop(first);
    let id = json_of(&created)["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    // Read after the grace ran out: the journal holds the whole story, ending cancelled.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let path = format!("/v1/generations/{id}/events");
    let frames = Frames::new(events(&r.url_b(&path), key, None).await)
        .rest()
        .await;
    assert_eq!(
        frames.last().unwrap().name.as_deref(),
        Some("generation.cancelled")
    );
    let produced = json_of(frames.last().unwrap())["usage"]["output_tokens"]
        .as_u64()
        .unwrap();
    assert!(produced < 400, "cancelled early, {produced} tokens");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_may_read_the_events() {
    let r = two_replicas(2000).await;
    let key = &r.a.api_key;
    let resp = submit(&r.url_a("/v1/generations"), key, "mine", &body(5, false)).await;
    let doc: Value = resp.json().await.unwrap();
    let id = doc["id"].as_str().unwrap().to_owned();
    let secret = new_secret("sk-").unwrap();
    r.a.store
        .create_api_key(NewApiKey {
            team_id: r.a.team_id,
            hash: hash_secret(&secret),
            prefix: display_prefix(&secret),
            ..Default::default()
        })
        .await
        .unwrap();
    for base in [r.url_a(""), r.url_b("")] {
        let other = events(&format!("{base}/v1/generations/{id}/events"), &secret, None).await;
        assert_eq!(other.status(), 404);
        let unknown = events(&format!("{base}/v1/generations/gen_nope/events"), key, None).await;
        assert_eq!(unknown.status(), 404);
    }
    // The owner reads it; a Last-Event-ID that is no number is refused.
    let path = r.url_b(&format!("/v1/generations/{id}/events"));
    let frames = Frames::new(events(&path, key, None).await).rest().await;
    assert_whole(&frames);
    let bad = http()
        .get(&path)
        .bearer_auth(key)
        .header("last-event-id", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_completion_retried_with_its_key_mid_run_resumes() {
    let r = two_replicas(300).await;
    let key = &r.a.api_key;
    let chat = |stream: bool| {
        json!({
            "model": "small",
            "messages": [{"role": "user", "content": "Tell me about railway switchyards."}],
            "max_tokens": 100,
            "seed": 11,
            "stream": stream,
        })
    };
    let url_a = r.url_a("/v1/chat/completions");
    let whole = Frames::new(submit(&url_a, key, "chat-whole", &chat(true)).await)
        .rest()
        .await;
    assert_eq!(whole.last().unwrap().data, "[DONE]");
    let expected = chat_text(&whole);
    for (i, f) in whole.iter().enumerate() {
        assert_eq!(f.id, Some(i as u64), "a keyed chat stream is numbered");
    }

    let mut first = Frames::new(submit(&url_a, key, "chat-drop", &chat(true)).await);
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(first.next().await.unwrap());
    }
    drop(first);
    let last = seen.last().unwrap().id.unwrap();
    // The retry goes to replica b, with the same key and body and the last id seen.
    let retry = http()
        .post(r.url_b("/v1/chat/completions"))
        .bearer_auth(key)
        .header("idempotency-key", "chat-drop")
        .header("last-event-id", last.to_string())
        .json(&chat(true))
        .send()
        .await
        .unwrap();
    let rest = Frames::new(retry).rest().await;
    assert_eq!(rest[0].id, Some(last + 1));
    let all: Vec<Frame> = seen.iter().chain(&rest).cloned().collect();
    assert_eq!(all.last().unwrap().data, "[DONE]");
    assert_eq!(chat_text(&all), expected);
    for (i, f) in all.iter().enumerate() {
        assert_eq!(f.id, Some(i as u64));
    }
    let finish: Vec<Value> = all
        .iter()
        .filter(|f| f.data != "[DONE]")
        .map(|f| json_of(f)["choices"][0]["finish_reason"].clone())
        .filter(|v| !v.is_null())
        .collect();
    assert_eq!(
        finish,
        vec![json!("length")],
        "ran to its end, not cancelled"
    );

    // A retry without Last-Event-ID once it ended is today's replay from the record.
    let replay = Frames::new(submit(&url_a, key, "chat-drop", &chat(true)).await)
        .rest()
        .await;
    assert_eq!(chat_text(&replay), expected);
    r.stop().await;
}

/// A coordinator that counts the journal appends reaching it.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Coordinator>,
    appends: std::sync::atomic::AtomicU64,
}

/// The writer batches: a burst of events costs a handful of appends, not one per event, and
/// they read back whole, in order, with the terminal event last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_writer_batches_appends() {
    let prefix = format!("swjournal:{:08x}:", rand::random::<u32>());
    let redis = switchyard::coord::connect_coordinator(Some(&redis_url()), &prefix)
        .await
        .unwrap();
    let counting = Arc::new(Counting {
        inner: redis.clone(),
        appends: 0.into(),
    });
    let spec = JournalSpec {
        key: "journal:burst".to_owned(),
        running_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(60),
        max_bytes: 1 << 20,
    };
    let (tx, mut rx) = switchyard_actors::generation::events::channel(Default::default());
    let mut tx = tx.journaled(Journal::spawn(counting.clone(), spec));
    let now = tokio::time::Instant::now();
    for i in 0..2000 {
        let _ = tx.send(GenEvent::Delta(format!("t{i} ").into()), now);
    }
    let end = GenEvent::Finished(switchyard_actors::generation::Usage {
        prompt_tokens: 1,
        completion_tokens: 2000,
        finish_reason: "stop".into(),
        cached_tokens: None,
    });
    tx.send(end.clone(), now).unwrap();
    drop(tx);
    let mut read = Vec::new();
    let mut after = None;
    while read.len() < 2001 {
        let page = read_journal(
            redis.as_ref(),
            "journal:burst",
            after,
            500,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(!page.is_empty(), "the journal stalled at {}", read.len());
        after = page.last().map(|(n, _)| *n);
        read.extend(page);
    }
    for (i, (n, _)) in read.iter().enumerate() {
        assert_eq!(*n, i as u64);
    }
    assert_eq!(read[1999].1, GenEvent::Delta("t1999 ".into()));
    assert_eq!(read[2000].1, end);
    let appends = counting.appends.load(std::sync::atomic::Ordering::Relaxed);
    assert!(appends < 100, "{appends} appends for 2001 events");
    // The live reader still gets its events beside the journal.
    assert_eq!(rx.recv().await, Some(GenEvent::Delta("t0 ".into())));

    // At a token rate (a token per 10 ms for a second): an append per 50 ms, not per token.
    counting
        .appends
        .store(0, std::sync::atomic::Ordering::Relaxed);
    let spec = JournalSpec {
        key: "journal:paced".to_owned(),
        running_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(60),
        max_bytes: 1 << 20,
    };
    let (tx, _rx) = switchyard_actors::generation::events::channel(Default::default());
    let mut tx = tx.journaled(Journal::spawn(counting.clone(), spec));
    for i in 0..100 {
        let _ = tx.send(
            GenEvent::Delta(format!("p{i}").into()),
            tokio::time::Instant::now(),
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.send(end, tokio::time::Instant::now()).unwrap();
    drop(tx);
    let mut got: u64 = 0;
    while got < 101 {
        let page = read_journal(
            redis.as_ref(),
            "journal:paced",
            got.checked_sub(1),
            500,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert!(!page.is_empty(), "the paced journal stalled at {got}");
        got += page.len() as u64;
    }
    let appends = counting.appends.load(std::sync::atomic::Ordering::Relaxed);
    println!("paced: {appends} appends for 101 events over ~1 s");
    assert!(
        (10..=40).contains(&appends),
        "{appends} appends for 101 events over a second"
    );
    clean_redis(&prefix).await;
}

#[async_trait::async_trait]
impl Coordinator for Counting {
    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }
    async fn put_hash(
        &self,
        key: &str,
        fields: &std::collections::BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<(), switchyard::coord::CoordError> {
        self.inner.put_hash(key, fields, ttl).await
    }
    async fn get_hash(
        &self,
        key: &str,
    ) -> Result<Option<std::collections::BTreeMap<String, String>>, switchyard::coord::CoordError>
    {
        self.inner.get_hash(key).await
    }
    async fn delete(&self, key: &str) -> Result<(), switchyard::coord::CoordError> {
        self.inner.delete(key).await
    }
    async fn claim_hash(
        &self,
        key: &str,
        fields: &std::collections::BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<u64, switchyard::coord::CoordError> {
        self.inner.claim_hash(key, fields, ttl).await
    }
    async fn put_hash_fenced(
        &self,
        key: &str,
        fields: &std::collections::BTreeMap<String, String>,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, switchyard::coord::CoordError> {
        self.inner.put_hash_fenced(key, fields, fence, ttl).await
    }
    async fn delete_fenced(
        &self,
        key: &str,
        fence: u64,
    ) -> Result<bool, switchyard::coord::CoordError> {
        self.inner.delete_fenced(key, fence).await
    }
    async fn acquire_lease(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, switchyard::coord::CoordError> {
        self.inner.acquire_lease(name, owner, ttl).await
    }
    async fn release_lease(
        &self,
        name: &str,
        owner: &str,
    ) -> Result<(), switchyard::coord::CoordError> {
        self.inner.release_lease(name, owner).await
    }
    async fn lease_holder(
        &self,
        name: &str,
    ) -> Result<Option<String>, switchyard_actors::ports::CoordError> {
        self.inner.lease_holder(name).await
    }
    async fn incr(
        &self,
        key: &str,
        by: i64,
        ttl: Duration,
    ) -> Result<i64, switchyard::coord::CoordError> {
        self.inner.incr(key, by, ttl).await
    }
    async fn acquire_slot(
        &self,
        key: &str,
        member: &str,
        limit: u32,
        now_ms: i64,
        ttl: Duration,
    ) -> Result<switchyard_actors::ports::LimitVerdict, switchyard::coord::CoordError> {
        self.inner
            .acquire_slot(key, member, limit, now_ms, ttl)
            .await
    }
    async fn release_slot(
        &self,
        key: &str,
        member: &str,
    ) -> Result<(), switchyard::coord::CoordError> {
        self.inner.release_slot(key, member).await
    }
    async fn window_admit(
        &self,
        key: &str,
        member: &str,
        now_ms: i64,
        window: Duration,
        limit: u32,
    ) -> Result<switchyard_actors::ports::LimitVerdict, switchyard::coord::CoordError> {
        self.inner
            .window_admit(key, member, now_ms, window, limit)
            .await
    }
    async fn publish(
        &self,
        channel: &str,
        payload: Vec<u8>,
    ) -> Result<usize, switchyard::coord::CoordError> {
        self.inner.publish(channel, payload).await
    }
    async fn subscribe(
        &self,
        channel: &str,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>, switchyard::coord::CoordError> {
        self.inner.subscribe(channel).await
    }
    async fn append_events(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), switchyard::coord::CoordError> {
        self.appends
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.append_events(key, first_seq, events, ttl).await
    }
    async fn read_events(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, switchyard::coord::CoordError> {
        self.inner.read_events(key, after, max, block).await
    }
}

/// The embedded mode (SQLite, in-process coordinator), one replica: the reader comes back
/// where the generation runs, so it is told directly rather than over pub/sub.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_mode_resumes_on_its_one_replica() {
    let f = common::fleet(&[("small", 1)], 1.0, |c| {
        c.server.timeouts.cancel_grace_ms = 300;
    })
    .await;
    let generations = format!("{}/v1/generations", f.server.base_url());
    let whole = Frames::new(submit(&generations, &f.api_key, "e-whole", &body(100, true)).await)
        .rest()
        .await;
    assert_whole(&whole);
    let mut first = Frames::new(submit(&generations, &f.api_key, "e-drop", &body(100, true)).await);
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(first.next().await.unwrap());
    }
    drop(first);
    let last = seen.last().unwrap().id.unwrap();
    // The retry of the key, streaming, with the last id seen: the same stream, resumed.
    let retry = http()
        .post(&generations)
        .bearer_auth(&f.api_key)
        .header("idempotency-key", "e-drop")
        .header("last-event-id", last.to_string())
        .json(&body(100, true))
        .send()
        .await
        .unwrap();
    let rest = Frames::new(retry).rest().await;
    let all: Vec<Frame> = seen.iter().chain(&rest).cloned().collect();
    assert_whole(&all);
    assert_eq!(text(&all), text(&whole));
    assert_eq!(json_of(all.last().unwrap())["usage"]["output_tokens"], 100);
    f.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_event_id_past_the_end_is_refused_or_gets_the_end_never_nothing() {
    let f = common::fleet(&[("small", 1)], 1.0, |_| {}).await;
    let base = f.server.base_url();
    let generations = format!("{base}/v1/generations");
    let whole = Frames::new(submit(&generations, &f.api_key, "past-1", &body(20, true)).await)
        .rest()
        .await;
    assert_whole(&whole);
    let id = json_of(&whole[0])["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let end = whole.last().unwrap().id.unwrap();
    let path = format!("{base}/v1/generations/{id}/events");

    // Finished: past its terminal event is 400, before any stream starts.
    for past in [end + 1, 1_000_000_000] {
        let resp = events(&path, &f.api_key, Some(past)).await;
        assert_eq!(resp.status(), 400, "Last-Event-ID {past}");
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["code"], "invalid_request", "{err}");
        assert_eq!(err["error"]["param"], "Last-Event-ID");
    }
    // At the terminal event the client has everything; just before it, it gets the end.
    let at_end = Frames::new(events(&path, &f.api_key, Some(end)).await)
        .rest()
        .await;
    assert_eq!(at_end, Vec::<Frame>::new());
    let before = Frames::new(events(&path, &f.api_key, Some(end - 1)).await)
        .rest()
        .await;
    assert_eq!(before, whole[whole.len() - 1..].to_vec());

    // Running: what it will have is not known yet, so the stream follows it and, past its
    // end, still ends with its terminal event (numbered as it was).
    let mut running =
        Frames::new(submit(&generations, &f.api_key, "past-2", &body(100, true)).await);
    let created = running.next().await.unwrap();
    let id = json_of(&created)["generation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("{base}/v1/generations/{id}/events");
    let resumed = Frames::new(events(&path, &f.api_key, Some(1_000_000)).await)
        .rest()
        .await;
    let first = running.rest().await;
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0], *first.last().unwrap());
    assert_eq!(resumed[0].name.as_deref(), Some("generation.completed"));

    // A keyed chat completion resumed past its end the same way: its `[DONE]`.
    let chat = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 100, "stream": true});
    let chat_url = format!("{base}/v1/chat/completions");
    let mut live = Frames::new(submit(&chat_url, &f.api_key, "past-3", &chat).await);
    live.next().await.unwrap();
    let retry = http()
        .post(&chat_url)
        .bearer_auth(&f.api_key)
        .header("idempotency-key", "past-3")
        .header("last-event-id", "1000000")
        .json(&chat)
        .send()
        .await
        .unwrap();
    let resumed = Frames::new(retry).rest().await;
    let first = live.rest().await;
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0].data, "[DONE]");
    assert_eq!(resumed[0].id, first.last().unwrap().id);
    f.shutdown(Duration::from_secs(2)).await;
}
