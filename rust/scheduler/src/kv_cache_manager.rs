//! Maps requests onto the block pool: prefix-cache lookup on admission, atomic
//! allocation of a run's new slots plus lookahead slots, rollback of rejected
//! drafts, caching of newly confirmed full blocks, and freeing.
//!
//! A request's block table row (`Request::block_ids`) covers positions
//! `[0, block_ids.len() * block_size)`; slot of position p is
//! `block_ids[p / block_size] * block_size + p % block_size`.

use crate::block_pool::{BlockHash, BlockId, BlockPool, ROOT_HASH};
use crate::request::Request;

#[derive(Debug)]
pub struct KvCacheManager {
    pub pool: BlockPool,
    block_size: usize,
    enable_prefix_caching: bool,
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
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
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
        let confirmed = req.num_computed_tokens.min(req.num_tokens());
        let num_full = (confirmed / bs).min(req.block_ids.len());
        for i in req.block_hashes.len()..num_full {
            let parent = req.block_hashes.last().copied().unwrap_or(ROOT_HASH);
            let tokens = &req.token_ids[i * bs..(i + 1) * bs];
            let hash = self.pool.cache_block(req.block_ids[i], parent, tokens);
            req.block_hashes.push(hash);
        }
    }

    /// Releases all of the request's blocks, last block first so that the tail of a
    /// sequence is evicted before its (more shareable) head.
    pub fn free(&mut self, req: &mut Request) {
        for &b in req.block_ids.iter().rev() {
            self.pool.free(b);
        }
        req.block_ids.clear();
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
