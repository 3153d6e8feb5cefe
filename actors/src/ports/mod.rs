//! The ports through which the actors reach the world: the ledger, cluster coordination and
//! the clock. Production implements them with PostgreSQL and Redis, the embedded mode with
//! SQLite and in-process structures; the actors only ever see these traits, so their tests
//! run in-process with an accelerated clock.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub mod admission;
pub mod memory;

/// Money is integer microcredits, never floats.
pub type Microcredits = i64;

/// A ledger row opened at admission, before any GPU work.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Unique per request; a second reservation with the same id is refused.
    pub request_id: String,
    /// The paying team (taken from the verified credential).
    pub team_id: i64,
    /// The API key used, if the caller used one.
    pub key_id: Option<i64>,
    /// The resolved model version (never an alias).
    pub model: String,
    /// Prompt tokens as estimated at admission.
    pub estimated_prompt_tokens: u64,
    /// The request's output ceiling.
    pub max_tokens: u64,
    /// Cost of the estimate at the model's prices; what the reservation holds.
    pub estimated_cost: Microcredits,
    /// The model's input price at admission, microcredits per million tokens. Stored with
    /// the row so a settle — even one from a `done` resent after a restart — prices the
    /// request as it was admitted.
    pub price_input_per_mtok: Microcredits,
    /// The model's output price at admission, microcredits per million tokens.
    pub price_output_per_mtok: Microcredits,
    /// The most a node may bill for this request (stored with the row, so a settle from any
    /// replica, a resent `done` included, is bounded the same way).
    pub bounds: UsageBounds,
}

/// The largest token count the ledger stores (its integers are signed 64-bit); a report
/// beyond it cannot be true and is a protocol violation.
pub const MAX_TOKEN_COUNT: u64 = i64::MAX as u64;

/// The most a request can honestly use, from what the gateway itself knows: its own count
/// of the prompt plus a margin, and the request's output ceiling within the model's context.
/// A node's report beyond these is clamped to them and its row marked for review.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageBounds {
    /// Prompt tokens at most.
    pub prompt_tokens: u64,
    /// Completion tokens at most.
    pub completion_tokens: u64,
}

/// Usage as billed: the report within the request's [`UsageBounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Billed {
    /// Prompt tokens billed.
    pub prompt_tokens: u64,
    /// Completion tokens billed.
    pub completion_tokens: u64,
    /// The report exceeded a bound and was clamped.
    pub clamped: bool,
}

impl UsageBounds {
    /// No bound but the ledger's integer range (rows admitted before bounds existed).
    pub const UNBOUNDED: Self = Self {
        prompt_tokens: MAX_TOKEN_COUNT,
        completion_tokens: MAX_TOKEN_COUNT,
    };

    /// What the ledger bills for a report of `prompt` and `completion` tokens: each clamped to
    /// its bound. The ledger's SQL does the same in its settle statement and is checked
    /// against this function.
    pub fn bill(&self, prompt: u64, completion: u64) -> Billed {
        // No bound beyond what a ledger can hold.
        let (p, c) = (
            self.prompt_tokens.min(MAX_TOKEN_COUNT),
            self.completion_tokens.min(MAX_TOKEN_COUNT),
        );
        Billed {
            prompt_tokens: prompt.min(p),
            completion_tokens: completion.min(c),
            clamped: prompt > p || completion > c,
        }
    }
}

/// Why a settled row needs an operator's look (the drift report lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReviewReason {
    /// The node reported more than the request's bounds; the row holds the bounds and the
    /// claim beside them.
    UsageOverBound,
    /// The node reported counts no ledger can hold; the row is settled at the bounds.
    UsageUnrepresentable,
    /// The `done` came after the generation was gone and no record said which node held the
    /// attempt (the coordinator lost it): settled within the bounds, unverified.
    UnverifiedNode,
}

impl ReviewReason {
    /// As stored in the row's `review` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UsageOverBound => "usage_over_bound",
            Self::UsageUnrepresentable => "usage_unrepresentable",
            Self::UnverifiedNode => "unverified_node",
        }
    }

    /// Parses [`Self::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::UsageOverBound,
            Self::UsageUnrepresentable,
            Self::UnverifiedNode,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// Cost of `prompt` and `completion` tokens at per-million prices, rounded up to the next
/// microcredit (a request is never free because it was small).
pub fn cost_of(
    prompt: u64,
    completion: u64,
    input_per_mtok: Microcredits,
    output_per_mtok: Microcredits,
) -> Microcredits {
    let micro = i128::from(prompt)
        .saturating_mul(i128::from(input_per_mtok))
        .saturating_add(i128::from(completion).saturating_mul(i128::from(output_per_mtok)));
    let cost = micro.saturating_add(999_999).div_euclid(1_000_000);
    Microcredits::try_from(cost).unwrap_or(Microcredits::MAX)
}

