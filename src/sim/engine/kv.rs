//! The paged KV cache with vLLM's automatic prefix caching. A prompt's full blocks are named
//! by a hash chain (each block's hash covers its tokens and the hash before it, so equal
//! hashes mean equal prefixes). A computed full block stays cached after its sequences end,
//! until its space is needed; a new sequence holds the cached blocks its prompt starts with
//! and skips their prefill. Free cached blocks are evicted least recently freed first, and a
//! sequence's blocks are freed tail first, so a prefix outlives its suffixes, as with vLLM's
//! free block queue.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

/// The hash chain of a prompt's full blocks: the gateway's routing hashes prompts with the
/// same function, so its predictions and a simulated node's cache agree block for block.
pub use switchyard_actors::model_queue::block_hashes;

/// Which blocks a cache holds, readable from outside the engine: what a router that knew
/// every node's cache exactly would see (the routing benchmark's oracle).
#[derive(Debug, Clone, Default)]
pub struct CacheProbe(Arc<Mutex<HashSet<u64>>>);

impl CacheProbe {
    /// How many of `hashes`' leading blocks the cache holds, at most `most`.
    pub fn hit(&self, hashes: &[u64], most: usize) -> usize {
        let cached = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        hashes
            .iter()
            .take(most)
            .take_while(|h| cached.contains(h))
            .count()
    }

    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A cached block: how many sequences hold it, and its place among the evictable ones when
/// none does.
#[derive(Debug)]
struct Cached {
    holders: u32,
    freed_at: Option<u64>,
}

/// The blocks one sequence holds: cached ones (by hash, prompt order) and its own.
#[derive(Debug, Default)]
pub struct Held {
    shared: Vec<u64>,
    own: u64,
}

impl Held {
    /// Blocks held.
    pub fn len(&self) -> u64 {
        self.shared.len() as u64 + self.own
    }

    /// Holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct KvCache {
    num_blocks: u64,
    /// Blocks neither cached nor held.
    free: u64,
    cached: HashMap<u64, Cached>,
    /// Cached blocks no sequence holds, by when they were freed (the smallest goes first).
    evictable: BTreeMap<u64, u64>,
    clock: u64,
    /// Kept in step with `cached` when someone reads it from outside.
    probe: Option<CacheProbe>,
}

impl KvCache {
    /// A cache of `num_blocks`, one of which (vLLM's null block) never holds tokens.
    pub fn new(num_blocks: u64) -> Self {
        Self {
            num_blocks,
            free: num_blocks.saturating_sub(1),
            cached: HashMap::new(),
            evictable: BTreeMap::new(),
            clock: 0,
            probe: None,
        }
    }

    /// The cache, readable through `probe`.
    pub fn with_probe(mut self, probe: CacheProbe) -> Self {
        probe.set().clear();
        self.probe = Some(probe);
        self
    }

    /// Blocks that sequences hold (cached blocks nobody holds count as free, as in vLLM's
    /// `kv_cache_usage_perc`).
    pub fn used(&self) -> u64 {
        self.num_blocks.saturating_sub(1) - self.free - self.evictable.len() as u64
    }

    /// Blocks a sequence could still get.
    fn available(&self) -> u64 {
        self.free + self.evictable.len() as u64
    }

