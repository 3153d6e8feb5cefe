//! One connection to the server: dial, register, then relay until the socket is lost, the
//! server drains the node, or the agent shuts down. In-flight assignments belong to the
//! session: when it ends they are cancelled, and their `done`s stay in the ledger. A leased
//! assignment is also cancelled once the server has been silent for its lease (`lease.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use switchyard_actors::protocol::{NodeFrame, ServerFrame};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::assignment::{self, AssignCtx, Assignment};
use super::config::{AgentConfig, Endpoint};
use super::engine::EngineClient;
use super::heartbeat::{Holding, heartbeat_loop};
use super::lease::Leases;
use super::ledger::{Key, Ledger};
use super::stats::AgentStats;
use super::transport::{self, Dialer, Ws};
use super::writer::{OUTGOING_CAPACITY, Outgoing, write_loop};

/// Dial plus WebSocket handshake: `register` must go out within 5 s of connecting.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection without an answer to `register` within this is dropped and retried.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(10);
/// After in-flight work ends while draining, how long to wait for the last acks.
const DRAIN_ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// On shutdown, how long to try to flush the dones of cancelled work.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(1);
/// How long cancelled assignment tasks get to record their dones before being aborted.
const TASK_GRACE: Duration = Duration::from_secs(1);
/// No frame (pongs included) from the server for this many heartbeat intervals means the
/// connection is dead, even if TCP has not noticed (a partitioned peer stays half-open).
const IDLE_INTERVALS: u32 = 3;
/// Lower bound of that idle timeout, so short test intervals do not flap.
const MIN_IDLE: Duration = Duration::from_secs(2);

/// What the session shares with the agent loop.
#[derive(Debug)]
pub(crate) struct Shared {
    pub cfg: AgentConfig,
    /// The server's replicas (or the load balancer in front of them), tried in turn.
    pub endpoints: Vec<Endpoint>,
    /// Which endpoint the next session dials.
    pub next: std::sync::atomic::AtomicUsize,
    pub dialer: Arc<dyn Dialer>,
    pub engine: EngineClient,
    pub ledger: Arc<Ledger>,
    pub stats: Arc<AgentStats>,
}

impl Shared {
    /// The endpoint the next session dials.
    pub fn endpoint(&self) -> &Endpoint {
        let i = self.next.load(std::sync::atomic::Ordering::Relaxed);
        &self.endpoints[i % self.endpoints.len()]
    }

    /// Moves on to the next endpoint (after a lost or refused connection).
    pub fn rotate(&self) {
        self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Why a session ended.
#[derive(Debug)]
pub(crate) enum SessionEnd {
    /// The shutdown token was cancelled.
    Shutdown,
    /// The server drained the node and every done was acked (or the ack bound passed).
    Drained,
    /// Dial, handshake, registration or the socket failed; reconnect after a backoff.
    Lost(String),
    /// The server refused the registration.
    Rejected {
        reason: String,
        retry_after: Option<Duration>,
    },
}

/// A session's result; `registered` resets the backoff.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub registered: bool,
    pub end: SessionEnd,
}

/// Whether the node drains, kept across reconnects: a drained node only reconnects to
/// deliver its last dones.
#[derive(Debug, Default)]
pub(crate) struct Drain {
    /// No new assignments (the server's `drain`, or the agent's own).
    pub on: bool,
    /// Set when the agent drains itself ([`AgentConfig::drain`], SIGTERM): by then in-flight
    /// work is cancelled and the agent stops whatever is left undelivered.
    pub deadline: Option<Instant>,
}

impl Drain {
    /// Starts the agent's own drain (once: a second call keeps the first deadline).
    pub fn begin(&mut self, timeout: Duration) {
        self.on = true;
        self.deadline
            .get_or_insert_with(|| Instant::now() + timeout);
    }