/// The outcome of a request as its node reported it. The ledger bills it within the row's
/// [`UsageBounds`] and prices it with the prices stored in the row ([`cost_of`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settlement {
    /// The request whose row settles.
    pub request_id: String,
    /// Prompt tokens as the engine counted them (a claim, bounded by the row).
    pub prompt_tokens: u64,
    /// Completion tokens as the engine counted them (a claim, bounded by the row).
    pub completion_tokens: u64,
    /// Marks the row for review whatever the counts (a clamped report is marked anyway).
    pub review: Option<ReviewReason>,
    /// The node whose attempt did the work (`usage_ledger.node_id`, for the per-node drift
    /// report); `None` when no node is known (the sweeper).
    #[serde(default)]
    pub node_id: Option<String>,
}

/// One heartbeat interval of a node, added to its row of the day in `node_days` (the cost
/// and drift reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDayUsage {
    /// The node.
    pub node_id: String,
    /// The UTC day the interval ended on.
    pub day: chrono::NaiveDate,
    /// The model the node serves (its first, when it serves several).
    pub model: String,
    /// Whole seconds connected in the interval.
    pub connected_seconds: u64,
    /// GPUs the node registered with.
    pub gpus: u32,
    /// What the engine's prompt-token counter grew by.
    pub engine_prompt_tokens: u64,
    /// What the engine's generation-token counter grew by.
    pub engine_generation_tokens: u64,
    /// Whether the heartbeat carried the engine's counters.
    pub engine_counters: bool,
}

/// Where node actors send their [`NodeDayUsage`]. `record` must return at once (queue the
/// write, never wait for it): it is called on the node actor's path, and a lost interval
/// only costs a report some seconds.
pub trait NodeAccounting: Send + Sync + Debug + 'static {
    /// Queues `usage` to be added to its node's row of the day.
    fn record(&self, usage: NodeDayUsage);
}

/// What a settle or cancel did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleOutcome {
    /// The row moved from `reserved` to its final state now.
    Applied,
    /// The row was already final: nothing changed (a retried settle is a no-op).
    AlreadyFinal,
    /// No row with this request id exists.
    Unknown,
}

/// Failures of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LedgerError {
    /// A row with this request id exists already.
    #[error("a ledger row for this request exists already")]
    Duplicate,
    /// The team's balance minus its open reservations cannot cover the estimate.
    #[error("insufficient balance")]
    InsufficientBalance,
    /// The database could not be reached or failed; admission fails closed.
    #[error("ledger unavailable: {0}")]
    Unavailable(String),
}

/// The authoritative ledger: one row per request, reserved at admission and settled or
/// cancelled exactly once.
#[async_trait]
pub trait Ledger: Send + Sync + Debug + 'static {
    /// Inserts the `reserved` row.
    async fn reserve(&self, reservation: &Reservation) -> Result<(), LedgerError>;
    /// Reserves every row of `batch` as [`Ledger::reserve`] would one after the other, in
    /// order, and answers each in the same position: a taken id is `Duplicate`, one the
    /// balance cannot cover is `InsufficientBalance` and a later, smaller one may still fit.
    /// A native implementation decides them all in one transaction (group commit); this
    /// default reserves one by one, so every ledger works.
    async fn reserve_batch(&self, batch: &[Reservation]) -> Vec<Result<(), LedgerError>> {
        self.reserve_batch_report(batch).await.results
    }
    /// [`Ledger::reserve_batch`], also reporting what each team of the batch has left once
    /// it committed (balance minus open reservations), when the implementation knows it
    /// without another query. The default reserves one by one and knows nothing.
    async fn reserve_batch_report(&self, batch: &[Reservation]) -> BatchReport {
        let mut results = Vec::with_capacity(batch.len());
        for r in batch {
            results.push(self.reserve(r).await);
        }
        BatchReport {
            results,
            available: BTreeMap::new(),
        }
    }
    /// Moves a `reserved` row to `settled` with the reported usage clamped to the row's bounds
    /// ([`UsageBounds::bill`]; a clamped row keeps the claim and is marked for review), its
    /// cost from the row's prices ([`cost_of`]), and debits the team, in one transaction; a
    /// final row is left alone.
    async fn settle(&self, settlement: &Settlement) -> Result<SettleOutcome, LedgerError>;
    /// Moves a `reserved` row to `cancelled` (no GPU work was done); final rows are left alone.
    async fn cancel(&self, request_id: &str) -> Result<SettleOutcome, LedgerError>;
    /// Where the row of `request_id` stands and what it billed (`None`: no such row), so that
    /// what a client or a record is told is what the ledger holds.
    async fn entry(&self, request_id: &str) -> Result<Option<LedgerEntry>, LedgerError>;
}