    /// How many of `hashes`' leading blocks are cached, at most `most`.
    pub fn hit(&self, hashes: &[u64], most: usize) -> usize {
        hashes
            .iter()
            .take(most)
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Admits a sequence needing `need` blocks whose prompt starts with `hit` cached blocks
    /// of `hashes` (from [`Self::hit`]): they are held, the rest allocated. `None` when the
    /// cache cannot give that many.
    pub fn admit(&mut self, hashes: &[u64], hit: usize, need: u64) -> Option<Held> {
        let hit = hit.min(hashes.len());
        let reused = &hashes[..hit];
        let unheld = reused
            .iter()
            .filter(|h| self.cached.get(h).is_some_and(|c| c.holders == 0))
            .count() as u64;
        let fresh = need.saturating_sub(hit as u64);
        if fresh > self.available() - unheld {
            return None;
        }
        for h in reused {
            if let Some(c) = self.cached.get_mut(h) {
                c.holders += 1;
                if let Some(at) = c.freed_at.take() {
                    self.evictable.remove(&at);
                }
            }
        }
        let mut held = Held {
            shared: reused.to_vec(),
            own: 0,
        };
        self.grow(&mut held, need);
        Some(held)
    }

    /// Whether `held` can grow to `need` blocks.
    pub fn can_grow(&self, held: &Held, need: u64) -> bool {
        need.saturating_sub(held.len()) <= self.available()
    }

    /// Grows `held` to `need` blocks, as far as the cache allows.
    pub fn grow(&mut self, held: &mut Held, need: u64) {
        while held.len() < need && self.take_block() {
            held.own += 1;
        }
    }

    fn take_block(&mut self) -> bool {
        if self.free > 0 {
            self.free -= 1;
            return true;
        }
        match self.evictable.pop_first() {
            Some((_, h)) => {
                self.cached.remove(&h);
                if let Some(p) = &self.probe {
                    p.set().remove(&h);
                }
                true
            }
            None => false,
        }
    }

    /// The sequence's prompt is computed up to the end of `hashes`: those blocks beyond the
    /// ones it reused become cached (a block another sequence cached meanwhile stays this
    /// one's own).
    pub fn register(&mut self, held: &mut Held, hashes: &[u64]) {
        for h in hashes.iter().skip(held.shared.len()) {
            if held.own == 0 {
                break;
            }
            if self.cached.contains_key(h) {
                continue;
            }
            self.cached.insert(
                *h,
                Cached {
                    holders: 1,
                    freed_at: None,
                },
            );
            if let Some(p) = &self.probe {
                p.set().insert(*h);
            }
            held.own -= 1;
            held.shared.push(*h);
        }
    }

    /// Frees `held`: its own blocks at once, its cached ones to the evictable, tail first.
    pub fn release(&mut self, held: Held) {
        self.free += held.own;
        for h in held.shared.iter().rev() {
            let Some(c) = self.cached.get_mut(h) else {
                continue;
            };
            c.holders = c.holders.saturating_sub(1);
            if c.holders == 0 {
                self.clock += 1;
                c.freed_at = Some(self.clock);
                self.evictable.insert(self.clock, *h);
            }
        }
    }

    /// Everything gone (the engine died).
    pub fn reset(&mut self) {
        let probe = self.probe.take();
        *self = Self::new(self.num_blocks);
        if let Some(p) = probe {
            p.set().clear();
            self.probe = Some(p);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ids(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn hashes_name_prefixes_not_blocks() {
        let a = block_hashes(&ids(48, 0), 16);
        let mut other = ids(48, 0);
        other[20] = 9999;
        let b = block_hashes(&other, 16);
        assert_eq!(a.len(), 3, "full blocks only");
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2], "a block after a difference differs too");
        assert_eq!(block_hashes(&ids(47, 0), 16).len(), 2);
    }

    // Each cache below has one block more than it holds: vLLM's null block.

    #[test]
    fn a_freed_prompt_stays_cached_and_is_reused() {
        let mut kv = KvCache::new(11);
        let h = block_hashes(&ids(64, 0), 16);
        assert_eq!(kv.hit(&h, 3), 0);
        let mut held = kv.admit(&h, 0, 5).unwrap();
        kv.register(&mut held, &h);
        assert_eq!(kv.used(), 5);
        kv.release(held);
        assert_eq!(kv.used(), 0, "cached blocks nobody holds count as free");
        // The whole prompt again: the last token is computed, so at most 3 of 4 blocks hit.
        assert_eq!(kv.hit(&h, 3), 3);
        let held = kv.admit(&h, 3, 5).unwrap();
        assert_eq!(held.len(), 5);
        assert_eq!(kv.used(), 5);
        kv.release(held);
    }

    #[test]
    fn eviction_takes_the_least_recently_freed_and_a_sequence_tail_first() {
        let mut kv = KvCache::new(5);
        let a = block_hashes(&ids(32, 0), 16);
        let b = block_hashes(&ids(32, 1), 16);
        let mut held = kv.admit(&a, 0, 2).unwrap();
        kv.register(&mut held, &a);
        kv.release(held);
        let mut held = kv.admit(&b, 0, 2).unwrap();
        kv.register(&mut held, &b);
        kv.release(held);
        // Full of cached blocks; one more block evicts a's tail, then a's head.
        let c = block_hashes(&ids(16, 2), 16);
        let held = kv.admit(&c, 0, 1).unwrap();
        assert_eq!(kv.hit(&a, 2), 1, "a's second block went first");
        assert_eq!(kv.hit(&b, 2), 2);
        let mut more = Held::default();
        kv.grow(&mut more, 1);
        assert_eq!(kv.hit(&a, 2), 0);
        assert_eq!(kv.hit(&b, 2), 2, "b was freed later: it stays");
        kv.release(held);
        kv.release(more);
    }

    #[test]
    fn held_blocks_are_never_evicted_and_admission_waits_for_room() {
        let mut kv = KvCache::new(4);
        let a = block_hashes(&ids(32, 0), 16);
        let mut held = kv.admit(&a, 0, 2).unwrap();
        kv.register(&mut held, &a);
        assert!(kv.admit(&[], 0, 2).is_none(), "only one block is left");
        // A second reader of a's blocks needs only one more.
        let second = kv.admit(&a, 2, 3).unwrap();
        assert_eq!(kv.used(), 3);
        assert!(!kv.can_grow(&second, 4));
        kv.release(held);
        kv.release(second);
        assert_eq!(kv.used(), 0);
        assert_eq!(kv.hit(&a, 2), 2);
        kv.reset();
        assert_eq!(kv.hit(&a, 2), 0);
    }
}