    /// Whether the agent drains itself (and must tell each server it registers with).
    pub fn own(&self) -> bool {
        self.deadline.is_some()
    }
}

/// Runs one connection from dial to close.
pub(crate) async fn serve(
    sh: &Shared,
    models: Vec<String>,
    drain: &mut Drain,
    shutdown: &CancellationToken,
) -> Outcome {
    let registering = async {
        let ws = connect(sh, &models).await?;
        registration(ws).await
    };
    let (ws, protocol) = tokio::select! {
        () = shutdown.cancelled() => return Outcome { registered: false, end: SessionEnd::Shutdown },
        r = registering => match r {
            Ok(registered) => registered,
            Err(end) => return Outcome { registered: false, end },
        },
    };
    // An older server says no version (1): the agent speaks down to it.
    let protocol = protocol.unwrap_or(1).min(sh.cfg.protocol);
    sh.stats.registered();
    tracing::info!(models = ?models, protocol, "registered");
    let end = Session::start(sh, ws, models, protocol, drain.own())
        .run(drain, shutdown)
        .await;
    Outcome {
        registered: true,
        end,
    }
}

/// Dials, shakes hands and sends `register`, all within [`CONNECT_TIMEOUT`].
async fn connect(sh: &Shared, models: &[String]) -> Result<Ws, SessionEnd> {
    // Read again for every connection: a rotated Secret takes effect at the next reconnect.
    // A file that cannot be read now (mid-rotation, say) is retried like a lost connection.
    let token = sh
        .cfg
        .token
        .read()
        .map_err(|e| SessionEnd::Lost(e.to_string()))?;
    let register = NodeFrame::Register {
        node_id: sh.cfg.node_id.clone(),
        token,
        gpus: sh.cfg.gpus.clone(),
        models: models.to_vec(),
        version: sh.cfg.version.clone(),
        location: sh.cfg.location,
        protocol: sh.cfg.protocol,
    };
    let text = serde_json::to_string(&register).map_err(|e| lost("register frame", e))?;
    let attempt = async {
        let mut ws = transport::open(sh.dialer.as_ref(), sh.endpoint())
            .await
            .map_err(|e| lost("connect", e))?;
        sh.stats.connected();
        ws.send(Message::text(text))
            .await
            .map_err(|e| lost("send register", e))?;
        Ok(ws)
    };
    timeout(CONNECT_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Err(SessionEnd::Lost("connect timed out".into())))
}

/// Waits for `registered` (with the version the server asks for) or `rejected`.
async fn registration(mut ws: Ws) -> Result<(Ws, Option<u32>), SessionEnd> {
    let deadline = Instant::now() + REGISTER_TIMEOUT;
    loop {
        let msg = match timeout_at(deadline, ws.next()).await {
            Err(_) => return Err(SessionEnd::Lost("no answer to register".into())),
            Ok(None) => return Err(SessionEnd::Lost("closed before registered".into())),
            Ok(Some(Err(e))) => return Err(lost("awaiting registered", e)),
            Ok(Some(Ok(m))) => m,
        };
        let text = match msg {
            Message::Text(t) => t,
            Message::Close(_) => return Err(SessionEnd::Lost("closed before registered".into())),
            _ => continue,
        };
        match parse_frame(text.as_str()) {
            Some(ServerFrame::Registered { protocol }) => return Ok((ws, protocol)),
            Some(ServerFrame::Rejected {
                reason,
                retry_after_ms,
            }) => {
                return Err(SessionEnd::Rejected {
                    reason,
                    retry_after: retry_after_ms.map(Duration::from_millis),
                });
            }
            Some(_) => tracing::warn!("frame before registered ignored"),
            None => {}
        }
    }
}

fn lost(what: &str, e: impl std::fmt::Display) -> SessionEnd {
    SessionEnd::Lost(format!("{what}: {e}"))
}

/// Parses a server frame; unknown types and malformed text are logged and give `None`. The log
/// names the type, the error category and the position only: serde's own message can quote
/// values, and an `assign` carries a prompt.
fn parse_frame(text: &str) -> Option<ServerFrame> {
    let e = match serde_json::from_str::<ServerFrame>(text) {
        Ok(f) => return Some(f),
        Err(e) => e,
    };
    let kind = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| {
            v.get("type")
                .and_then(|t| t.as_str())
                .map(|t| t.chars().take(64).collect::<String>())
        })
        .unwrap_or_default();
    tracing::warn!(
        %kind,
        category = ?e.classify(),
        column = e.column(),
        bytes = text.len(),
        "unknown or malformed server frame ignored"
    );
    None
}

/// An assignment running on the engine.
#[derive(Debug)]
struct InFlight {
    cancel: CancellationToken,
}

