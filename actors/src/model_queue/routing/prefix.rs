//! What the gateway knows of each node's prefix cache: the prompt blocks it sent there.
//!
//! vLLM names a prompt's full KV blocks by a hash chain (each block's hash covers its tokens
//! and the hash before it), so two prompts share a cached block exactly when they share
//! every token up to its end. The gateway tokenizes every prompt with the model's own
//! tokenizer and template before admission, hashes its full blocks the same way
//! ([`block_hashes`]), and the queue remembers, per node, the blocks of the prompts it
//! dispatched there ([`PrefixIndex`]): a least-recently-used set as large as the node's KV
//! cache, refreshed prefix-last so that, as in vLLM's free-block queue, a prompt's tail is
//! forgotten before the prefix it shares with others. The index is a prediction: the engine
//! may have evicted blocks under decode pressure that the index still holds, and it never
//! sees prompts that reached the engine some other way.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashlink::LruCache;
use serde::{Deserialize, Serialize};

/// Prompt blocks carried with a request at most (a prompt of `MAX_BLOCKS × block_size`
/// tokens; longer prompts are routed on their beginning).
pub const MAX_BLOCKS: usize = 2048;

/// The hash chain of `ids`' full blocks of `block_size` tokens.
/// The simulator's prefix cache names its blocks with the same function, so the gateway's
/// prediction and a simulated node's cache agree block for block.
pub fn block_hashes(ids: &[u32], block_size: u32) -> Vec<u64> {
    let size = usize::try_from(block_size).unwrap_or(usize::MAX).max(1);
    let mut parent = 0u64;
    ids.chunks_exact(size)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// What routing knows of one request's prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteKey {
    /// The hash chain of the prompt's full blocks ([`block_hashes`]).
    pub blocks: Arc<[u64]>,
    /// Tokens per block.
    pub block_size: u32,
    /// The prompt's tokens, as the gateway counted them.
    pub prompt_tokens: u32,
    /// The client's conversation (`x-session-id`, hashed), if it named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

impl RouteKey {
    /// Tokens of `blocks` full blocks, at most the prompt.
    pub fn tokens_of(&self, blocks: usize) -> u32 {
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        blocks
            .saturating_mul(self.block_size)
            .min(self.prompt_tokens)
    }
}

/// The blocks the gateway sent one node, least recently sent first (see the module
/// documentation).
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: LruCache<u64, ()>,
}

impl PrefixIndex {
    /// An index of at most `capacity` blocks (the node's KV cache).
    pub fn new(capacity: usize) -> Self {
        Self {
            blocks: LruCache::new(capacity.max(1)),
        }
    }

    /// How many of `blocks`' leading blocks the node is predicted to hold.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.blocks.contains_key(*b))
            .count()
    }

    /// `blocks` were sent to the node: it computes (or reuses) and caches them. Refreshed
    /// tail first, so the prefix is the most recent and the last to go.
    pub fn record(&mut self, blocks: &[u64]) {
        for b in blocks.iter().rev() {
            self.blocks.insert(*b, ());
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_hash_equal_and_a_difference_changes_every_block_after_it() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[0], hb[0]);
        assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
        // A partial last block is not hashed.
        assert_eq!(block_hashes(&a[..47], 16).len(), 2);
    }

    #[test]
    fn matched_counts_leading_blocks_only() {
        let mut idx = PrefixIndex::new(100);
        idx.record(&[1, 2, 3]);
        assert_eq!(idx.matched(&[1, 2, 3, 4]), 3);
        assert_eq!(idx.matched(&[1, 9, 3]), 1);
        assert_eq!(idx.matched(&[9, 1, 2]), 0);
    }

    #[test]
    fn a_full_index_forgets_the_least_recent_prompt_tail_first() {
        let mut idx = PrefixIndex::new(4);
        idx.record(&[1, 2, 3]);
        // A second prompt with the same first block and its own tail: the first prompt's
        // tail (3, then 2) goes before the shared prefix.
        idx.record(&[1, 5, 6]);
        assert_eq!(idx.len(), 4);
        assert_eq!(idx.matched(&[1, 5, 6]), 3);
        assert_eq!(idx.matched(&[1, 2, 3]), 2);
        idx.record(&[7]);
        assert_eq!(idx.matched(&[1, 2]), 1);
        assert_eq!(idx.matched(&[1, 5, 6]), 3);
    }
}
