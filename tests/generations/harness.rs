//! A fleet on a fresh PostgreSQL database and a Redis key prefix, and a client for the
//! Generations API that reads named SSE events as they arrive.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use switchyard::demo::{Fleet, FleetConfig};
use switchyard_actors::lifecycle::{WindowCounters, window_start};
use tokio_tungstenite::tungstenite::Message;

use crate::common::{clean_redis, drop_pg, fresh_pg, http, redis_url};

/// A fleet on the production backends; dropped databases and keys on [`PgFleet::stop`].
pub struct PgFleet {
    pub fleet: Fleet,
    db_name: String,
    prefix: String,
}

impl std::ops::Deref for PgFleet {
    type Target = Fleet;
    fn deref(&self) -> &Fleet {
        &self.fleet
    }
}

pub async fn pg_fleet(
    nodes: &[(&str, u32)],
    time_scale: f64,
    tweak: impl FnOnce(&mut FleetConfig),
) -> PgFleet {
    let (db_url, db_name) = fresh_pg().await;
    let prefix = format!("swgen:{:08x}:", rand::random::<u32>());
    let mut config = FleetConfig {
        nodes: nodes.iter().map(|(a, n)| ((*a).to_owned(), *n)).collect(),
        time_scale,
        agent_backoff_min: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(500),
        ..Default::default()
    };
    config.server.listen = "127.0.0.1:0".parse().unwrap();
    config.server.redis_url = Some(redis_url());
    config.server.redis_prefix = prefix.clone();
    config.server.timeouts.lease_ms = 500;
    config.server.timeouts.settle_wait_secs = 3;
    tweak(&mut config);
    let fleet = Fleet::start(config, &db_url).await.unwrap();
    assert!(fleet.wait_registered(Duration::from_secs(10)).await);
    PgFleet {
        fleet,
        db_name,
        prefix,
    }
}

impl PgFleet {
    pub async fn stop(self) {
        self.fleet.shutdown(Duration::from_secs(2)).await;
        drop_pg(&self.db_name).await;
        clean_redis(&self.prefix).await;
    }

    /// The fleet key's principal (its key id).
    pub async fn subject(&self) -> String {
        let keys = self.store.api_keys(self.team_id).await.unwrap();
        keys[0].id.to_string()
    }

    /// The fleet key's message counters in the current window.
    pub async fn window(&self) -> WindowCounters {
        let now = chrono::Utc::now().timestamp_millis();
        let start = window_start(now, 3 * 3600 * 1000);
        self.store
            .message_window(&self.subject().await, start)
            .await
            .unwrap()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.base_url())
    }

    /// `POST /v1/generations` with `key` as Idempotency-Key and `bearer` as credential.
    pub async fn submit_as(&self, bearer: &str, key: &str, body: &Value) -> reqwest::Response {
        http()
            .post(self.url("/v1/generations"))
            .bearer_auth(bearer)
            .header("idempotency-key", key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    pub async fn submit(&self, key: &str, body: &Value) -> reqwest::Response {
        self.submit_as(&self.api_key, key, body).await
    }

    pub async fn get(&self, id: &str) -> (u16, Value) {
        let resp = http()
            .get(self.url(&format!("/v1/generations/{id}")))
            .bearer_auth(&self.api_key)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    pub async fn cancel(&self, id: &str) -> (u16, Value) {
        self.cancel_as(&self.api_key, id).await
    }

    pub async fn cancel_as(&self, bearer: &str, id: &str) -> (u16, Value) {
        let resp = http()
            .post(self.url(&format!("/v1/generations/{id}/cancel")))
            .bearer_auth(bearer)
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    /// Requests the engines of every node finished (any reason).
    pub fn engine_requests(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| n.sim.stats().success.iter().sum::<u64>())
            .sum()
    }

    /// Prompt tokens every engine prefilled (aborted requests included).
    pub fn engine_prompt_tokens(&self) -> u64 {
        self.nodes.iter().map(|n| n.sim.stats().prompt_tokens).sum()
    }

    /// Sequences running on every engine right now.
    pub fn engine_running(&self) -> u64 {
        self.nodes.iter().map(|n| n.sim.stats().running).sum()
    }
}

/// A generation request body.
pub fn body(prompt: &str, max_output_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "small",
        "messages": [{"role": "user", "content": prompt}],
        "max_output_tokens": max_output_tokens,
        "stream": stream,
    })
}

/// Reads named SSE events as they arrive.
pub struct Events {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
}

impl Events {
    pub fn new(resp: reqwest::Response) -> Self {
        assert_eq!(resp.status(), 200);
        assert!(
            resp.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        Self {
            stream: resp.bytes_stream().boxed(),
            buf: String::new(),
        }
    }

    /// The next named event (comments skipped); `None` at EOF.
    pub async fn next(&mut self) -> Option<(String, Value)> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let frame: String = self.buf.drain(..end + 2).collect();
                let mut name = None;
                let mut data = String::new();
                for line in frame.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = Some(n.to_owned());
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push_str(d);
                    }
                }
                if let Some(name) = name {
                    return Some((name, serde_json::from_str(&data).unwrap()));
                }
                continue;
            }
            let chunk = tokio::time::timeout(Duration::from_secs(30), self.stream.next())
                .await
                .expect("an event within 30 s")?
                .ok()?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }

    /// Every remaining event.
    pub async fn rest(&mut self) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

/// Polls until `cond` holds (panics after `limit`).
pub async fn until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

pub type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A scripted node serving the small model: registers, then does exactly what the test says.
pub async fn fake_node(f: &PgFleet, node_id: &str, token: &str) -> Ws {
    fake_node_serving(f, node_id, token, "llama-3.1-8b-instruct").await
}

/// A scripted node serving `model`.
pub async fn fake_node_serving(f: &PgFleet, node_id: &str, token: &str, model: &str) -> Ws {
    let url = format!("ws://{}/v1/nodes/connect", f.server.addr());
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    let register = json!({"type": "register", "node_id": node_id, "token": token, "gpus": [],
        "models": [model], "version": "test", "location": "onprem", "protocol": 2});
    ws.send(Message::text(register.to_string())).await.unwrap();
    let registered = recv(&mut ws).await;
    assert_eq!(registered["type"], "registered");
    assert_eq!(registered["protocol"], 2);
    ws
}

/// The next text frame (10 s at most).
pub async fn recv(ws: &mut Ws) -> Value {
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), ws.next())
            .await
            .expect("a frame within 10 s")
            .unwrap()
            .unwrap();
        if let Message::Text(t) = msg {
            return serde_json::from_str(&t).unwrap();
        }
    }
}

/// The next text frame within `wait`, or `None` (the socket may also have closed).
pub async fn recv_within(ws: &mut Ws, wait: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .ok()??
            .ok()?;
        if let Message::Text(t) = msg {
            return Some(serde_json::from_str(&t).unwrap());
        }
    }
}

pub async fn send(ws: &mut Ws, frame: Value) {
    ws.send(Message::text(frame.to_string())).await.unwrap();
}

/// Sends raw text as one frame (for frames serde would not write).
pub async fn send_raw(ws: &mut Ws, text: &str) {
    ws.send(Message::text(text.to_owned())).await.unwrap();
}

/// Sum of a server metric's samples whose labels contain `label`.
pub async fn metric(f: &PgFleet, name: &str, label: &str) -> f64 {
    crate::common::metric_sum(&f.server.base_url(), name, label).await
}