/// A registered connection.
struct Session<'a> {
    sh: &'a Shared,
    stream: futures::stream::SplitStream<Ws>,
    out: mpsc::Sender<Outgoing>,
    /// `None` once it has been awaited.
    writer: Option<JoinHandle<Result<(), tokio_tungstenite::tungstenite::Error>>>,
    heartbeat: JoinHandle<()>,
    in_flight: BTreeMap<Key, InFlight>,
    /// The keys of `in_flight` as heartbeats list them: taken before a task starts, dropped
    /// once it has ended (see [`Holding`]).
    holding: Arc<Holding>,
    tasks: JoinSet<Key>,
    task_keys: BTreeMap<tokio::task::Id, Key>,
    /// Cancels every assignment of this session at once.
    cancel_all: CancellationToken,
    idle_timeout: Duration,
    /// Leases of the leased assignments in flight, renewed by anything the server sends.
    leases: Leases,
    /// The protocol version spoken on this connection.
    protocol: u32,
}

enum Flow {
    Continue,
    End(SessionEnd),
}

impl<'a> Session<'a> {
    fn start(sh: &'a Shared, ws: Ws, models: Vec<String>, protocol: u32, draining: bool) -> Self {
        let (sink, stream) = ws.split();
        // Unacked dones go first, before any heartbeat or new frame: they are queued before
        // anything else can send, in a channel made large enough to take them all. A node
        // draining itself says so first of all, so this connection gets no new work.
        let unacked = sh.ledger.unacked();
        let (out, rx) = mpsc::channel(OUTGOING_CAPACITY + unacked.len() + 1);
        if draining {
            let _ = out.try_send(Outgoing::Frame(NodeFrame::Draining {}));
        }
        if !unacked.is_empty() {
            tracing::info!(count = unacked.len(), "resending unacked dones");
        }
        for done in unacked {
            if out.try_send(Outgoing::Frame(done.frame())).is_err() {
                break;
            }
        }
        let writer = tokio::spawn(write_loop(sink, rx));
        let holding = Arc::new(Holding::default());
        let heartbeat = tokio::spawn(heartbeat_loop(
            sh.engine.clone(),
            out.clone(),
            models,
            sh.cfg.heartbeat_interval,
            sh.stats.clone(),
            protocol,
            holding.clone(),
        ));
        let idle_timeout = sh
            .cfg
            .heartbeat_interval
            .saturating_mul(IDLE_INTERVALS)
            .max(MIN_IDLE);
        Self {
            sh,
            stream,
            out,
            writer: Some(writer),
            heartbeat,
            in_flight: BTreeMap::new(),
            holding,
            tasks: JoinSet::new(),
            task_keys: BTreeMap::new(),
            cancel_all: CancellationToken::new(),
            idle_timeout,
            protocol,
            leases: Leases::new(Instant::now()),
        }
    }

    async fn run(mut self, drain: &mut Drain, shutdown: &CancellationToken) -> SessionEnd {
        let sh = self.sh;
        let idle = tokio::time::sleep(self.idle_timeout);
        tokio::pin!(idle);
        let mut drain_deadline: Option<Instant> = None;
        // Dones a replica could not record come back only if they are sent again.
        let mut resend = tokio::time::interval_at(
            Instant::now() + super::ledger::RESEND_AFTER,
            super::ledger::RESEND_AFTER / 2,
        );
        let end = loop {
            if drain.on && self.in_flight.is_empty() {
                if self.sh.ledger.unacked_len() == 0 {
                    tracing::info!("drained: no work in flight and every done acked");
                    break SessionEnd::Drained;
                }
                drain_deadline.get_or_insert_with(|| Instant::now() + DRAIN_ACK_TIMEOUT);
            }
            let flow = tokio::select! {
                biased;
                () = shutdown.cancelled() => Flow::End(SessionEnd::Shutdown),
                r = join_opt(&mut self.writer) => {
                    self.writer = None;
                    Flow::End(SessionEnd::Lost(match r {
                        Ok(Ok(())) => "writer stopped".into(),
                        Ok(Err(e)) => format!("write: {e}"),
                        Err(e) => format!("writer task: {e}"),
                    }))
                }
                msg = self.stream.next() => {
                    let now = Instant::now();
                    idle.as_mut().reset(now + self.idle_timeout);
                    if matches!(msg, Some(Ok(_))) {
                        self.leases.heard(now);
                    }
                    self.on_message(msg, &mut drain.on).await
                }
                () = sh.cfg.drain.cancelled(), if !drain.own() => {
                    drain.begin(sh.cfg.drain_timeout);
                    tracing::info!(
                        in_flight = self.in_flight.len(),
                        timeout_ms = sh.cfg.drain_timeout.as_millis() as u64,
                        "draining on request: no new assignments; in-flight work may finish"
                    );
                    // Behind what is queued: the server hears it after the frames before it.
                    let _ = self.out.send(Outgoing::Frame(NodeFrame::Draining {})).await;
                    Flow::Continue
                }
                () = sleep_opt(drain.deadline) => {
                    tracing::warn!(
                        in_flight = self.in_flight.len(),
                        unacked = self.sh.ledger.unacked_len(),
                        "drain timeout: stopping what still runs and closing"
                    );
                    Flow::End(SessionEnd::Drained)
                }
                Some(joined) = self.tasks.join_next_with_id() => {
                    self.on_task_end(joined);
                    Flow::Continue
                }
                () = &mut idle => Flow::End(SessionEnd::Lost(format!(
                    "no frame from the server for {:?}", self.idle_timeout
                ))),
                () = sleep_opt(self.leases.deadline()) => {
                    self.expire_leases();
                    Flow::Continue
                }
                () = sleep_opt(self.leases.ping_due()) => {
                    // A full channel means the writer is stuck behind a server that does not
                    // read: another ping would not get a pong either.
                    let _ = self.out.try_send(Outgoing::Ping);
                    self.leases.pinged(Instant::now());
                    Flow::Continue
                }
                _ = resend.tick() => {
                    let due = self.sh.ledger.due();
                    if !due.is_empty() {
                        tracing::info!(count = due.len(), "resending dones the server has not acked");
                    }
                    for done in due {
                        // A full channel: the next tick tries again.
                        if self.out.try_send(Outgoing::Frame(done.frame())).is_err() {
                            break;
                        }
                    }
                    Flow::Continue
                }
                () = sleep_opt(drain_deadline) => {
                    tracing::warn!(
                        unacked = self.sh.ledger.unacked_len(),
                        "drain: acks did not arrive within {DRAIN_ACK_TIMEOUT:?}; closing anyway"
                    );
                    Flow::End(SessionEnd::Drained)
                }
            };
            if let Flow::End(end) = flow {
                break end;
            }
        };
        self.teardown(&end).await;
        end
    }

