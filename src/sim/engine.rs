//! The simulated GPU: one scheduler loop doing continuous batching over a paged KV cache.
//!
//! Each step decodes one token for every running sequence and prefills prompt chunks within a
//! token budget; it lasts `base + per_seq * b + prefill_tokens / prefill_rate` (divided by the
//! time scale). Sequences wait FCFS for a slot (`max_num_seqs`) and for KV blocks; when a
//! growing sequence finds no free block, the most recently admitted one is preempted and will
//! be recomputed, as vLLM does. A sequence whose receiver is gone (client left) is freed at the
//! next step. Prompts share cached prefix blocks ([`kv`]): the blocks a prompt starts with that
//! the cache holds are not prefilled again.
//!
//! With [`Timing::Fixed`] none of that runs: each sequence gets its own timer (see [`fixed`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::SimError;
use super::metrics::{EngineStats, FinishedReason};
use super::profile::{ProfileSpec, Timing};
use super::tokenizer::{Generator, Stop, TokenLogprobs};

/// Bounds on how far behind schedule the engine may run before it re-anchors to now instead
/// of catching up (four steps, within these limits).
const MIN_LAG: Duration = Duration::from_millis(5);
const MAX_LAG: Duration = Duration::from_millis(200);
/// How often an idle engine looks for clients that left while their sequence was stalled.
const IDLE_TICK: Duration = Duration::from_millis(50);

/// Fixed engine parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The replica's physics.
    pub spec: ProfileSpec,
    /// Modeled by `spec`, or fixed per stream.
    pub timing: Timing,
    /// Most sequences in a batch (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step, decode and prefill together (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// KV blocks in the cache.
    pub num_blocks: u64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Prompts reuse cached prefix blocks (vLLM's default; `--no-enable-prefix-caching`).
    pub prefix_caching: bool,
    /// Context limit; generation stops there.
    pub max_model_len: u32,
    /// Every delay is divided by this.
    pub time_scale: f64,
}

impl EngineConfig {
    /// A replica of `spec` with vLLM's defaults: 90 % of GPU memory, 256 sequences, 2,048
    /// tokens a step, blocks of `block_size`, prefix caching on, real time.
    pub fn modeled(spec: super::ProfileSpec, block_size: u32) -> Self {
        Self {
            num_blocks: spec.num_gpu_blocks(0.9, block_size),
            max_model_len: spec.max_model_len,
            spec,
            timing: Timing::Modeled,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            block_size,
            prefix_caching: true,
            time_scale: 1.0,
        }
    }
}

/// One request as the engine sees it.
#[derive(Debug)]
pub struct SeqParams {
    /// Prompt tokens after the chat template.
    pub prompt_tokens: u32,
    /// Tokens to generate at most (already capped by the context limit).
    pub max_tokens: u32,
    /// The model "emits its end-of-sequence token" as this token (1-based), ending with
    /// `finish_reason: stop` and no `stop_reason`, as a chat model does when it is done.
    pub eos_at: Option<u32>,
    /// Sampler and detokenizer.
    pub generator: Generator,
    /// Fault: cut the stream after this many tokens.
    pub crash_after: Option<u32>,
    /// Fault: stop producing after this many tokens.
    pub stall_after: Option<u32>,
    /// Fault: the sequence may not be scheduled before this wall-clock delay.
    pub first_token_delay: Duration,
    /// The hash chain of the prompt's full KV blocks ([`kv::block_hashes`]); empty when
    /// prefix caching is off.
    pub block_hashes: Vec<u64>,
}

/// Why a sequence ended, with its exact usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finish {
    /// `stop` or `length`.
    pub reason: FinishedReason,
    /// The stop string that matched, if any.
    pub stop: Option<String>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens, including the one that hit a stop string.
    pub completion_tokens: u32,
    /// Prompt tokens read from the prefix cache, and prompt tokens this request added to it
    /// (`prompt_tokens_details.cached_tokens` / `created_cache_tokens`).
    pub cache: CacheUse,
}

/// A prompt's use of the prefix cache, in tokens: full blocks only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUse {
    /// Read from the cache instead of prefilled.
    pub cached: u32,
    /// Computed and cached for the requests after it.
    pub created: u32,
}

