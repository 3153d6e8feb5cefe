//! What the simulation shares outside its hosts: the database (a [`MemoryLedger`] with
//! balances, which a crash of a replica leaves alone), what the simulated engines produced,
//! what each client saw, and the invariants checked after every step and at the end.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use switchyard_actors::ports::memory::{MemoryLedger, RowStatus};

/// The teams of the simulation and the credits each starts with; team 2 is short, so its
/// requests meet `insufficient_balance` part way through (a request holds up to 90 µcr).
pub const TEAMS: [(i64, i64); 2] = [(1, 1_000_000_000), (2, 400)];

/// How one client's request ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `Finished` with this many completion tokens billed, after this many streamed.
    Finished { billed: u64, deltas: u64 },
    /// The client hung up after some deltas.
    Abandoned,
    /// A typed failure (before or during the stream).
    Failed(String),
    /// Cancelled with usage.
    Cancelled,
}

/// One request of the plan.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Its id (and its ledger row's).
    pub id: String,
    /// The replica host that takes it.
    pub replica: String,
    /// When, in simulated milliseconds from the start.
    pub at_ms: u64,
    /// The paying team.
    pub team: i64,
    /// Its service tier.
    pub tier: switchyard_actors::tier::Tier,
    /// The output ceiling.
    pub max_tokens: u64,
    /// The client hangs up after this many deltas.
    pub abandon_after: Option<u64>,
}

