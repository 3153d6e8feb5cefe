//! `--profile fixed`: every sequence on its own timer, with no batching, KV or queue model.
//!
//! A sequence's first token is due `ttft` after it arrives (after the slow-first-token fault's
//! delay, if any), token `k` at `ttft + (k - 1) * itl`. Deadlines are absolute, so timer
//! granularity never accumulates into drift, and the only work per token is the shared
//! [`emit_token`]: the same text, usage, metrics and faults as the modeled engine. Cached
//! prompt tokens are accounted (a prompt's leading blocks seen before are cached) but skip
//! nothing, and the cache never evicts until it is large, then starts over.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{CacheUse, EngineStats, Seq, SeqEvent, emit_token};

/// Prefix blocks remembered before the table starts over.
const MAX_CACHED_BLOCKS: usize = 1 << 20;

/// Shared state of the fixed-timing engine.
#[derive(Debug)]
pub(super) struct FixedEngine {
    /// Time to first token, already divided by the time scale.
    ttft: Duration,
    /// Time between tokens, already divided by the time scale.
    itl: Duration,
    max_model_len: u32,
    block_size: u32,
    stats: Arc<Mutex<EngineStats>>,
    /// The prefix blocks seen so far, by hash.
    seen: Mutex<HashSet<u64>>,
    /// Cancelled (and replaced) by [`FixedEngine::crash_all`]; every sequence holds the one
    /// current when it arrived.
    crash: Mutex<CancellationToken>,
}

/// What ends a wait.
enum Wake {
    Due,
    Crashed,
    Left,
}

impl FixedEngine {
    pub(super) fn new(
        ttft: Duration,
        itl: Duration,
        max_model_len: u32,
        block_size: u32,
        stats: Arc<Mutex<EngineStats>>,
    ) -> Self {
        Self {
            ttft,
            itl,
            max_model_len,
            block_size,
            stats,
            seen: Mutex::new(HashSet::new()),
            crash: Mutex::new(CancellationToken::new()),
        }
    }

    /// Runs `seq` on a task of its own.
    pub(super) fn start(self: &Arc<Self>, mut seq: Seq) {
        let hashes = &seq.params.block_hashes;
        if !hashes.is_empty() {
            let most = CacheUse::most_blocks(seq.params.prompt_tokens, self.block_size);
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if seen.len() > MAX_CACHED_BLOCKS {
                seen.clear();
            }
            let hit = hashes
                .iter()
                .take(most)
                .take_while(|h| seen.contains(h))
                .count();
            seen.extend(hashes.iter().copied());
            let cache = CacheUse::of(seq.params.prompt_tokens, self.block_size, hashes.len(), hit);
            let mut stats = self.stats();
            stats.prefix_cache_queries += u64::from(seq.params.prompt_tokens);
            stats.prefix_cache_hits += u64::from(cache.cached);
            seq.cache = Some(cache);
        }
        let crash = self
            .crash
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        tokio::spawn(self.clone().run(seq, crash));
    }

    /// Cuts every sequence now running; later ones are unaffected.
    pub(super) fn crash_all(&self) {
        let old = std::mem::take(&mut *self.crash.lock().unwrap_or_else(PoisonError::into_inner));
        old.cancel();
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, EngineStats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn run(self: Arc<Self>, mut seq: Seq, crash: CancellationToken) {
        let start = match seq.not_before {
            Some(at) => {
                self.stats().waiting_deferred += 1;
                let wake = wait(&seq, &crash, Some(at)).await;
                self.stats().waiting_deferred -= 1;
                match wake {
                    Wake::Due => at,
                    Wake::Crashed => {
                        let _ = seq.events.send(SeqEvent::Crashed);
                        return;
                    }
                    Wake::Left => return,
                }
            }
            None => seq.arrived,
        };
        seq.scheduled_at = Some(start);
        self.stats().running += 1;
        let mut due = start + self.ttft;
        loop {
            match wait(&seq, &crash, Some(due)).await {
                Wake::Due => {}
                Wake::Crashed => {
                    let _ = seq.events.send(SeqEvent::Crashed);
                    break;
                }
                Wake::Left => break,
            }
            let over = {
                let mut stats = self.stats();
                if !seq.prompt_counted {
                    seq.prompt_counted = true;
                    stats.prompt_tokens += u64::from(seq.params.prompt_tokens);
                    stats.prompt_tokens_cached += u64::from(seq.cache.map_or(0, |c| c.cached));
                }
                emit_token(&mut seq, self.max_model_len, due, &mut stats)
            };
            if over {
                break;
            }
            if seq.stalled {
                // The socket stays open, silent, until the client leaves or the engine dies.
                if let Wake::Crashed = wait(&seq, &crash, None).await {
                    let _ = seq.events.send(SeqEvent::Crashed);
                }
                break;
            }
            due += self.itl;
        }
        self.stats().running -= 1;
    }
}

/// Waits until `due` (forever when `None`), the engine crashes, or the client leaves.
async fn wait(seq: &Seq, crash: &CancellationToken, due: Option<Instant>) -> Wake {
    let timer = async {
        match due {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = crash.cancelled() => Wake::Crashed,
        () = seq.events.closed() => Wake::Left,
        () = timer => Wake::Due,
    }
}