impl CacheUse {
    /// The use of a prompt of `prompt_tokens` whose first `hit` of `hashed` full blocks of
    /// `block_size` were cached (the last prompt token is always computed, so a hit stops
    /// before it); the prompt's other full blocks are created.
    pub fn of(prompt_tokens: u32, block_size: u32, hashed: usize, hit: usize) -> Self {
        let most = Self::most_blocks(prompt_tokens, block_size).min(hashed);
        let hit = u32::try_from(hit.min(most)).unwrap_or(u32::MAX);
        let full = u32::try_from(hashed).unwrap_or(u32::MAX);
        Self {
            cached: hit * block_size,
            created: full.saturating_sub(hit) * block_size,
        }
    }

    /// Full blocks of a prompt of `prompt_tokens` that a cache hit may cover.
    pub fn most_blocks(prompt_tokens: u32, block_size: u32) -> usize {
        usize::try_from(prompt_tokens.saturating_sub(1) / block_size.max(1)).unwrap_or(0)
    }
}

/// What a sequence's receiver gets.
#[derive(Debug)]
pub enum SeqEvent {
    /// One generated token's text (possibly empty); the last one carries `finish`.
    Token {
        /// Text that may be sent now.
        delta: String,
        /// Tokens generated so far, this one included (for continuous usage stats).
        generated: u32,
        /// Set on the final token.
        finish: Option<Finish>,
        /// The token's log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
    },
    /// The engine died under this sequence: the connection must be cut.
    Crashed,
}

enum Command {
    Add(Box<Seq>),
    CrashAll,
}

/// Cloneable access to a running engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    /// Set with fixed timing: sequences are timed by their own tasks, not the loop.
    fixed: Option<Arc<fixed::FixedEngine>>,
}

impl EngineHandle {
    /// Starts the scheduler loop on the current runtime.
    pub fn spawn(cfg: EngineConfig) -> (Self, tokio::task::JoinHandle<()>) {
        Self::spawn_with(cfg, None)
    }

    /// [`EngineHandle::spawn`], with the prefix cache's blocks readable through `probe`
    /// (modeled timing only).
    pub fn spawn_probed(
        cfg: EngineConfig,
        probe: kv::CacheProbe,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        Self::spawn_with(cfg, Some(probe))
    }

