//! A TCP proxy in front of Redis for the partition tests.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A TCP proxy in front of Redis that can stall traffic (a partition: bytes wait, sockets
/// stay open), strand the connections open now (a half-open socket: they never carry a byte
/// again, while new ones work) or cut every connection (a crash or a network reset).
pub struct Proxy {
    pub url: String,
    paused: Arc<AtomicBool>,
    state: Arc<Mutex<ProxyState>>,
    accept: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    /// Cancelled to cut the connections opened so far.
    cut: CancellationToken,
    /// Set to strand the connections opened so far.
    stranded: Arc<AtomicBool>,
}

impl Proxy {
    pub async fn start(redis_url: &str) -> Self {
        let rest = redis_url
            .strip_prefix("redis://")
            .expect("the proxy tests need a redis:// URL");
        let authority = rest.split('/').next().unwrap_or(rest);
        let upstream = authority.rsplit('@').next().unwrap_or(authority).to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let url = redis_url.replacen(&upstream, &addr.to_string(), 1);

        let paused = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(ProxyState {
            cut: CancellationToken::new(),
            stranded: Arc::new(AtomicBool::new(false)),
        }));
        let accept = {
            let paused = Arc::clone(&paused);
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                while let Ok((down, _)) = listener.accept().await {
                    let Ok(up) = TcpStream::connect(&upstream).await else {
                        continue;
                    };
                    let (cut, stranded) = {
                        let state = state.lock().unwrap();
                        (state.cut.clone(), Arc::clone(&state.stranded))
                    };
                    let stalled = Stall {
                        paused: Arc::clone(&paused),
                        stranded,
                    };
                    tokio::spawn(async move {
                        let (down_r, down_w) = down.into_split();
                        let (up_r, up_w) = up.into_split();
                        tokio::select! {
                            () = cut.cancelled() => {}
                            _ = async {
                                tokio::join!(
                                    forward(down_r, up_w, stalled.clone()),
                                    forward(up_r, down_w, stalled)
                                )
                            } => {}
                        }
                    });
                }
            })
        };
        Self {
            url,
            paused,
            state,
            accept,
        }
    }

    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::SeqCst);
    }

    pub fn strand(&self) {
        let mut state = self.state.lock().unwrap();
        state.stranded.store(true, Ordering::SeqCst);
        state.stranded = Arc::new(AtomicBool::new(false));
    }

    pub fn cut(&self) {
        let mut state = self.state.lock().unwrap();
        state.cut.cancel();
        state.cut = CancellationToken::new();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.state.lock().unwrap().cut.cancel();
    }
}

/// Whether one proxied connection may carry bytes now.
#[derive(Clone)]
struct Stall {
    paused: Arc<AtomicBool>,
    stranded: Arc<AtomicBool>,
}

impl Stall {
    fn holds(&self) -> bool {
        self.paused.load(Ordering::SeqCst) || self.stranded.load(Ordering::SeqCst)
    }
}

async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, stall: Stall) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while stall.holds() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
