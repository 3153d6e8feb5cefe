//! `serve` terminating TLS itself: what a real client (the Python `openai` SDK) sees, and what
//! a client that never starts its handshake gets (closed within the header timeout).

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use crate::common::{run_python, wait_for};
use crate::{Pki, engine_and_node, in_process_agent, registered, tls_fleet};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_over_https_with_the_test_ca() {
    let pki = Pki::new("sdk", &["127.0.0.1"]);
    let fleet = tls_fleet(&pki, |_| {}).await;
    let (sim, token) = engine_and_node(&fleet, "sdk-node").await;
    let (stop, _stats, task) = in_process_agent(&fleet, "sdk-node", &token, &sim, Some(&pki.ca));
    wait_for(Duration::from_secs(10), "the agent to register", || async {
        registered(&fleet, "sdk-node")
    })
    .await;

    let ca = pki.ca.display().to_string();
    let out = run_python(
        "tls_sdk.py",
        &[&fleet.openai_base_url(), &fleet.api_key, &ca],
    )
    .await;
    let seen: serde_json::Value = serde_json::from_str(out.trim().lines().last().unwrap()).unwrap();
    assert_eq!(seen["stream_completion_tokens"], 5, "{seen}");
    assert_eq!(seen["completion_tokens"], 3, "{seen}");
    assert_eq!(seen["model"], "llama-3.1-8b-instruct", "{seen}");
    assert_eq!(seen["untrusted"], "APIConnectionError", "{seen}");
    assert_eq!(seen["alpn"], "http/1.1", "{seen}");

    stop.cancel();
    task.await.unwrap().unwrap();
    fleet.shutdown(Duration::from_secs(1)).await;
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_client_is_closed_within_the_header_timeout() {
    let pki = Pki::new("silent", &["127.0.0.1"]);
    let fleet = tls_fleet(&pki, |c| c.server.listener.header_timeout_secs = 1).await;
    let addr = fleet.server.addr();

    // TCP connect, then no ClientHello: the server must give the socket back on its own.
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let opened = Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("the server closes a silent TLS client");
    let waited = opened.elapsed();
    assert!(
        matches!(read, Ok(0)) || read.is_err(),
        "closed without a byte: {read:?}"
    );
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_millis(2500),
        "closed after {waited:?}, header timeout 1 s"
    );

    // A client that completes the handshake but then says nothing is held to the same
    // deadline, counted from the connection's opening.
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        switchyard::tls::client_config(Some(&pki.ca)).unwrap(),
    ));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let opened = Instant::now();
    let mut tls = connector
        .connect("127.0.0.1".try_into().unwrap(), tcp)
        .await
        .unwrap();
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
        .await
        .expect("the server closes a TLS client that sends no request");
    let waited = opened.elapsed();
    assert!(
        matches!(read, Ok(0)) || read.is_err(),
        "closed without a byte: {read:?}"
    );
    assert!(
        waited < Duration::from_millis(2500),
        "closed after {waited:?}"
    );
    fleet.shutdown(Duration::from_secs(1)).await;
}