/// What [`Ledger::reserve_batch_report`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchReport {
    /// One answer per reservation, in the batch's order.
    pub results: Vec<Result<(), LedgerError>>,
    /// By team: its balance minus its open reservations as the batch committed them. Only a
    /// snapshot — credits and settles change it at any time — so it may inform metrics and
    /// logs, never skip the ledger's own check.
    pub available: BTreeMap<i64, Microcredits>,
}

/// A ledger row as far as the actors need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The model version it was admitted for (the `model` label of what its settle billed,
    /// for a settle that has nothing else to read it from: an orphan `done`).
    pub model: String,
    /// The bounds it was reserved with ([`UsageBounds::UNBOUNDED`] for a row admitted before
    /// bounds existed).
    pub bounds: UsageBounds,
    /// Where it stands.
    pub status: EntryStatus,
}

/// Where a ledger row stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryStatus {
    /// Open.
    Reserved,
    /// Final, billed these counts.
    Settled {
        /// Prompt tokens billed.
        prompt_tokens: u64,
        /// Completion tokens billed.
        completion_tokens: u64,
    },
    /// Final, billed nothing.
    Cancelled,
}

/// Failures of the coordination backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoordError {
    /// Redis (or whatever backs it) could not be reached; callers fail closed.
    #[error("coordination unavailable: {0}")]
    Unavailable(String),
}

/// The answer of a limit check ([`Coordinator::acquire_slot`], [`Coordinator::window_admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitVerdict {
    /// Whether the caller got in.
    pub admitted: bool,
    /// Members counted after the check (the caller included when admitted).
    pub count: u32,
    /// When refused: milliseconds until a place frees (the oldest member leaves). When
    /// admitted: milliseconds until the oldest member leaves (the window's reset).
    pub wait_ms: u64,
}

