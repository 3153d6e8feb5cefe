//! The coordinator as a host on the simulated network: the embedded [`MemoryCoordinator`]
//! (Redis's semantics) served over turmoil TCP, and a [`Coordinator`] client that reaches it
//! the way a replica reaches Redis — one command connection (commands in order, a timeout
//! on each answer, a new connection after any failure) and one connection per subscription
//! (lost with the connection, as Redis pub/sub is). Partitions, delays and crashes of the
//! simulation therefore hit the replicas' coordination exactly where production's would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use switchyard::coord::MemoryCoordinator;
use switchyard_actors::ports::{CoordError, Coordinator, LimitVerdict};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Mutex, mpsc};
use turmoil::net::{TcpListener, TcpStream};

/// The coordinator's port on its host.
pub const PORT: u16 = 6379;
/// How long a command waits for its answer before the connection is taken for dead.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// How often a subscription's connection carries a keepalive.
const SUBSCRIPTION_KEEPALIVE: Duration = Duration::from_secs(1);
/// A subscription silent this long is dead (its connection cut by a partition, its server
/// gone without a word): it ends, and the subscriber subscribes again.
const SUBSCRIPTION_SILENT: Duration = Duration::from_secs(3);
/// Frames larger than this are refused (a corrupt length).
const MAX_FRAME: u32 = 16 << 20;

type Fields = BTreeMap<String, String>;

/// One command.
#[derive(Debug, Serialize, Deserialize)]
enum Call {
    PutHash(String, Fields, u64),
    GetHash(String),
    Delete(String),
    ClaimHash(String, Fields, u64),
    PutHashFenced(String, Fields, u64, u64),
    DeleteFenced(String, u64),
    AcquireLease(String, String, u64),
    ReleaseLease(String, String),
    LeaseHolder(String),
    Incr(String, i64, u64),
    AcquireSlot(String, String, u32, i64, u64),
    ReleaseSlot(String, String),
    WindowAdmit(String, String, i64, u64, u32),
    Publish(String, Vec<u8>),
    Subscribe(String),
    AppendEvents(String, u64, Vec<Vec<u8>>, u64),
    ReadEvents(String, Option<u64>, usize, u64),
}

/// One answer (or, on a subscription's connection, one message).
#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    Unit,
    Hash(Option<Fields>),
    Number(u64),
    Flag(bool),
    Lease(Option<u64>),
    Holder(Option<String>),
    Count(i64),
    Verdict(bool, u32, u64),
    Events(Vec<(u64, Vec<u8>)>),
    Message(Vec<u8>),
    Failed(String),
}

/// A WebSocket control frame, which the node protocol's transport has beside its text
/// frames: the agent pings with every heartbeat and the server answers with a pong (the
/// server's WebSocket library does so for `/v1/nodes/connect`), so an agent whose server has
/// gone silent ends the connection however TCP sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    Ping,
    Pong,
}

impl Control {
    /// `value` if it is this control frame.
    pub fn is(self, value: &serde_json::Value) -> bool {
        serde_json::from_value::<Control>(value.clone()).is_ok_and(|c| c == self)
    }
}

/// Writes one length-prefixed JSON frame.
pub async fn write_frame<T: Serialize>(
    s: &mut (impl AsyncWrite + Unpin),
    value: &T,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
    s.write_all(&len.to_be_bytes()).await?;
    s.write_all(&body).await?;
    s.flush().await
}