    fn spawn_with(
        cfg: EngineConfig,
        probe: Option<kv::CacheProbe>,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(Mutex::new(EngineStats::new(cfg.num_blocks)));
        if let Timing::Fixed { ttft, itl } = cfg.timing {
            let fixed = fixed::FixedEngine::new(
                ttft.div_f64(cfg.time_scale),
                itl.div_f64(cfg.time_scale),
                cfg.max_model_len,
                cfg.block_size,
                stats.clone(),
            );
            // The loop only keeps the channel's receiver alive: nothing is sent on it.
            let task = tokio::spawn(async move {
                let mut rx = rx;
                while rx.recv().await.is_some() {}
            });
            let fixed = Some(Arc::new(fixed));
            return (Self { tx, stats, fixed }, task);
        }
        let kv = kv::KvCache::new(cfg.num_blocks);
        let engine = Engine {
            kv: match probe {
                Some(p) => kv.with_probe(p),
                None => kv,
            },
            cfg,
            waiting: VecDeque::new(),
            deferred: Vec::new(),
            running: Vec::new(),
            stats: stats.clone(),
        };
        let task = tokio::spawn(engine.run(rx));
        (
            Self {
                tx,
                stats,
                fixed: None,
            },
            task,
        )
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// aborts the sequence and frees its blocks.
    pub fn submit(&self, params: SeqParams) -> Result<mpsc::UnboundedReceiver<SeqEvent>, SimError> {
        let (events, rx) = mpsc::unbounded_channel();
        let now = Instant::now();
        let not_before = (!params.first_token_delay.is_zero())
            .then(|| now.checked_add(params.first_token_delay))
            .flatten();
        let seq = Seq {
            params,
            events,
            arrived: now,
            not_before,
            generated: 0,
            computed: 0,
            held: kv::Held::default(),
            cache: None,
            scheduled_at: None,
            last_token_at: None,
            stalled: false,
            prompt_counted: false,
        };
        if let Some(fixed) = &self.fixed {
            fixed.start(seq);
            return Ok(rx);
        }
        self.tx
            .send(Command::Add(Box::new(seq)))
            .map_err(|_| SimError::EngineStopped)?;
        Ok(rx)
    }

    /// Kills every sequence as a crashing engine would.
    pub fn crash_all(&self) {
        if let Some(fixed) = &self.fixed {
            fixed.crash_all();
            return;
        }
        let _ = self.tx.send(Command::CrashAll);
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> EngineStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[derive(Debug)]
struct Seq {
    params: SeqParams,
    events: mpsc::UnboundedSender<SeqEvent>,
    arrived: Instant,
    not_before: Option<Instant>,
    generated: u32,
    /// Tokens whose KV has been computed in the current residency (prefill progress).
    computed: u32,
    held: kv::Held,
    /// Set when first admitted.
    cache: Option<CacheUse>,
    scheduled_at: Option<Instant>,
    last_token_at: Option<Instant>,
    stalled: bool,
    prompt_counted: bool,
}

impl Seq {
    fn context(&self) -> u32 {
        self.params.prompt_tokens + self.generated
    }
    fn prefilling(&self) -> bool {
        self.computed < self.context()
    }
    fn decoding(&self) -> bool {
        !self.stalled && !self.prefilling()
    }
}

/// What one step does; indices point into `running`, which does not change in between.
struct Plan {
    decode: Vec<usize>,
    prefill: Vec<(usize, u32)>,
    duration: Duration,
    /// Arrival of the newest sequence admitted in this step: the step cannot have started
    /// before it, or its time to first token would be under-reported.
    newest_arrival: Option<Instant>,
}

struct Engine {
    cfg: EngineConfig,
    kv: kv::KvCache,
    waiting: VecDeque<Seq>,
    /// Sequences held back by the slow-first-token fault (vLLM's "deferred" waiting reason).
    deferred: Vec<Seq>,
    /// Admitted sequences, in admission order (the last is preempted first).
    running: Vec<Seq>,
    stats: Arc<Mutex<EngineStats>>,
}

impl Engine {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        let mut clock: Option<Instant> = None;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            self.reap_closed();
            let now = Instant::now();
            let plan = self.schedule(now);
            self.publish_gauges();
            let Some(plan) = plan else {
                clock = None;
                let wake = self.deferred.iter().filter_map(|s| s.not_before).min();
                let tick = now + IDLE_TICK;
                let until = wake.map_or(tick, |w| w.min(tick));
                tokio::select! {
                    cmd = rx.recv() => match cmd {
                        Some(cmd) => self.command(cmd),
                        None => return,
                    },
                    () = tokio::time::sleep_until(until) => {}
                }
                continue;
            };
            // Chain steps back to back so timer granularity does not bend the average rate,
            // but never catch up more than a few steps at once: a long stall (a busy machine)
            // is re-anchored to now instead of replayed as a burst of tokens.
            let scaled = plan.duration.div_f64(self.cfg.time_scale);
            let max_lag = (scaled * 4).clamp(MIN_LAG, MAX_LAG);
            let start = match clock {
                Some(t) if now.saturating_duration_since(t) <= max_lag => t,
                _ => now,
            };
            let start = plan.newest_arrival.map_or(start, |a| start.max(a));
            let deadline = start + scaled;
            if deadline <= Instant::now() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep_until(deadline).await;
            }
            self.apply(plan, deadline);
            self.lock_stats()
                .busy
                .record(start.into_std(), deadline.into_std());
            clock = Some(deadline);
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Add(seq) => {
                if seq.not_before.is_some() {
                    self.deferred.push(*seq);
                } else {
                    self.waiting.push_back(*seq);
                }
            }
            Command::CrashAll => {
                let all = self
                    .running
                    .drain(..)
                    .chain(self.waiting.drain(..))
                    .chain(self.deferred.drain(..));
                for seq in all {
                    let _ = seq.events.send(SeqEvent::Crashed);
                }
                self.kv.reset();
            }
        }
    }

    fn blocks_for(&self, tokens: u32) -> u64 {
        u64::from(tokens).div_ceil(u64::from(self.cfg.block_size))
    }

    /// Frees sequences whose client went away, wherever they are.
    fn reap_closed(&mut self) {
        let kv = &mut self.kv;
        self.running.retain_mut(|s| {
            let open = !s.events.is_closed();
            if !open {
                kv.release(std::mem::take(&mut s.held));
            }
            open
        });
        self.waiting.retain(|s| !s.events.is_closed());
        self.deferred.retain(|s| !s.events.is_closed());
    }

    fn preempt(&mut self, idx: usize) {
        let mut seq = self.running.remove(idx);
        self.kv.release(std::mem::take(&mut seq.held));
        seq.computed = 0;
        self.waiting.push_front(seq);
        self.lock_stats().preemptions += 1;
    }

