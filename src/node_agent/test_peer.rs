//! A scripted server side for the agent's tests: axum on 127.0.0.1:0 upgrading
//! `/v1/nodes/connect`, handing each connection to the test, which reads the node's frames and
//! sends whatever server frames the scenario needs.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use axum::routing::get;
use futures::{SinkExt, StreamExt};
use switchyard_actors::protocol::{NodeFrame, ServerFrame};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// How long a test waits for an expected frame or connection.
pub const WAIT: Duration = Duration::from_secs(5);

/// The scripted server.
#[derive(Debug)]
pub struct Peer {
    /// `http://127.0.0.1:PORT`, the agent's `--server`.
    pub url: String,
    conns: mpsc::UnboundedReceiver<Conn>,
    server: tokio::task::JoinHandle<()>,
}

/// One accepted connection.
#[derive(Debug)]
pub struct Conn {
    frames: mpsc::UnboundedReceiver<NodeFrame>,
    out: mpsc::UnboundedSender<Cmd>,
    /// WebSocket pings read from the agent (axum answers each with a pong while reading).
    pings: Arc<AtomicU64>,
}

/// What the test tells a connection to do.
#[derive(Debug)]
enum Cmd {
    Frame(ServerFrame),
    Raw(String),
    Close,
    /// Stop reading and writing but keep the socket open: a half-open, partitioned server
    /// (no pongs either, since those are sent while reading).
    Mute,
}

impl Peer {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (tx, conns) = mpsc::unbounded_channel();
        let app = Router::new()
            .route("/v1/nodes/connect", get(upgrade))
            .with_state(tx);
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, conns, server }
    }

    /// The next connection (panics after [`WAIT`]).
    pub async fn accept(&mut self) -> Conn {
        tokio::time::timeout(WAIT, self.conns.recv())
            .await
            .expect("no connection from the agent")
            .expect("peer stopped")
    }

    /// A connection within `d`, if any.
    pub async fn try_accept(&mut self, d: Duration) -> Option<Conn> {
        tokio::time::timeout(d, self.conns.recv())
            .await
            .ok()
            .flatten()
    }

    /// Accepts, checks the `register` frame and answers `registered`; returns the register.
    pub async fn accept_registered(&mut self) -> (Conn, NodeFrame) {
        let mut conn = self.accept().await;
        let register = conn.recv().await;
        assert!(
            matches!(register, NodeFrame::Register { .. }),
            "{register:?}"
        );
        conn.send(ServerFrame::Registered {
            protocol: Some(switchyard_actors::protocol::PROTOCOL_VERSION),
        });
        (conn, register)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Conn {
    /// The next frame, heartbeats included.
    pub async fn recv(&mut self) -> NodeFrame {
        tokio::time::timeout(WAIT, self.frames.recv())
            .await
            .expect("no frame from the agent")
            .expect("connection closed")
    }

    /// The next frame that is not a heartbeat.
    pub async fn recv_work(&mut self) -> NodeFrame {
        loop {
            match self.recv().await {
                NodeFrame::Heartbeat { .. } => {}
                f => return f,
            }
        }
    }

    /// A non-heartbeat frame within `d`, if any (`None` also when the socket closed).
    pub async fn try_recv_work(&mut self, d: Duration) -> Option<NodeFrame> {
        let deadline = tokio::time::Instant::now() + d;
        loop {
            match tokio::time::timeout_at(deadline, self.frames.recv()).await {
                Ok(Some(NodeFrame::Heartbeat { .. })) => {}
                Ok(f) => return f,
                Err(_) => return None,
            }
        }
    }

    /// Waits until the agent closes the socket (panics after [`WAIT`]).
    pub async fn closed(&mut self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.frames.recv()).await {
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(_) => panic!("the agent kept the connection open"),
            }
        }
    }

    pub fn send(&self, frame: ServerFrame) {
        let _ = self.out.send(Cmd::Frame(frame));
    }

    /// Sends arbitrary text as one WebSocket text message.
    pub fn send_raw(&self, text: &str) {
        let _ = self.out.send(Cmd::Raw(text.to_owned()));
    }

    /// Sends a close frame and drops the socket (the agent sees the server go away).
    pub fn close(self) {
        let _ = self.out.send(Cmd::Close);
    }

    /// Pings received from the agent so far.
    pub fn pings(&self) -> u64 {
        self.pings.load(Ordering::SeqCst)
    }

    /// Goes silent with the socket left open.
    pub fn mute(self) {
        let _ = self.out.send(Cmd::Mute);
    }
}

async fn upgrade(
    ws: WebSocketUpgrade,
    State(conns): State<mpsc::UnboundedSender<Conn>>,
) -> Response {
    ws.on_upgrade(move |socket| serve_conn(socket, conns))
}

async fn serve_conn(socket: WebSocket, conns: mpsc::UnboundedSender<Conn>) {
    let (mut sink, mut stream) = socket.split();
    let (frames_tx, frames) = mpsc::unbounded_channel();
    let (out, mut out_rx) = mpsc::unbounded_channel::<Cmd>();
    let pings = Arc::new(AtomicU64::new(0));
    let conn = Conn {
        frames,
        out,
        pings: pings.clone(),
    };
    if conns.send(conn).is_err() {
        return;
    }
    let reader = async move {
        while let Some(Ok(msg)) = stream.next().await {
            match msg {
                Message::Text(text) => {
                    let frame: NodeFrame =
                        switchyard_actors::protocol::decode_node_frame(text.as_str())
                            .unwrap_or_else(|e| panic!("agent sent a bad frame ({e:?}): {text}"));
                    if frames_tx.send(frame).is_err() {
                        return;
                    }
                }
                Message::Ping(_) => {
                    pings.fetch_add(1, Ordering::SeqCst);
                }
                _ => {}
            }
        }
    };
    let writer = async move {
        while let Some(cmd) = out_rx.recv().await {
            let text = match cmd {
                Cmd::Frame(frame) => serde_json::to_string(&frame).unwrap(),
                Cmd::Raw(text) => text,
                Cmd::Close => break,
                Cmd::Mute => return Some(sink),
            };
            if sink.send(Message::Text(text.into())).await.is_err() {
                return None;
            }
        }
        let _ = sink.send(Message::Close(None)).await;
        None
    };
    tokio::pin!(reader);
    let muted = tokio::select! {
        () = &mut reader => None,
        m = writer => m,
    };
    if let Some(sink) = muted {
        // Neither half is polled again; holding the sink keeps the socket open.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(sink);
    }
}