#[derive(Debug, Default)]
struct State {
    /// Tokens each attempt's engine produced: (request, attempt) → tokens.
    produced: BTreeMap<(String, u64), u64>,
    /// The node each attempt ran on.
    producer: BTreeMap<(String, u64), String>,
    /// Nodes that crashed (with their engine and their unacked `done`s) at least once.
    crashed_nodes: std::collections::BTreeSet<String>,
    /// Assignments each node runs now.
    running: BTreeMap<String, u32>,
    /// Requests a client sent, with the replica incarnation that took it.
    issued: BTreeMap<String, String>,
    /// How each request ended for its client.
    outcomes: BTreeMap<String, Outcome>,
    /// Replica incarnations that crashed.
    crashed: Vec<String>,
    /// Incarnations started per replica host.
    incarnations: BTreeMap<String, u32>,
    /// Broken invariants, as they were seen.
    violations: Vec<String>,
    /// Every outcome in the order it happened (the run's fingerprint).
    trace: Vec<String>,
    /// When each node first ran its whole capacity after the wave (ms).
    full_at: BTreeMap<String, u64>,
    /// The most each node ran at once after the wave (what a failure of the wave shows).
    wave_peak: BTreeMap<String, u32>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct World {
    /// The database.
    pub ledger: Arc<MemoryLedger>,
    /// Assignments one node runs at once at most (the queue's `node_capacity`).
    pub capacity: u32,
    state: Mutex<State>,
}

impl World {
    /// A world whose teams hold their starting credits.
    pub fn new(capacity: u32) -> Self {
        let ledger = Arc::new(MemoryLedger::default());
        for (team, credits) in TEAMS {
            ledger.credit(team, credits);
        }
        Self {
            ledger,
            capacity,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new incarnation of replica host `host` starts: its replica id.
    pub fn incarnate(&self, host: &str) -> String {
        let mut s = self.state();
        let n = s.incarnations.entry(host.to_owned()).or_default();
        *n += 1;
        format!("{host}-{n}")
    }

    /// The replica host `host` crashed: its current incarnation is gone.
    pub fn crashed(&self, host: &str) {
        let mut s = self.state();
        let n = s.incarnations.get(host).copied().unwrap_or(0);
        s.crashed.push(format!("{host}-{n}"));
        s.trace.push(format!("crash {host}-{n}"));
    }

    /// Whether a client already sent `id` (a restarted replica does not send it again).
    pub fn issue(&self, id: &str, replica: &str) -> bool {
        let mut s = self.state();
        if s.issued.contains_key(id) {
            return false;
        }
        s.issued.insert(id.to_owned(), replica.to_owned());
        true
    }

    /// How `id` ended for its client.
    pub fn outcome(&self, id: &str, outcome: Outcome) {
        let mut s = self.state();
        s.trace.push(format!("{id} {outcome:?}"));
        if s.outcomes.insert(id.to_owned(), outcome).is_some() {
            s.violations.push(format!("{id}: two outcomes"));
        }
    }

    /// Node `node` starts an assignment: false (and a violation) beyond its capacity.
    pub fn start_work(&self, node: &str, id: &str, attempt: u64) {
        let mut s = self.state();
        let running = s.running.entry(node.to_owned()).or_default();
        *running += 1;
        let now = *running;
        s.produced.entry((id.to_owned(), attempt)).or_default();
        s.producer.insert((id.to_owned(), attempt), node.to_owned());
        if now > self.capacity {
            s.violations.push(format!(
                "{node} runs {now} assignments, capacity {}",
                self.capacity
            ));
        }
    }

    /// Node `node` produced one token of an attempt.
    pub fn produce(&self, id: &str, attempt: u64) {
        *self
            .state()
            .produced
            .entry((id.to_owned(), attempt))
            .or_default() += 1;
    }

    /// Node `node` finished (or lost) an assignment.
    pub fn end_work(&self, node: &str) {
        if let Some(n) = self.state().running.get_mut(node) {
            *n = n.saturating_sub(1);
        }
    }

    /// The node (re)starts with a new engine: nothing of the old one runs any more.
    pub fn node_died(&self, node: &str) {
        self.state().running.remove(node);
    }

    /// The node crashed with its engine and its unacked `done`s.
    pub fn node_crashed(&self, node: &str) {
        let mut s = self.state();
        s.running.remove(node);
        s.crashed_nodes.insert(node.to_owned());
        s.trace.push(format!("crash {node}"));
    }

    /// After the wave: the first time each node of `nodes` runs its whole capacity.
    pub fn note_full(&self, nodes: &[&str], now_ms: u64) {
        let mut s = self.state();
        for n in nodes {
            let now = s.running.get(*n).copied().unwrap_or(0);
            let peak = s.wave_peak.entry((*n).to_owned()).or_default();
            *peak = (*peak).max(now);
            if now >= self.capacity && !s.full_at.contains_key(*n) {
                s.full_at.insert((*n).to_owned(), now_ms);
                s.trace.push(format!("{n} full at {now_ms}"));
            }
        }
    }

    /// Every node of `nodes` ran its whole capacity within `bound_ms` of the wave at
    /// `wave_ms`: no fault left slots counted that nothing ran.
    pub fn check_capacity_back(
        &self,
        nodes: &[&str],
        wave_ms: u64,
        bound_ms: u64,
    ) -> Result<(), String> {
        let s = self.state();
        let peaks = &s.wave_peak;
        let waves: BTreeMap<String, usize> = s
            .outcomes
            .iter()
            .filter(|(id, _)| id.starts_with("wave-"))
            .fold(BTreeMap::new(), |mut m, (_, o)| {
                let key = format!("{o:?}");
                let key: String = key.chars().take(48).collect();
                *m.entry(key).or_default() += 1;
                m
            });
        let late: Vec<String> = nodes
            .iter()
            .filter(|n| s.full_at.get(**n).is_none_or(|at| *at > wave_ms + bound_ms))
            .map(|n| (*n).to_owned())
            .collect();
        if late.is_empty() {
            return Ok(());
        }
        Err(format!(
            "after the wave, {late:?} never ran their whole capacity within {bound_ms} ms: \
             most run at once {peaks:?}, full at {:?}, the wave's outcomes {waves:?}",
            s.full_at
        ))
    }

    /// The invariants that hold at every instant: the books balance for every team (credits
    /// = balance + settled cost, exactly), and nothing broke an invariant so far.
    pub fn check_step(&self) -> Result<(), String> {
        if let Some(v) = self.state().violations.first() {
            return Err(v.clone());
        }
        for (team, credits) in TEAMS {
            let balance = self.ledger.balance(team).unwrap_or(0);
            let settled = self.ledger.settled_cost(team);
            if credits != balance + settled {
                return Err(format!(
                    "team {team}: credits {credits} != balance {balance} + settled {settled}"
                ));
            }
        }
        Ok(())
    }

    /// Whether the run has come to rest: every request sent has ended for its client (or
    /// went with its replica), no row is reserved but a lost one's, no engine is working.
    pub fn at_rest(&self, plan: &[Planned]) -> bool {
        let s = self.state();
        let open = |id: &str| {
            self.ledger
                .row(id)
                .is_some_and(|r| r.status == RowStatus::Reserved)
        };
        let worked = |id: &str| {
            s.produced
                .range((id.to_owned(), 0)..=(id.to_owned(), u64::MAX))
                .any(|(_, t)| *t > 0)
        };
        s.running.values().all(|n| *n == 0)
            && plan.iter().all(|p| match s.issued.get(&p.id) {
                None => true,
                // Its client went with its replica; a `done` may still settle its row.
                Some(r) if s.crashed.contains(r) => !(open(&p.id) && worked(&p.id)),
                Some(_) => s.outcomes.contains_key(&p.id) && !open(&p.id),
            })
    }

    /// The invariants of a run that has come to rest.
    pub fn check_end(&self, plan: &[Planned]) -> Result<Summary, String> {
        self.check_step()?;
        let s = self.state();
        let mut summary = Summary::default();
        for p in plan {
            let Some(replica) = s.issued.get(&p.id) else {
                // Its replica was down at its time (and came back after): never sent.
                summary.unsent += 1;
                continue;
            };
            let lost = s.crashed.contains(replica);
            let row = self.ledger.row(&p.id);
            match s.outcomes.get(&p.id) {
                None if lost => summary.lost_with_replica += 1,
                None => return Err(format!("{}: its client never saw an end", p.id)),
                Some(o) => *summary.outcomes.entry(kind(o)).or_default() += 1,
            }
            let Some(row) = row else { continue };
            match row.status {
                // The sweeper's: a row whose generation can no longer settle it (its
                // replica died, or it never learned its reservation was made). The sweeper
                // cancels it; that is only right when no engine worked for it.
                RowStatus::Reserved => {
                    let produced: u64 = s
                        .produced
                        .range((p.id.clone(), 0)..=(p.id.clone(), u64::MAX))
                        .map(|(_, t)| *t)
                        .sum();
                    // Unless what knew of the work died with both: the replica that ran the
                    // generation and the node holding the unacked `done`.
                    let both_died = lost
                        && s.producer
                            .range((p.id.clone(), 0)..=(p.id.clone(), u64::MAX))
                            .all(|(_, node)| s.crashed_nodes.contains(node));
                    // Or a reservation in doubt: its answer was lost or came after the
                    // generation gave up (told its client it failed, billing nothing), and the
                    // row it made outlived it.
                    let refused = matches!(s.outcomes.get(&p.id), Some(Outcome::Failed(_)));
                    if produced > 0 && both_died {
                        summary.lost_with_replica_and_node += 1;
                        summary.unbilled_tokens += produced;
                    } else if produced > 0 && refused {
                        summary.in_doubt_after_failure += 1;
                        summary.unbilled_tokens += produced;
                    } else if produced > 0 {
                        return Err(format!(
                            "{}: row still reserved at rest after engines produced {produced} tokens ({p:?}, its client saw {:?}, taken by {replica})",
                            p.id,
                            s.outcomes.get(&p.id)
                        ));
                    }
                    summary.left_to_sweeper += 1;
                }
                RowStatus::Cancelled => summary.cancelled_rows += 1,
                RowStatus::Settled => {
                    summary.settled_rows += 1;
                    let attempts: Vec<u64> = s
                        .produced
                        .range((p.id.clone(), 0)..=(p.id.clone(), u64::MAX))
                        .map(|(_, t)| *t)
                        .collect();
                    let produced: u64 = attempts.iter().sum();
                    // Never more than an attempt's engine produced. Less is the documented
                    // races: a node lost mid-stream is settled from the chunks its generation
                    // received once its `done` is late; a cancelled attempt's last tokens.
                    let most = attempts.iter().copied().max().unwrap_or(0);
                    if row.completion_tokens > most {
                        return Err(format!(
                            "{}: billed {} completion tokens, the engines produced {attempts:?}",
                            p.id, row.completion_tokens
                        ));
                    }
                    summary.unbilled_tokens += produced.saturating_sub(row.completion_tokens);
                    summary.billed_tokens += row.completion_tokens;
                    if let Some(Outcome::Finished { billed, deltas }) = s.outcomes.get(&p.id)
                        && (*billed != row.completion_tokens || *deltas != *billed)
                    {
                        return Err(format!(
                            "{}: the client was streamed {deltas} tokens billed {billed}, the row holds {}",
                            p.id, row.completion_tokens
                        ));
                    }
                }
            }
        }
        Ok(summary)
    }

    /// The run's fingerprint: every outcome and crash in order, and the final rows.
    pub fn fingerprint(&self) -> String {
        let s = self.state();
        let mut out = s.trace.join("\n");
        for row in self.ledger.rows() {
            out.push_str(&format!(
                "\n{} {:?} {} {}",
                row.reservation.request_id, row.status, row.completion_tokens, row.cost
            ));
        }
        out
    }
}

fn kind(o: &Outcome) -> String {
    match o {
        Outcome::Finished { .. } => "finished".into(),
        Outcome::Abandoned => "abandoned".into(),
        Outcome::Cancelled => "cancelled".into(),
        Outcome::Failed(code) => code.clone(),
    }
}

/// What a run came to.
#[derive(Debug, Default)]
pub struct Summary {
    /// Outcomes by kind.
    pub outcomes: BTreeMap<String, u32>,
    /// Requests whose replica was down at their time.
    pub unsent: u32,
    /// Requests whose replica crashed under them (their client went with it).
    pub lost_with_replica: u32,
    /// Rows left reserved, for the sweeper.
    pub left_to_sweeper: u32,
    /// Of those, rows an engine worked for, whose replica and node both crashed before the
    /// `done` was recorded (the work is lost with them, unbilled).
    pub lost_with_replica_and_node: u32,
    /// Of those, rows an engine worked for whose client was told the request failed,
    /// billing nothing (a reservation whose answer was lost or late).
    pub in_doubt_after_failure: u32,
    /// Rows settled.
    pub settled_rows: u32,
    /// Rows cancelled.
    pub cancelled_rows: u32,
    /// Completion tokens billed.
    pub billed_tokens: u64,
    /// Tokens engines produced that no row billed (attempts fenced after a lost node).
    pub unbilled_tokens: u64,
}

impl Summary {
    /// Adds another run's figures.
    pub fn add(&mut self, other: &Summary) {
        for (k, v) in &other.outcomes {
            *self.outcomes.entry(k.clone()).or_default() += v;
        }
        self.unsent += other.unsent;
        self.lost_with_replica += other.lost_with_replica;
        self.left_to_sweeper += other.left_to_sweeper;
        self.lost_with_replica_and_node += other.lost_with_replica_and_node;
        self.in_doubt_after_failure += other.in_doubt_after_failure;
        self.settled_rows += other.settled_rows;
        self.cancelled_rows += other.cancelled_rows;
        self.billed_tokens += other.billed_tokens;
        self.unbilled_tokens += other.unbilled_tokens;
    }
}