/// Reads one length-prefixed JSON frame.
pub async fn read_frame<T: for<'de> Deserialize<'de>>(
    s: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_FRAME {
        return Err(std::io::Error::other("frame too large"));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(std::io::Error::other)
}

fn ms(d: u64) -> Duration {
    Duration::from_millis(d)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The coordinator host's software: serves `coord` until the host crashes. A crash keeps
/// the keyspace (it lives outside the host, as an AOF-backed Redis's would survive a
/// restart; the simulation empties it for a Redis without persistence) but drops every
/// connection, so subscribers lose what was published meanwhile.
pub async fn serve(coord: Arc<MemoryCoordinator>) -> turmoil::Result {
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(connection(coord.clone(), stream));
    }
}

async fn connection(coord: Arc<MemoryCoordinator>, mut s: TcpStream) {
    loop {
        let Ok(call) = read_frame::<Call>(&mut s).await else {
            return;
        };
        if let Call::Subscribe(channel) = call {
            let Ok(mut rx) = coord.subscribe(&channel).await else {
                return;
            };
            if write_frame(&mut s, &Answer::Unit).await.is_err() {
                return;
            }
            // The connection now only carries messages, and a keepalive every second (the
            // real coordinator's pub/sub connection is health-checked the same way, so a
            // subscriber cut off by a partition learns it); it ends with the first failed
            // write (the subscriber is gone) and the subscription with it.
            let mut keepalive = tokio::time::interval(SUBSCRIPTION_KEEPALIVE);
            loop {
                let frame = tokio::select! {
                    msg = rx.recv() => match msg {
                        Some(msg) => Answer::Message(msg),
                        None => return,
                    },
                    _ = keepalive.tick() => Answer::Unit,
                };
                if write_frame(&mut s, &frame).await.is_err() {
                    return;
                }
            }
        }
        let answer = run(&coord, call)
            .await
            .unwrap_or_else(|e| Answer::Failed(e.to_string()));
        if write_frame(&mut s, &answer).await.is_err() {
            return;
        }
    }
}

async fn run(c: &MemoryCoordinator, call: Call) -> Result<Answer, CoordError> {
    Ok(match call {
        Call::PutHash(k, f, ttl) => {
            c.put_hash(&k, &f, ms(ttl)).await?;
            Answer::Unit
        }
        Call::GetHash(k) => Answer::Hash(c.get_hash(&k).await?),
        Call::Delete(k) => {
            c.delete(&k).await?;
            Answer::Unit
        }
        Call::ClaimHash(k, f, ttl) => Answer::Number(c.claim_hash(&k, &f, ms(ttl)).await?),
        Call::PutHashFenced(k, f, fence, ttl) => {
            Answer::Flag(c.put_hash_fenced(&k, &f, fence, ms(ttl)).await?)
        }
        Call::DeleteFenced(k, fence) => Answer::Flag(c.delete_fenced(&k, fence).await?),
        Call::AcquireLease(n, o, ttl) => Answer::Lease(c.acquire_lease(&n, &o, ms(ttl)).await?),
        Call::ReleaseLease(n, o) => {
            c.release_lease(&n, &o).await?;
            Answer::Unit
        }
        Call::LeaseHolder(n) => Answer::Holder(c.lease_holder(&n).await?),
        Call::Incr(k, by, ttl) => Answer::Count(c.incr(&k, by, ms(ttl)).await?),
        Call::AcquireSlot(k, m, limit, now, ttl) => {
            let v = c.acquire_slot(&k, &m, limit, now, ms(ttl)).await?;
            Answer::Verdict(v.admitted, v.count, v.wait_ms)
        }
        Call::ReleaseSlot(k, m) => {
            c.release_slot(&k, &m).await?;
            Answer::Unit
        }
        Call::WindowAdmit(k, m, now, window, limit) => {
            let v = c.window_admit(&k, &m, now, ms(window), limit).await?;
            Answer::Verdict(v.admitted, v.count, v.wait_ms)
        }
        Call::Publish(ch, p) => {
            Answer::Count(i64::try_from(c.publish(&ch, p).await?).unwrap_or(i64::MAX))
        }
        Call::AppendEvents(k, first, events, ttl) => {
            c.append_events(&k, first, events, ms(ttl)).await?;
            Answer::Unit
        }
        Call::ReadEvents(k, after, max, block) => {
            Answer::Events(c.read_events(&k, after, max, ms(block)).await?)
        }
        Call::Subscribe(_) => Answer::Failed("subscribe on a command connection".into()),
    })
}

/// Sends `call` and reads its answer within `within`.
async fn exchange(
    stream: &mut TcpStream,
    call: &Call,
    within: Duration,
) -> Result<Answer, CoordError> {
    tokio::time::timeout(within, async {
        write_frame(stream, call).await?;
        read_frame::<Answer>(stream).await
    })
    .await
    .map_err(down)?
    .map_err(down)
}

/// A failure the coordinator answered is the caller's error.
fn answered(answer: Answer) -> Result<Answer, CoordError> {
    match answer {
        Answer::Failed(e) => Err(CoordError::Unavailable(e)),
        a => Ok(a),
    }
}

/// A replica's connection to the coordinator host.
#[derive(Debug)]
pub struct NetCoordinator {
    host: String,
    conn: Mutex<Option<TcpStream>>,
}

fn down(e: impl std::fmt::Display) -> CoordError {
    CoordError::Unavailable(e.to_string())
}

fn unexpected(a: &Answer) -> CoordError {
    CoordError::Unavailable(format!("unexpected answer {a:?}"))
}

impl NetCoordinator {
    /// A client of the coordinator on `host`.
    pub fn new(host: &str) -> Self {
        Self {
            host: host.to_owned(),
            conn: Mutex::new(None),
        }
    }

    async fn connect(&self) -> Result<TcpStream, CoordError> {
        tokio::time::timeout(
            ANSWER_WITHIN,
            TcpStream::connect((self.host.as_str(), PORT)),
        )
        .await
        .map_err(down)?
        .map_err(down)
    }

    /// One command on the shared connection, in order with the others.
    async fn call(&self, call: Call) -> Result<Answer, CoordError> {
        let mut conn = self.conn.lock().await;
        let mut stream = match conn.take() {
            Some(s) => s,
            None => self.connect().await?,
        };
        let answer = exchange(&mut stream, &call, ANSWER_WITHIN).await?;
        // Only a connection that answered is kept: after a timeout the late answer would
        // be read as the next command's.
        *conn = Some(stream);
        answered(answer)
    }

    /// A command on a connection of its own (a blocking read must not hold up the rest).
    async fn call_alone(&self, call: Call, within: Duration) -> Result<Answer, CoordError> {
        let mut stream = self.connect().await?;
        answered(exchange(&mut stream, &call, within + ANSWER_WITHIN).await?)
    }

    async fn unit(&self, call: Call) -> Result<(), CoordError> {
        match self.call(call).await? {
            Answer::Unit => Ok(()),
            a => Err(unexpected(&a)),
        }
    }

    async fn flag(&self, call: Call) -> Result<bool, CoordError> {
        match self.call(call).await? {
            Answer::Flag(b) => Ok(b),
            a => Err(unexpected(&a)),
        }
    }

    async fn verdict(&self, call: Call) -> Result<LimitVerdict, CoordError> {
        match self.call(call).await? {
            Answer::Verdict(admitted, count, wait_ms) => Ok(LimitVerdict {
                admitted,
                count,
                wait_ms,
            }),
            a => Err(unexpected(&a)),
        }
    }
}

#[async_trait]
impl Coordinator for NetCoordinator {
    fn is_shared(&self) -> bool {
        true
    }

    async fn put_hash(&self, key: &str, fields: &Fields, ttl: Duration) -> Result<(), CoordError> {
        self.unit(Call::PutHash(key.into(), fields.clone(), millis(ttl)))
            .await
    }

    async fn get_hash(&self, key: &str) -> Result<Option<Fields>, CoordError> {
        match self.call(Call::GetHash(key.into())).await? {
            Answer::Hash(h) => Ok(h),
            a => Err(unexpected(&a)),
        }
    }

    async fn delete(&self, key: &str) -> Result<(), CoordError> {
        self.unit(Call::Delete(key.into())).await
    }

    async fn claim_hash(
        &self,
        key: &str,
        fields: &Fields,
        ttl: Duration,
    ) -> Result<u64, CoordError> {
        match self
            .call(Call::ClaimHash(key.into(), fields.clone(), millis(ttl)))
            .await?
        {
            Answer::Number(n) => Ok(n),
            a => Err(unexpected(&a)),
        }
    }

    async fn put_hash_fenced(
        &self,
        key: &str,
        fields: &Fields,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, CoordError> {
        self.flag(Call::PutHashFenced(
            key.into(),
            fields.clone(),
            fence,
            millis(ttl),
        ))
        .await
    }

    async fn delete_fenced(&self, key: &str, fence: u64) -> Result<bool, CoordError> {
        self.flag(Call::DeleteFenced(key.into(), fence)).await
    }

    async fn acquire_lease(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, CoordError> {
        match self
            .call(Call::AcquireLease(name.into(), owner.into(), millis(ttl)))
            .await?
        {
            Answer::Lease(l) => Ok(l),
            a => Err(unexpected(&a)),
        }
    }

    async fn release_lease(&self, name: &str, owner: &str) -> Result<(), CoordError> {
        self.unit(Call::ReleaseLease(name.into(), owner.into()))
            .await
    }

    async fn lease_holder(&self, name: &str) -> Result<Option<String>, CoordError> {
        match self.call(Call::LeaseHolder(name.into())).await? {
            Answer::Holder(h) => Ok(h),
            a => Err(unexpected(&a)),
        }
    }

    async fn incr(&self, key: &str, by: i64, ttl: Duration) -> Result<i64, CoordError> {
        match self.call(Call::Incr(key.into(), by, millis(ttl))).await? {
            Answer::Count(n) => Ok(n),
            a => Err(unexpected(&a)),
        }
    }

    async fn acquire_slot(
        &self,
        key: &str,
        member: &str,
        limit: u32,
        now_ms: i64,
        ttl: Duration,
    ) -> Result<LimitVerdict, CoordError> {
        self.verdict(Call::AcquireSlot(
            key.into(),
            member.into(),
            limit,
            now_ms,
            millis(ttl),
        ))
        .await
    }

    async fn release_slot(&self, key: &str, member: &str) -> Result<(), CoordError> {
        self.unit(Call::ReleaseSlot(key.into(), member.into()))
            .await
    }

    async fn window_admit(
        &self,
        key: &str,
        member: &str,
        now_ms: i64,
        window: Duration,
        limit: u32,
    ) -> Result<LimitVerdict, CoordError> {
        self.verdict(Call::WindowAdmit(
            key.into(),
            member.into(),
            now_ms,
            millis(window),
            limit,
        ))
        .await
    }

    async fn publish(&self, channel: &str, payload: Vec<u8>) -> Result<usize, CoordError> {
        match self.call(Call::Publish(channel.into(), payload)).await? {
            Answer::Count(n) => Ok(usize::try_from(n).unwrap_or(0)),
            a => Err(unexpected(&a)),
        }
    }

    async fn subscribe(
        &self,
        channel: &str,
    ) -> Result<mpsc::UnboundedReceiver<Vec<u8>>, CoordError> {
        let mut stream = self.connect().await?;
        let ack = exchange(&mut stream, &Call::Subscribe(channel.into()), ANSWER_WITHIN).await?;
        if !matches!(ack, Answer::Unit) {
            return Err(unexpected(&ack));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            // Ends with the connection, after a silence past its keepalives, or once nobody
            // listens: the receiver then closes and the subscriber subscribes again, as after
            // a lost Redis connection.
            while let Ok(Ok(answer)) =
                tokio::time::timeout(SUBSCRIPTION_SILENT, read_frame::<Answer>(&mut stream)).await
            {
                match answer {
                    Answer::Message(msg) => {
                        if tx.send(msg).is_err() {
                            return;
                        }
                    }
                    Answer::Unit => {}
                    _ => return,
                }
            }
        });
        Ok(rx)
    }

    async fn append_events(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        self.unit(Call::AppendEvents(
            key.into(),
            first_seq,
            events,
            millis(ttl),
        ))
        .await
    }

    async fn read_events(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        let call = Call::ReadEvents(key.into(), after, max, millis(block));
        let answer = if block.is_zero() {
            self.call(call).await?
        } else {
            self.call_alone(call, block).await?
        };
        match answer {
            Answer::Events(e) => Ok(e),
            a => Err(unexpected(&a)),
        }
    }
}