    fn schedule(&mut self, now: Instant) -> Option<Plan> {
        let (ready, later): (Vec<Seq>, Vec<Seq>) = self
            .deferred
            .drain(..)
            .partition(|s| s.not_before.is_none_or(|t| t <= now));
        self.deferred = later;
        self.waiting.extend(ready);

        // Room for the next token of every decoding sequence, preempting from the back.
        let mut i = 0;
        while i < self.running.len() {
            if !self.running[i].decoding() {
                i += 1;
                continue;
            }
            let need = self.blocks_for(self.running[i].context() + 1);
            let mut preempted_self = false;
            while !self.kv.can_grow(&self.running[i].held, need) {
                let victim = self.running.len() - 1;
                self.preempt(victim);
                if victim == i {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            self.kv.grow(&mut self.running[i].held, need);
            i += 1;
        }

        let decode: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].decoding())
            .collect();
        let mut budget = self
            .cfg
            .max_num_batched_tokens
            .saturating_sub(u32::try_from(decode.len()).unwrap_or(u32::MAX));

        // Running sequences first: continue their prefills within the step's budget.
        let mut prefill = Vec::new();
        for (i, seq) in self.running.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if !seq.stalled && seq.prefilling() {
                let chunk = (seq.context() - seq.computed).min(budget);
                budget -= chunk;
                prefill.push((i, chunk));
            }
        }

        // Then admit waiting sequences in order while the budget, a slot and the blocks for
        // their whole context allow; each starts its prefill in this step, so a burst of long
        // prompts is admitted over several steps as in vLLM.
        let mut newest_arrival = None;
        while let Some(front) = self.waiting.front() {
            if budget == 0 || self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let need = self.blocks_for(front.context().saturating_add(1));
            let hashes = &front.params.block_hashes;
            let most = CacheUse::most_blocks(front.params.prompt_tokens, self.cfg.block_size);
            let hit = self.kv.hit(hashes, most);
            let Some(held) = self.kv.admit(hashes, hit, need) else {
                break;
            };
            let Some(mut seq) = self.waiting.pop_front() else {
                self.kv.release(held);
                break;
            };
            seq.held = held;
            seq.computed = u32::try_from(hit).unwrap_or(0) * self.cfg.block_size;
            let hashed = seq.params.block_hashes.len();
            let cache = CacheUse::of(seq.params.prompt_tokens, self.cfg.block_size, hashed, hit);
            // Counted once a request, as vLLM does: not again when a preempted one returns.
            if self.cfg.prefix_caching && seq.cache.is_none() {
                let mut stats = self.lock_stats();
                stats.prefix_cache_queries += u64::from(seq.params.prompt_tokens);
                stats.prefix_cache_hits += u64::from(cache.cached);
            }
            seq.cache.get_or_insert(cache);
            seq.scheduled_at.get_or_insert(now);
            newest_arrival = newest_arrival.max(Some(seq.arrived));
            let chunk = (seq.context() - seq.computed).min(budget);
            budget -= chunk;
            prefill.push((self.running.len(), chunk));
            self.running.push(seq);
        }