/// Cluster-wide coordination, shaped after Redis: expiring hashes (node heartbeats), leases
/// with fencing tokens (who owns a model queue or a team budget), counters and pub/sub.
#[async_trait]
pub trait Coordinator: Send + Sync + Debug + 'static {
    /// Replaces the hash at `key` with `fields`; it expires `ttl` after this write.
    async fn put_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<(), CoordError>;
    /// The hash at `key`, if it exists and has not expired.
    async fn get_hash(&self, key: &str) -> Result<Option<BTreeMap<String, String>>, CoordError>;
    /// Removes `key` whatever it holds.
    async fn delete(&self, key: &str) -> Result<(), CoordError>;
    /// A new owner takes the hash at `key`: the key's fencing token (shared with a lease of
    /// the same name) goes up, the hash is replaced with `fields` plus `fence` = that token,
    /// expiring `ttl` after this write. Returns the token. One atomic step.
    async fn claim_hash(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        ttl: Duration,
    ) -> Result<u64, CoordError>;
    /// The owner holding `fence` refreshes its hash (as [`Coordinator::claim_hash`] wrote it);
    /// false, and nothing written, once a newer claim took the key.
    async fn put_hash_fenced(
        &self,
        key: &str,
        fields: &BTreeMap<String, String>,
        fence: u64,
        ttl: Duration,
    ) -> Result<bool, CoordError>;
    /// The owner holding `fence` removes its hash; false, and nothing removed, once a newer
    /// claim took the key.
    async fn delete_fenced(&self, key: &str, fence: u64) -> Result<bool, CoordError>;
    /// Takes the lease `name` for `owner` for `ttl`, or renews it if `owner` holds it.
    /// Returns the fencing token — strictly greater for every new holder — or `None` when
    /// another owner holds an unexpired lease.
    async fn acquire_lease(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, CoordError>;
    /// Gives the lease up if `owner` holds it.
    async fn release_lease(&self, name: &str, owner: &str) -> Result<(), CoordError>;
    /// Who holds the lease `name` now, if anyone (a snapshot: it may change the next moment).
    async fn lease_holder(&self, name: &str) -> Result<Option<String>, CoordError>;
    /// Whether other replicas share this coordinator (Redis), so a generation may live on
    /// another replica while a record of it is missing here (lost when the shared store came
    /// back empty). An in-process coordinator is lost only with its replica and every
    /// generation on it: a missing record there means the generation is gone.
    fn is_shared(&self) -> bool {
        false
    }
    /// Adds `by` to the counter at `key` (created at 0 with expiry `ttl`); returns the sum.
    async fn incr(&self, key: &str, by: i64, ttl: Duration) -> Result<i64, CoordError>;
    /// Takes a place for `member` in the bounded set at `key` (at most `limit` members; a
    /// member expires `ttl` after `now_ms`, so a crashed holder cannot keep a place). A
    /// member already present is renewed and admitted. One atomic step (a Redis script).
    async fn acquire_slot(
        &self,
        key: &str,
        member: &str,
        limit: u32,
        now_ms: i64,
        ttl: Duration,
    ) -> Result<LimitVerdict, CoordError>;
    /// Gives `member`'s place back.
    async fn release_slot(&self, key: &str, member: &str) -> Result<(), CoordError>;
    /// Sliding-window log: admits `member` at `now_ms` if fewer than `limit` members were
    /// admitted in the `window` before it (exact at the boundary, unlike fixed buckets).
    async fn window_admit(
        &self,
        key: &str,
        member: &str,
        now_ms: i64,
        window: Duration,
        limit: u32,
    ) -> Result<LimitVerdict, CoordError>;
    /// Sends `payload` to every current subscriber of `channel`, in publish order. Returns
    /// how many listeners received it (Redis counts subscribed connections, one per replica;
    /// 0 means nobody listens: the receiving replica is gone).
    async fn publish(&self, channel: &str, payload: Vec<u8>) -> Result<usize, CoordError>;
    /// Subscribes to `channel`; messages published from now on arrive on the receiver.
    async fn subscribe(
        &self,
        channel: &str,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>, CoordError>;
    /// Appends `events` to the event journal at `key`, numbered `first_seq`, `first_seq + 1`,
    /// …; numbers the journal already holds (or below its last) are skipped, so a retried
    /// append is harmless, while a number past the last leaves a gap the reader sees. The
    /// journal expires `ttl` after this append. Wakes readers blocked on `key`.
    ///
    /// The default keeps no journal (test doubles that never journal); both real
    /// coordinators implement it.
    async fn append_events(
        &self,
        key: &str,
        first_seq: u64,
        events: Vec<Vec<u8>>,
        ttl: Duration,
    ) -> Result<(), CoordError> {
        let _ = (key, first_seq, events, ttl);
        Err(CoordError::Unavailable(
            "this coordinator keeps no event journal".to_owned(),
        ))
    }
    /// Up to `max` events of the journal at `key` numbered after `after` (`None`: from the
    /// first), in order, with their numbers. When there is none yet, waits up to `block` for
    /// an append before answering (possibly empty). A missing or expired journal reads as
    /// empty.
    async fn read_events(
        &self,
        key: &str,
        after: Option<u64>,
        max: usize,
        block: Duration,
    ) -> Result<Vec<(u64, Vec<u8>)>, CoordError> {
        let _ = (key, after, max, block);
        Err(CoordError::Unavailable(
            "this coordinator keeps no event journal".to_owned(),
        ))
    }
}

/// Time, injected so tests and simulations control it (STYLE item 16).
pub trait Clock: Send + Sync + Debug + 'static {
    /// Monotonic time for deadlines and durations (tokio's clock, pausable in tests).
    fn now(&self) -> tokio::time::Instant;
    /// Wall-clock time for records and windows.
    fn wall(&self) -> DateTime<Utc>;
}

/// The real clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
    fn wall(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bills_within_the_bounds() {
        let b = UsageBounds {
            prompt_tokens: 100,
            completion_tokens: 5,
        };
        assert_eq!(
            b.bill(30, 5),
            Billed {
                prompt_tokens: 30,
                completion_tokens: 5,
                clamped: false
            }
        );
        assert_eq!(
            b.bill(30, 100_000),
            Billed {
                prompt_tokens: 30,
                completion_tokens: 5,
                clamped: true
            }
        );
        assert_eq!(b.bill(u64::MAX, u64::MAX).prompt_tokens, 100);
        assert!(!UsageBounds::UNBOUNDED.bill(1 << 62, 0).clamped);
        let huge = UsageBounds::UNBOUNDED.bill(u64::MAX, 0);
        assert_eq!(
            (huge.prompt_tokens, huge.clamped),
            (MAX_TOKEN_COUNT, true),
            "nothing beyond what a ledger holds"
        );
    }

    #[test]
    fn cost_rounds_up_to_the_microcredit() {
        assert_eq!(cost_of(0, 0, 100, 200), 0);
        assert_eq!(
            cost_of(1, 0, 1, 0),
            1,
            "a millionth of a microcredit still costs one"
        );
        assert_eq!(cost_of(1_000_000, 1_000_000, 150_000, 600_000), 750_000);
        assert_eq!(
            cost_of(u64::MAX, u64::MAX, i64::MAX, i64::MAX),
            i64::MAX,
            "saturates"
        );
    }
}
