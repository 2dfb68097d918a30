//! Maps requests onto the block pool: prefix-cache lookup on admission, atomic
//! allocation of a run's new slots plus lookahead slots, rollback of rejected
//! drafts, caching of newly confirmed full blocks, and freeing.
//!
//! A request's block table row (`Request::block_ids`) covers positions
//! `[0, block_ids.len() * block_size)`; slot of position p is
//! `block_ids[p / block_size] * block_size + p % block_size`.
//!
//! Sliding window W (every KV user attends to keys j with p - W < j <= p): once a
//! request's update is done (rejected drafts rolled back, confirmed blocks cached),
//! every query it runs later sits at a position >= `num_computed_tokens`, so keys below
//! `num_computed_tokens - W + 1` are dead. `free_dead_blocks` gives back every block
//! wholly below that line (`pool.free`: a cached block keeps its prefix-cache entry until
//! handed out again) and leaves `DEAD_BLOCK` in its place, so the row stays positional
//! and the request's `block_hashes` chain stays intact. A long request then holds about
//! `(W + query + lookahead) / block_size + 2` blocks whatever its length.

use crate::block_pool::{BlockHash, BlockId, BlockPool, DEAD_BLOCK, ROOT_HASH};
use crate::request::Request;

#[derive(Debug)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
    sliding_window: Option<usize>,
}

/// Blocks found in the prefix cache for a waiting request (not yet referenced).
#[derive(Debug, Default)]
pub struct CachedPrefix {
    pub block_ids: Vec<BlockId>,
    pub block_hashes: Vec<BlockHash>,
}

impl CachedPrefix {
    pub fn num_tokens(&self, block_size: usize) -> usize {
        self.block_ids.len() * block_size
    }
    pub fn clear(&mut self) {
        self.block_ids.clear();
        self.block_hashes.clear();
    }
}