        if decode.is_empty() && prefill.is_empty() {
            return None;
        }
        let prefill_tokens: u64 = prefill.iter().map(|(_, c)| u64::from(*c)).sum();
        let duration = self.cfg.spec.step_duration(decode.len(), prefill_tokens);
        Some(Plan {
            decode,
            prefill,
            duration,
            newest_arrival,
        })
    }

    fn apply(&mut self, plan: Plan, now: Instant) {
        let mut done = vec![false; self.running.len()];
        let stats = self.stats.clone();
        let mut stats = stats.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, chunk) in plan.prefill {
            let seq = &mut self.running[i];
            seq.computed += chunk;
            // Full blocks are cached as soon as they are computed: a request arriving while
            // this one still runs reads them.
            let hashes = &seq.params.block_hashes;
            let full = usize::try_from(seq.computed / self.cfg.block_size).unwrap_or(0);
            self.kv
                .register(&mut seq.held, &hashes[..full.min(hashes.len())]);
            if !seq.prefilling() {
                if !seq.prompt_counted {
                    seq.prompt_counted = true;
                    stats.prompt_tokens += u64::from(seq.params.prompt_tokens);
                    stats.prompt_tokens_cached += u64::from(seq.cache.map_or(0, |c| c.cached));
                }
                done[i] = self.produce(i, now, &mut stats);
            }
        }
        for i in plan.decode {
            done[i] = self.produce(i, now, &mut stats);
        }
        let mut idx = 0;
        let kv = &mut self.kv;
        self.running.retain_mut(|s| {
            let keep = !done[idx];
            idx += 1;
            if !keep {
                kv.release(std::mem::take(&mut s.held));
            }
            keep
        });
        stats.used_blocks = self.kv.used();
    }

    /// Emits one token for `running[i]`; true when the sequence is over. The new token's KV
    /// is written by the step that produced it, so the sequence stays in decode.
    fn produce(&mut self, i: usize, now: Instant, stats: &mut EngineStats) -> bool {
        let over = self.produce_token(i, now, stats);
        let seq = &mut self.running[i];
        seq.computed = seq.context();
        over
    }

    fn produce_token(&mut self, i: usize, now: Instant, stats: &mut EngineStats) -> bool {
        emit_token(&mut self.running[i], self.cfg.max_model_len, now, stats)
    }

    fn publish_gauges(&self) {
        let mut stats = self.lock_stats();
        stats.running = self.running.len() as u64;
        stats.waiting_capacity = self.waiting.len() as u64;
        stats.waiting_deferred = self.deferred.len() as u64;
        stats.used_blocks = self.kv.used();
    }

    fn lock_stats(&self) -> std::sync::MutexGuard<'_, EngineStats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Emits `seq`'s next token at `now` and records it; true when the sequence is over (it
/// finished, crashed by fault, or its client left). A stall fault sets `seq.stalled` instead.
fn emit_token(seq: &mut Seq, max_model_len: u32, now: Instant, stats: &mut EngineStats) -> bool {
    if seq.params.crash_after.is_some_and(|n| seq.generated >= n) {
        let _ = seq.events.send(SeqEvent::Crashed);
        return true;
    }
    if seq.params.stall_after.is_some_and(|n| seq.generated >= n) {
        seq.stalled = true;
        return false;
    }
    let eos = seq.params.eos_at == Some(seq.generated + 1);
    let (mut delta, stop) = if eos {
        // The end-of-sequence token has no text; what was held back goes out with it.
        seq.params.generator.emit_eos();
        (seq.params.generator.flush(), None)
    } else {
        seq.params.generator.next_token()
    };
    let logprobs = seq.params.generator.take_logprobs();
    seq.generated += 1;
    stats.generation_tokens += 1;
    if seq.generated == 1 {
        stats
            .ttft
            .observe(now.duration_since(seq.arrived).as_secs_f64());
        let queued = seq
            .scheduled_at
            .map_or(Duration::ZERO, |t| t.duration_since(seq.arrived));
        stats.queue_time.observe(queued.as_secs_f64());
    } else if let Some(last) = seq.last_token_at {
        stats.itl.observe(now.duration_since(last).as_secs_f64());
    }
    seq.last_token_at = Some(now);
    let reason = match &stop {
        Some(Stop::String(_)) => Some(FinishedReason::Stop),
        None if eos => Some(FinishedReason::Stop),
        None if seq.generated >= seq.params.max_tokens || seq.context() >= max_model_len => {
            delta.push_str(&seq.params.generator.flush());
            Some(FinishedReason::Length)
        }
        None => None,
    };
    let finish = reason.map(|reason| Finish {
        reason,
        stop: stop.map(|Stop::String(s)| s),
        prompt_tokens: seq.params.prompt_tokens,
        completion_tokens: seq.generated,
        cache: seq.cache.unwrap_or_default(),
    });
    let over = finish.is_some();
    if let Some(f) = &finish {
        stats.finished(f.reason);
        stats
            .e2e
            .observe(now.duration_since(seq.arrived).as_secs_f64());
        stats
            .request_prompt_tokens
            .observe(f64::from(f.prompt_tokens));
        stats
            .request_generation_tokens
            .observe(f64::from(f.completion_tokens));
    }
    // A failed send means the client left: the sequence is aborted like in vLLM, which
    // does not count aborts as successes.
    let generated = seq.generated;
    seq.events
        .send(SeqEvent::Token {
            delta,
            generated,
            finish,
            logprobs,
        })
        .is_err()
        || over
}

mod fixed;
pub mod kv;
#[cfg(test)]
mod tests;