    async fn on_message(
        &mut self,
        msg: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
        draining: &mut bool,
    ) -> Flow {
        match msg {
            None => Flow::End(SessionEnd::Lost("server closed the connection".into())),
            Some(Err(e)) => Flow::End(lost("read", e)),
            Some(Ok(Message::Close(_))) => {
                Flow::End(SessionEnd::Lost("server closed the connection".into()))
            }
            Some(Ok(Message::Text(text))) => match parse_frame(text.as_str()) {
                Some(frame) => self.on_frame(frame, draining).await,
                None => Flow::Continue,
            },
            Some(Ok(Message::Binary(b))) => {
                tracing::warn!(bytes = b.len(), "binary frame ignored");
                Flow::Continue
            }
            Some(Ok(_)) => Flow::Continue,
        }
    }

    async fn on_frame(&mut self, frame: ServerFrame, draining: &mut bool) -> Flow {
        match frame {
            ServerFrame::Assign {
                request_id,
                attempt,
                model,
                body,
                api,
                x_request_id,
                traceparent,
                lease_ms,
                tier,
            } => {
                self.on_assign(
                    Assignment {
                        request_id,
                        attempt,
                        model,
                        body,
                        api,
                        x_request_id,
                        traceparent,
                        tier,
                    },
                    lease_ms.map(Duration::from_millis),
                    *draining,
                )
                .await;
            }
            ServerFrame::Cancel {
                request_id,
                attempt,
            } => match self.in_flight.get(&(request_id, attempt)) {
                Some(f) => f.cancel.cancel(),
                None => tracing::debug!(attempt, "cancel of an attempt not in flight ignored"),
            },
            ServerFrame::Ack {
                request_id,
                attempt,
            } => {
                if !self.sh.ledger.ack(&(request_id, attempt)) {
                    tracing::debug!(attempt, "ack of an unknown done ignored");
                }
            }
            ServerFrame::Drain {} => {
                if !*draining {
                    tracing::info!(
                        in_flight = self.in_flight.len(),
                        "draining: no new assignments"
                    );
                }
                *draining = true;
            }
            ServerFrame::LoadModel { name } => {
                // vLLM serves one model per process: another model means another engine
                // (another pod or node), which the platform schedules, not the agent.
                tracing::info!(model = %name, "load_model ignored: the engine serves one model");
            }
            ServerFrame::Registered { .. } => {}
            ServerFrame::Rejected {
                reason,
                retry_after_ms,
            } => {
                return Flow::End(SessionEnd::Rejected {
                    reason,
                    retry_after: retry_after_ms.map(Duration::from_millis),
                });
            }
        }
        Flow::Continue
    }

