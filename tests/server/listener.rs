//! The public listener: header, body and idle timeouts, the per-client connection cap, and
//! the error envelope on refusals made before a request reaches a handler.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{chat_body, fleet, http};

/// Header and body timeouts of 1 s, idle of 2 s: distinct, so a test sees which one acted.
fn short_timeouts(c: &mut switchyard::demo::FleetConfig) {
    c.server.listener.header_timeout_secs = 1;
    c.server.listener.body_timeout_secs = 1;
    c.server.listener.idle_timeout_secs = 2;
}

/// One response read off a raw socket.
#[derive(Debug)]
struct Raw {
    status: u16,
    head: String,
    body: Value,
}

/// Reads one response (every answer here carries `content-length`).
async fn read_response(stream: &mut TcpStream) -> Raw {
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "closed before a response: {:?}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| panic!("no content-length in {head}"))
            .trim()
            .parse()
            .unwrap();
        while buf.len() < head_end + len {
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed mid-body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let status = head[9..12].parse().unwrap();
        let body = serde_json::from_slice(&buf[head_end..head_end + len]).unwrap_or(Value::Null);
        Raw { status, head, body }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("a response within 5 s")
}

/// How long until the server closes `stream` (bytes it sends meanwhile are returned), or
/// `None` if it is still open after `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<(Duration, Vec<u8>)> {
    let start = Instant::now();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let remaining = limit.checked_sub(start.elapsed())?;
        match tokio::time::timeout(remaining, stream.read(&mut chunk)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some((start.elapsed(), got)),
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends `request` on a fresh connection and reads the enveloped refusal, then checks the
/// server closed the connection (hyper's own refusals) or not.
async fn refused(addr: SocketAddr, request: &[u8]) -> Raw {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_response(&mut s).await
}

fn assert_envelope(raw: &Raw, status: u16, code: &str) {
    assert_eq!(raw.status, status, "{raw:?}");
    assert_eq!(raw.body["error"]["code"], code, "{raw:?}");
    assert!(raw.body["error"]["message"].is_string(), "{raw:?}");
    assert!(
        raw.head
            .to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{raw:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_within_the_header_timeout() {
    let fleet = fleet(&[("small", 1)], 20.0, short_timeouts).await;
    let mut s = TcpStream::connect(fleet.server.addr()).await.unwrap();
    let (after, sent) = closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("closed within 3 s");
    assert!(
        after >= Duration::from_millis(900),
        "not before the timeout: {after:?}"
    );
    assert!(sent.is_empty(), "nothing was asked, nothing is answered");
    let base = fleet.server.base_url();
    let refusals = crate::common::metric_sum(
        &base,
        "switchyard_listener_refusals_total",
        "header_timeout",
    )
    .await;
    assert!(refusals >= 1.0, "{refusals}");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_headers_are_closed_within_the_header_timeout() {
    let fleet = fleet(&[("small", 1)], 20.0, short_timeouts).await;
    let mut s = TcpStream::connect(fleet.server.addr()).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Trickling more header bytes does not extend the deadline.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(b"X-Slow: 1\r\n").await.unwrap();
    }
    let (after, _) = closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("closed within 3 s of opening");
    assert!(after <= Duration::from_millis(2500), "{after:?}");
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_length_gets_408_with_the_envelope_and_the_connection_closes() {
    let fleet = fleet(&[("small", 1)], 20.0, short_timeouts).await;
    let mut s = TcpStream::connect(fleet.server.addr()).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\"",
        fleet.api_key
    );
    let sent = Instant::now();
    s.write_all(head.as_bytes()).await.unwrap();
    let raw = read_response(&mut s).await;
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    assert_envelope(&raw, 408, "invalid_request");
    assert!(
        raw.head.to_ascii_lowercase().contains("connection: close"),
        "{raw:?}"
    );
    assert!(
        closed_within(&mut s, Duration::from_secs(1))
            .await
            .is_some(),
        "the connection closes after the 408"
    );
    let base = fleet.server.base_url();
    assert!(
        crate::common::metric_sum(&base, "switchyard_listener_refusals_total", "body_timeout")
            .await
            >= 1.0
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickled_past_its_deadline_gets_408() {
    let fleet = fleet(&[("small", 1)], 20.0, short_timeouts).await;
    let mut s = TcpStream::connect(fleet.server.addr()).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n",
        fleet.api_key
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let sent = Instant::now();
    // A byte every 100 ms never leaves a gap of a second, but the body is due within one.
    let (mut read, mut write) = s.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..30 {
            if write.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), read.read(&mut buf))
        .await
        .expect("an answer before the body would have been complete")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(sent.elapsed() < Duration::from_millis(2500));
    trickle.abort();
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timing_300_slow_header_connections_meet_the_per_client_cap() {
    let fleet = fleet(&[("small", 1)], 20.0, |c| {
        short_timeouts(c);
        c.server.listener.max_connections_per_client = 50;
    })
    .await;
    let addr = fleet.server.addr();
    let mut watchers = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // A slow client: part of a head, then nothing.
        let _ = s.write_all(b"GET /healthz HTTP/1.1\r\n").await;
        watchers.push(tokio::spawn(async move {
            closed_within(&mut s, Duration::from_secs(4))
                .await
                .map(|(after, _)| after)
        }));
    }
    let mut refused_at_once = 0;
    let mut timed_out = 0;
    for w in watchers {
        let after = w
            .await
            .unwrap()
            .expect("every connection is closed within 4 s");
        if after < Duration::from_millis(500) {
            refused_at_once += 1;
        } else {
            assert!(after >= Duration::from_millis(800), "{after:?}");
            timed_out += 1;
        }
    }
    // The node agent's WebSocket, also from 127.0.0.1, holds one of the 50 places.
    assert!(
        (48..=50).contains(&timed_out),
        "held until the header timeout: {timed_out}"
    );
    assert_eq!(refused_at_once + timed_out, 300);
    let base = fleet.server.base_url();
    let ok = http().get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(ok.status(), 200, "a normal request succeeds afterwards");
    let capped = crate::common::metric_sum(
        &base,
        "switchyard_connections_refused_total",
        "per_client_cap",
    )
    .await;
    assert!(capped >= 250.0, "{capped}");
    assert_eq!(
        fleet.nodes[0].agent_stats.registrations(),
        1,
        "the node kept its socket"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_targets_and_heads_get_414_and_431_envelopes() {
    let fleet = fleet(&[("small", 1)], 20.0, |c| {
        // hyper's buffer is twice this (80 KB): room for a target over the `http` crate's
        // 64 KiB limit, so hyper's own 414 is exercised too.
        c.server.listener.max_header_bytes = 40_000;
    })
    .await;
    let addr = fleet.server.addr();
    // Ours: over max_uri_bytes (8 KiB).
    let long = format!(
        "GET /v1/models?q={} HTTP/1.1\r\nHost: x\r\n\r\n",
        "a".repeat(9000)
    );
    assert_envelope(
        &refused(addr, long.as_bytes()).await,
        414,
        "request_too_large",
    );
    // hyper's: a target the `http` crate cannot hold, rewritten into the envelope.
    let huge = format!(
        "GET /v1/models?q={} HTTP/1.1\r\nHost: x\r\n\r\n",
        "a".repeat(66_000)
    );
    assert_envelope(
        &refused(addr, huge.as_bytes()).await,
        414,
        "request_too_large",
    );
    // Ours: a head over max_header_bytes.
    let big = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "b".repeat(45_000)
    );
    assert_envelope(
        &refused(addr, big.as_bytes()).await,
        431,
        "request_too_large",
    );
    // hyper's: beyond its buffer, and more header lines than it parses.
    let beyond = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "b".repeat(90_000)
    );
    assert_envelope(
        &refused(addr, beyond.as_bytes()).await,
        431,
        "request_too_large",
    );
    let mut many = String::from("GET /healthz HTTP/1.1\r\nHost: x\r\n");
    for i in 0..120 {
        many.push_str(&format!("X-H{i}: v\r\n"));
    }
    many.push_str("\r\n");
    assert_envelope(
        &refused(addr, many.as_bytes()).await,
        431,
        "request_too_large",
    );
    let base = fleet.server.base_url();
    assert!(
        crate::common::metric_sum(&base, "switchyard_listener_refusals_total", "uri_too_long")
            .await
            >= 2.0
    );
    assert!(
        crate::common::metric_sum(
            &base,
            "switchyard_listener_refusals_total",
            "head_too_large"
        )
        .await
            >= 3.0
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_heads_get_400_envelopes() {
    let fleet = fleet(&[("small", 1)], 20.0, |_| {}).await;
    let addr = fleet.server.addr();
    let cases: [&[u8]; 5] = [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Nul: a\0b\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX\0Nul: v\r\n\r\n",
        b"GET /healthz HTTX/1.1\r\nHost: x\r\n\r\n",
        b"GARBAGE\r\n\r\n",
    ];
    for case in cases {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(case).await.unwrap();
        let raw = read_response(&mut s).await;
        assert_envelope(&raw, 400, "invalid_request");
        assert!(
            closed_within(&mut s, Duration::from_secs(2))
                .await
                .is_some(),
            "closed after {:?}",
            String::from_utf8_lossy(case)
        );
    }
    // HTTP/2 with prior knowledge has no HTTP/1.1 answer: closed, unanswered.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let (_, sent) = closed_within(&mut s, Duration::from_secs(1))
        .await
        .expect("an HTTP/2 preface is closed at once");
    assert!(sent.is_empty(), "{:?}", String::from_utf8_lossy(&sent));
    let base = fleet.server.base_url();
    assert!(
        crate::common::metric_sum(&base, "switchyard_listener_refusals_total", "malformed").await
            >= 5.0
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_waits_the_idle_timeout_not_the_header_timeout() {
    let fleet = fleet(&[("small", 1)], 20.0, short_timeouts).await;
    let mut s = TcpStream::connect(fleet.server.addr()).await.unwrap();
    let get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    s.write_all(get).await.unwrap();
    assert_eq!(read_response(&mut s).await.status, 200);
    // Longer than the header timeout: the connection is idle, not slow.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(get).await.unwrap();
    assert_eq!(read_response(&mut s).await.status, 200);
    let (after, _) = closed_within(&mut s, Duration::from_secs(4))
        .await
        .expect("closed after the idle timeout");
    assert!(
        (Duration::from_millis(1800)..Duration::from_millis(3500)).contains(&after),
        "{after:?}"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_every_timeout_completes() {
    // About 65 tokens a second at scale 2: 380 tokens stream for about 3.5 s.
    let fleet = fleet(&[("small", 1)], 2.0, |c| {
        c.server.listener.header_timeout_secs = 1;
        c.server.listener.body_timeout_secs = 1;
        c.server.listener.idle_timeout_secs = 1;
    })
    .await;
    // The node's upgraded WebSocket outlives every listener timeout.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(fleet.nodes[0].agent_stats.registrations(), 1);
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        "authorization",
        format!("Bearer {}", fleet.api_key).parse().unwrap(),
    );
    let client = reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap();
    let started = Instant::now();
    let streamed = crate::common::stream(
        &client,
        &fleet.server.base_url(),
        &chat_body("small", "Tell me a long story.", 380, true),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(streamed.status, 200);
    assert!(streamed.done, "[DONE] after {took:?}");
    assert!(!streamed.cut);
    assert!(
        took >= Duration::from_millis(2500),
        "the stream outlasted the timeouts: {took:?}"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}