#[inline]
pub fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        KvCacheManager {
            pool: BlockPool::new(num_blocks, block_size),
            block_size,
            enable_prefix_caching,
            sliding_window: None,
        }
    }

    /// Frees blocks that fall out of every query's window `w` (see the module doc).
    pub fn with_sliding_window(mut self, w: Option<usize>) -> Self {
        debug_assert!(w != Some(0));
        self.sliding_window = w;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn sliding_window(&self) -> Option<usize> {
        self.sliding_window
    }

    /// Leading blocks of a request with `num_computed_tokens` computed tokens that no later
    /// query can read: those wholly below `num_computed_tokens - W + 1` (0 without a window).
    pub fn num_dead_blocks_for(&self, num_computed_tokens: usize) -> usize {
        match self.sliding_window {
            None => 0,
            Some(w) => (num_computed_tokens + 1).saturating_sub(w) / self.block_size,
        }
    }

    /// Gives back the request's blocks that fell out of the sliding window since the last
    /// call (their entries become `DEAD_BLOCK`). Call after rollback and caching: every
    /// later query of the request must sit at a position >= its confirmed tokens
    /// (`Request::num_confirmed_tokens`).
    /// Returns the number of blocks freed.
    pub fn free_dead_blocks(&mut self, req: &mut Request) -> usize {
        // (the confirmed tokens: a step scheduled ahead's query sits at the first unconfirmed one)
        let dead = self
            .num_dead_blocks_for(req.num_confirmed_tokens())
            .min(req.block_ids.len());
        if dead <= req.num_dead_blocks {
            return 0;
        }
        debug_assert!(
            !self.enable_prefix_caching || req.block_hashes.len() >= dead,
            "a dead block is full and confirmed: cached before it is freed"
        );
        for b in &mut req.block_ids[req.num_dead_blocks..dead] {
            self.pool.free(*b);
            *b = DEAD_BLOCK;
        }
        let n = dead - req.num_dead_blocks;
        req.num_dead_blocks = dead;
        n
    }

    /// Longest run of cached full blocks matching the request's tokens, at most
    /// `(num_tokens - 1) / block_size` blocks so at least one token is computed.
    /// Read-only: nothing is referenced until `allocate_slots` succeeds.
    pub fn find_cached_prefix(&self, req: &Request, out: &mut CachedPrefix) {
        out.clear();
        if !self.enable_prefix_caching {
            return;
        }
        let bs = self.block_size;
        let max_blocks = (req.num_tokens().saturating_sub(1)) / bs;
        let mut parent = ROOT_HASH;
        for i in 0..max_blocks {
            match self
                .pool
                .lookup(parent, &req.token_ids[i * bs..(i + 1) * bs])
            {
                Some((block, hash)) => {
                    out.block_ids.push(block);
                    out.block_hashes.push(hash);
                    parent = hash;
                }
                None => break,
            }
        }
    }

    /// Makes the request's row cover `min(num_computed + cached + num_new + lookahead,
    /// max_slots)` slots, first taking the cached prefix blocks. All or nothing:
    /// returns false and changes nothing when the pool cannot supply the blocks.
    pub fn allocate_slots(
        &mut self,
        req: &mut Request,
        cached: Option<&CachedPrefix>,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        max_slots: usize,
    ) -> bool {
        let num_cached_blocks = cached.map_or(0, |c| c.block_ids.len());
        let num_cached_tokens = num_cached_blocks * self.block_size;
        let slots =
            (req.num_computed_tokens + num_cached_tokens + num_new_tokens + num_lookahead_tokens)
                .min(max_slots);
        let have = req.block_ids.len() + num_cached_blocks;
        let need = cdiv(slots, self.block_size).saturating_sub(have);
        // Cached blocks that sit on the free list are taken out of it by `touch`.
        let cached_free = cached.map_or(0, |c| {
            c.block_ids
                .iter()
                .filter(|&&b| self.pool.ref_count(b) == 0)
                .count()
        });
        if need + cached_free > self.pool.num_free() {
            return false;
        }
        if let Some(c) = cached {
            for &b in &c.block_ids {
                self.pool.touch(b);
            }
            req.block_ids.extend_from_slice(&c.block_ids);
            req.block_hashes.extend_from_slice(&c.block_hashes);
            req.num_computed_tokens += num_cached_tokens;
        }
        for _ in 0..need {
            let b = self.pool.allocate().expect("free count checked above");
            req.block_ids.push(b);
        }
        true
    }

    /// Rewinds `num_rejected` speculative positions. Their KV is garbage and will be
    /// overwritten; the blocks stay with the request for its next run (they are
    /// never in the prefix cache: only confirmed blocks are cached).
    pub fn rollback(&mut self, req: &mut Request, num_rejected: usize) {
        debug_assert!(num_rejected <= req.num_computed_tokens);
        req.num_computed_tokens -= num_rejected;
    }

    /// Registers every full block whose tokens are all confirmed (KV computed for
    /// real, non-draft tokens) in the prefix cache.
    pub fn cache_confirmed_blocks(&mut self, req: &mut Request) {
        if !self.enable_prefix_caching {
            return;
        }
        let bs = self.block_size;
        let confirmed = req.num_confirmed_tokens().min(req.num_tokens());
        let num_full = (confirmed / bs).min(req.block_ids.len());
        for i in req.block_hashes.len()..num_full {
            debug_assert!(
                req.block_ids[i] != DEAD_BLOCK,
                "blocks are cached before they die"
            );
            let parent = req.block_hashes.last().copied().unwrap_or(ROOT_HASH);
            let tokens = &req.token_ids[i * bs..(i + 1) * bs];
            let hash = self.pool.cache_block(req.block_ids[i], parent, tokens);
            req.block_hashes.push(hash);
        }
    }

    /// Releases all of the request's blocks (dead placeholders were given back already),
    /// last block first so that the tail of a sequence is evicted before its (more
    /// shareable) head.
    pub fn free(&mut self, req: &mut Request) {
        for &b in req.block_ids[req.num_dead_blocks..].iter().rev() {
            self.pool.free(b);
        }
        req.block_ids.clear();
        req.num_dead_blocks = 0;
        req.block_hashes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::StopParams;

    fn request(id: u64, prompt: Vec<u32>) -> Request {
        Request::new(
            id,
            prompt,
            StopParams {
                max_tokens: 8,
                ..Default::default()
            },
        )
    }

    #[test]
    fn allocation_covers_new_and_lookahead_slots() {
        let mut kv = KvCacheManager::new(8, 4, true);
        let mut r = request(1, (0..6).collect());
        assert!(kv.allocate_slots(&mut r, None, 6, 3, 100));
        assert_eq!(r.block_ids.len(), 3); // 9 slots
        assert!(kv.allocate_slots(&mut r, None, 6, 3, 6));
        assert_eq!(r.block_ids.len(), 3); // capped, never shrinks
    }

    #[test]
    fn allocation_is_atomic() {
        let mut kv = KvCacheManager::new(2, 4, true);
        let mut r = request(1, (0..12).collect());
        assert!(!kv.allocate_slots(&mut r, None, 12, 0, 100));
        assert!(r.block_ids.is_empty());
        assert_eq!(kv.pool.num_free(), 2);
    }

    #[test]
    fn confirmed_blocks_are_found_by_a_later_request_with_the_same_prefix() {
        let mut kv = KvCacheManager::new(8, 4, true);
        let mut a = request(1, (0..10).collect());
        assert!(kv.allocate_slots(&mut a, None, 10, 0, 100));
        a.num_computed_tokens = 10;
        kv.cache_confirmed_blocks(&mut a);
        assert_eq!(a.block_hashes.len(), 2);
        kv.free(&mut a);

        let mut b = request(2, (0..9).collect());
        let mut prefix = CachedPrefix::default();
        kv.find_cached_prefix(&b, &mut prefix);
        assert_eq!(prefix.num_tokens(4), 8);
        assert!(kv.allocate_slots(&mut b, Some(&prefix), 1, 0, 100));
        assert_eq!(b.num_computed_tokens, 8);
        assert_eq!(&b.block_ids[..2], &prefix.block_ids[..]);

        // at least one token is always computed: 8 tokens hit only one block
        let c = request(3, (0..8).collect());
        kv.find_cached_prefix(&c, &mut prefix);
        assert_eq!(prefix.block_ids.len(), 1);
        kv.pool.check_integrity().unwrap();
    }

    #[test]
    fn sliding_window_frees_exactly_the_blocks_below_the_window() {
        // W = 6, bs = 4: block i is dead once (i + 1) * 4 <= nc - 5
        let mut kv = KvCacheManager::new(8, 4, true).with_sliding_window(Some(6));
        let mut r = request(1, (0..20).collect());
        assert!(kv.allocate_slots(&mut r, None, 20, 0, 100));
        assert_eq!(kv.pool.num_free(), 3);
        for (nc, dead) in [(0, 0), (8, 0), (9, 1), (12, 1), (13, 2), (19, 3)] {
            r.num_computed_tokens = nc;
            kv.cache_confirmed_blocks(&mut r);
            kv.free_dead_blocks(&mut r);
            assert_eq!(r.num_dead_blocks, dead, "nc = {nc}");
            assert_eq!(kv.pool.num_free(), 3 + dead);
            assert!(r.block_ids[..dead].iter().all(|&b| b == DEAD_BLOCK));
            assert!(r.block_ids[dead..].iter().all(|&b| b != DEAD_BLOCK));
        }
        assert_eq!(r.block_ids.len(), 5, "the row stays positional");
        assert_eq!(
            r.block_hashes.len(),
            4,
            "the hash chain goes on through dead blocks"
        );
        kv.free(&mut r);
        assert_eq!(kv.pool.num_free(), 8);
        assert_eq!(r.num_dead_blocks, 0);
        kv.pool.check_integrity().unwrap();

        // the freed blocks kept their cache entries: the same prompt hits all four
        let b = request(2, (0..20).collect());
        let mut prefix = CachedPrefix::default();
        kv.find_cached_prefix(&b, &mut prefix);
        assert_eq!(prefix.block_ids.len(), 4);
    }

    #[test]
    fn without_a_window_nothing_dies() {
        let mut kv = KvCacheManager::new(8, 4, false);
        let mut r = request(1, (0..20).collect());
        assert!(kv.allocate_slots(&mut r, None, 20, 0, 100));
        r.num_computed_tokens = 19;
        assert_eq!(kv.free_dead_blocks(&mut r), 0);
        assert_eq!(r.num_dead_blocks, 0);
        // a window of 1: a query sees only itself, every block below its own dies
        let mut kv = KvCacheManager::new(8, 4, false).with_sliding_window(Some(1));
        let mut r = request(1, (0..20).collect());
        assert!(kv.allocate_slots(&mut r, None, 20, 0, 100));
        r.num_computed_tokens = 16;
        assert_eq!(kv.free_dead_blocks(&mut r), 4);
    }

    #[test]
    fn rollback_rewinds_computed_tokens_and_keeps_blocks() {
        let mut kv = KvCacheManager::new(8, 4, true);
        let mut r = request(1, (0..5).collect());
        assert!(kv.allocate_slots(&mut r, None, 5, 0, 100));
        r.num_computed_tokens = 5;
        kv.rollback(&mut r, 2);
        assert_eq!(r.num_computed_tokens, 3);
        assert_eq!(r.block_ids.len(), 2);
    }
}