    async fn on_assign(&mut self, a: Assignment, lease: Option<Duration>, draining: bool) {
        let key = (a.request_id.clone(), a.attempt);
        if draining {
            let refusal = NodeFrame::Error {
                request_id: a.request_id,
                attempt: a.attempt,
                code: "draining".into(),
                message: "the node is draining".into(),
            };
            let _ = self.out.send(Outgoing::Frame(refusal)).await;
            return;
        }
        if self.in_flight.contains_key(&key) || self.sh.ledger.knows(&key) {
            tracing::debug!(request_id = %key.0, attempt = key.1, "duplicate assign ignored");
            return;
        }
        let cancel = self.cancel_all.child_token();
        let ctx = AssignCtx {
            engine: self.sh.engine.clone(),
            out: self.out.clone(),
            ledger: self.sh.ledger.clone(),
            cancel: cancel.clone(),
            faults: self.sh.cfg.faults.clone(),
            protocol: self.protocol,
            engine_priority: self.sh.cfg.engine_priority,
        };
        // Held before its task can send its `accepted`.
        self.holding.hold(key.clone());
        let handle = self.tasks.spawn(assignment::run(a, ctx));
        self.task_keys.insert(handle.id(), key.clone());
        if let Some(lease) = lease {
            self.leases.hold(key.clone(), lease, Instant::now());
        }
        self.in_flight.insert(key, InFlight { cancel });
        self.sh.stats.assignment_started();
        self.sh.stats.set_in_flight(self.in_flight.len());
    }

    fn on_task_end(&mut self, joined: Result<(tokio::task::Id, Key), tokio::task::JoinError>) {
        let id = match &joined {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        if let Some(key) = self.task_keys.remove(&id) {
            self.leases.release(&key);
            self.holding.release(&key);
            self.in_flight.remove(&key);
        }
        if let Err(e) = joined
            && !e.is_cancelled()
        {
            tracing::error!(error = %e, "assignment task failed");
        }
        self.sh.stats.set_in_flight(self.in_flight.len());
    }

    /// Stops, exactly as a `cancel` would, every leased assignment whose server has been
    /// silent for its lease: the server may already have fenced the attempt and dispatched
    /// another. Each records its `done` (`abort`, usage so far), kept until acked.
    fn expire_leases(&mut self) {
        for ((request_id, attempt), lease, silent) in self.leases.expire(Instant::now()) {
            let Some(f) = self.in_flight.get(&(request_id.clone(), attempt)) else {
                continue;
            };
            tracing::warn!(
                %request_id,
                attempt,
                lease_ms = lease.as_millis() as u64,
                silent_ms = silent.as_millis() as u64,
                "lease expired: nothing heard from the server; stopping the attempt"
            );
            f.cancel.cancel();
        }
    }

    /// Cancels what runs. On shutdown or drain the writer gets [`SHUTDOWN_FLUSH`] to send the
    /// dones of cancelled work and a close frame; a lost socket is not written to again.
    async fn teardown(mut self, end: &SessionEnd) {
        self.heartbeat.abort();
        self.cancel_all.cancel();
        match end {
            SessionEnd::Shutdown | SessionEnd::Drained => {
                let flush = async {
                    while self.tasks.join_next().await.is_some() {}
                    let _ = self.out.send(Outgoing::Close).await;
                    join_opt(&mut self.writer).await
                };
                if timeout(SHUTDOWN_FLUSH, flush).await.is_err() {
                    tracing::warn!("could not flush the last frames in time");
                }
            }
            SessionEnd::Lost(_) | SessionEnd::Rejected { .. } => {
                if let Some(w) = self.writer.take() {
                    w.abort();
                }
                let grace = async { while self.tasks.join_next().await.is_some() {} };
                if timeout(TASK_GRACE, grace).await.is_err() {
                    tracing::warn!("assignment tasks slow to stop; aborting them");
                }
            }
        }
        if let Some(w) = self.writer.take() {
            w.abort();
        }
        self.tasks.shutdown().await;
        self.sh.stats.set_in_flight(0);
    }
}

/// Awaits a task that may already have been awaited (then never resolves).
async fn join_opt<T>(h: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match h {
        Some(h) => h.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until the deadline, or forever without one.
async fn sleep_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => sleep_until(d).await,
        None => std::future::pending().await,
    }
}
