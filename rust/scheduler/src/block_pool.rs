//! The paged-KV block pool: a fixed set of `num_blocks` blocks, each holding
//! `block_size` token slots of the target (and draft) KV cache.
//!
//! Structure:
//! - **free list**: an index-linked doubly linked list threaded through the block
//!   metadata, in LRU order. Blocks are handed out from the head (least recently
//!   freed) and freed to the tail. No allocation ever happens on the hot path.
//! - **ref counts**: a block is "used" while its ref count is > 0 (several requests
//!   can share a cached prefix block); it is on the free list exactly when its
//!   ref count is 0.
//! - **prefix cache**: a map from an *exact* key — the parent block's [`BlockHash`]
//!   plus the block's own token ids — to the block holding that KV. A [`BlockHash`]
//!   is an id handed out once per cache entry and never reused, so equal ids mean
//!   equal token prefixes: collision-proof, unlike a bare 64-bit content hash
//!   (the 64-bit content hash only picks the bucket; keys are compared in full).
//!   A freed block keeps its cache entry until it is handed out again (evicted).
//!
//! Complexity contract (n = num_blocks, b = block_size):
//! - `allocate`, `free`, `touch`: O(1) (evicting a cached block unlinks it from its
//!   bucket's collision chain, O(1) expected). No heap allocation: keys' tokens live
//!   in one arena of `n * b` token ids.
//! - `lookup`, `cache_block`: O(b) expected (hash + compare of one block's tokens).
//! - `check_integrity`: O(n + cache entries) — tests and debugging only.

use std::collections::HashMap;

use crate::hash::{hash_block, FxBuildHasher};

/// Content bucket of a key (tests can force every key into one bucket).
fn bucket_of(parent: BlockHash, tokens: &[u32]) -> u64 {
    #[cfg(test)]
    if tests::FORCE_COLLISIONS.with(|c| c.get()) {
        return 42;
    }
    hash_block(parent, tokens)
}

/// Index of a block in the pool.
pub type BlockId = u32;

/// Identity of an exact token prefix ending at a full block. `ROOT_HASH` is the
/// empty prefix (the parent of a request's first block).
pub type BlockHash = u64;

/// Parent hash of a request's first block.
pub const ROOT_HASH: BlockHash = 0;

const NIL: u32 = u32::MAX;

/// Block-table placeholder for a block the request gave back because no later query can
/// read it (sliding window, `KvCacheManager::free_dead_blocks`). Never a pool block
/// (`num_blocks < u32::MAX`); batch packing exports it as block 0.
pub const DEAD_BLOCK: BlockId = u32::MAX;

/// The exact cache key of a full block and the id it was given. The key's token
/// ids live in the pool's token arena at `[block * block_size, +block_size)`.
#[derive(Debug, Clone, Copy)]
struct CacheKey {
    parent: BlockHash,
    hash: BlockHash,
    bucket: u64,
    /// Next block in the same content bucket (collision chain), or NIL.
    next_in_bucket: u32,
}

#[derive(Debug, Clone)]
struct BlockMeta {
    ref_cnt: u32,
    prev: u32,
    next: u32,
    in_free_list: bool,
    cached: Option<CacheKey>,
}

/// Fixed-size pool of KV blocks with an LRU free list and an exact prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// content bucket -> first block of the chain of blocks whose keys hash there
    /// (keys are compared exactly on lookup).
    cache: HashMap<u64, BlockId, FxBuildHasher>,
    /// Token ids of each cached block's key: `block_size` per block, no per-key allocation.
    key_tokens: Vec<u32>,
    block_size: usize,
    next_hash: BlockHash,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` slots, free list in index order.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks < NIL as usize, "num_blocks too large");
        let blocks = (0..num_blocks as u32)
            .map(|i| BlockMeta {
                ref_cnt: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks as u32 {
                    NIL
                } else {
                    i + 1
                },
                in_free_list: true,
                cached: None,
            })
            .collect();
        BlockPool {
            blocks,
            head: if num_blocks == 0 { NIL } else { 0 },
            tail: if num_blocks == 0 {
                NIL
            } else {
                num_blocks as u32 - 1
            },
            num_free: num_blocks,
            cache: HashMap::default(),
            key_tokens: vec![0; num_blocks * block_size],
            block_size,
            next_hash: ROOT_HASH + 1,
        }
    }

    pub fn num_total(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_cnt
    }

    /// Whether `block` currently holds a prefix-cache entry.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.blocks[block as usize].cached.is_some()
    }

    /// Takes the least recently freed block (evicting its cache entry), ref count 1.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = self.head;
        if block == NIL {
            return None;
        }
        self.unlink(block);
        self.evict(block);
        self.blocks[block as usize].ref_cnt = 1;
        Some(block)
    }

    /// Drops one reference; at zero the block goes to the tail of the free list
    /// (most recently freed), keeping its cache entry.
    pub fn free(&mut self, block: BlockId) {
        let meta = &mut self.blocks[block as usize];
        debug_assert!(meta.ref_cnt > 0, "double free of block {block}");
        meta.ref_cnt -= 1;
        if meta.ref_cnt == 0 {
            self.push_tail(block);
        }
    }

    /// Takes one more reference to a (cached) block; a free block leaves the free list.
    pub fn touch(&mut self, block: BlockId) {
        if self.blocks[block as usize].ref_cnt == 0 {
            self.unlink(block);
        }
        self.blocks[block as usize].ref_cnt += 1;
    }

    /// The cached block holding exactly `tokens` after the prefix `parent`, with its hash.
    pub fn lookup(&self, parent: BlockHash, tokens: &[u32]) -> Option<(BlockId, BlockHash)> {
        self.lookup_in(bucket_of(parent, tokens), parent, tokens)
    }

    fn lookup_in(
        &self,
        bucket: u64,
        parent: BlockHash,
        tokens: &[u32],
    ) -> Option<(BlockId, BlockHash)> {
        let mut b = *self.cache.get(&bucket)?;
        while b != NIL {
            let key = self.blocks[b as usize]
                .cached
                .as_ref()
                .expect("chained blocks are cached");
            if key.parent == parent && self.key_tokens_of(b) == tokens {
                return Some((b, key.hash));
            }
            b = key.next_in_bucket;
        }
        None
    }

    fn key_tokens_of(&self, block: BlockId) -> &[u32] {
        let start = block as usize * self.block_size;
        &self.key_tokens[start..start + self.block_size]
    }

    /// Registers the full `block` as holding `tokens` after prefix `parent` and returns
    /// the prefix's hash. If that exact prefix is already cached (in another block),
    /// `block` stays uncached and the existing hash is returned.
    pub fn cache_block(&mut self, block: BlockId, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size);
        let bucket = bucket_of(parent, tokens);
        if let Some((_, hash)) = self.lookup_in(bucket, parent, tokens) {
            return hash;
        }
        debug_assert!(self.blocks[block as usize].cached.is_none());
        let hash = self.next_hash;
        self.next_hash += 1;
        let start = block as usize * self.block_size;
        self.key_tokens[start..start + self.block_size].copy_from_slice(tokens);
        let next_in_bucket = self.cache.insert(bucket, block).unwrap_or(NIL);
        self.blocks[block as usize].cached = Some(CacheKey {
            parent,
            hash,
            bucket,
            next_in_bucket,
        });
        hash
    }

    fn evict(&mut self, block: BlockId) {
        let Some(key) = self.blocks[block as usize].cached.take() else {
            return;
        };
        let head = self
            .cache
            .get_mut(&key.bucket)
            .expect("cached block's bucket exists");
        if *head == block {
            if key.next_in_bucket == NIL {
                self.cache.remove(&key.bucket);
            } else {
                *head = key.next_in_bucket;
            }
            return;
        }
        let mut b = *head;
        loop {
            let k = self.blocks[b as usize]
                .cached
                .as_mut()
                .expect("chained blocks are cached");
            if k.next_in_bucket == block {
                k.next_in_bucket = key.next_in_bucket;
                return;
            }
            b = k.next_in_bucket;
        }
    }

    fn unlink(&mut self, block: BlockId) {
        let (prev, next) = {
            let m = &self.blocks[block as usize];
            debug_assert!(m.in_free_list);
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let m = &mut self.blocks[block as usize];
        m.prev = NIL;
        m.next = NIL;
        m.in_free_list = false;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, block: BlockId) {
        let old_tail = self.tail;
        {
            let m = &mut self.blocks[block as usize];
            debug_assert!(!m.in_free_list);
            m.prev = old_tail;
            m.next = NIL;
            m.in_free_list = true;
        }
        if old_tail == NIL {
            self.head = block;
        } else {
            self.blocks[old_tail as usize].next = block;
        }
        self.tail = block;
        self.num_free += 1;
    }

    /// Walks the free list and the cache map; describes the first inconsistency.
    pub fn check_integrity(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            if count > self.blocks.len() {
                return Err("free list has a cycle".into());
            }
            let m = &self.blocks[cur as usize];
            if !m.in_free_list || m.ref_cnt != 0 {
                return Err(format!(
                    "block {cur} on the free list with ref_cnt {}",
                    m.ref_cnt
                ));
            }
            if m.prev != prev {
                return Err(format!("free list back link of block {cur} is broken"));
            }
            prev = cur;
            cur = m.next;
            count += 1;
        }
        if prev != self.tail {
            return Err("free list tail is not the last block".into());
        }
        if count != self.num_free {
            return Err(format!(
                "free list holds {count} blocks, num_free says {}",
                self.num_free
            ));
        }
        let zero_ref = self.blocks.iter().filter(|m| m.ref_cnt == 0).count();
        if zero_ref != count {
            return Err(format!(
                "{zero_ref} blocks have ref_cnt 0 but {count} are free"
            ));
        }
        let mut entries = 0usize;
        for (&bucket, &first) in &self.cache {
            let mut b = first;
            while b != NIL {
                match &self.blocks[b as usize].cached {
                    Some(key) if key.bucket == bucket => b = key.next_in_bucket,
                    _ => {
                        return Err(format!(
                            "cache bucket chain reaches block {b} without that key"
                        ))
                    }
                }
                entries += 1;
                if entries > self.blocks.len() {
                    return Err("cache bucket chain has a cycle".into());
                }
            }
        }
        let cached = self.blocks.iter().filter(|m| m.cached.is_some()).count();
        if cached != entries {
            return Err(format!(
                "{cached} blocks hold cache keys but the map chains {entries}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        pub(super) static FORCE_COLLISIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    #[test]
    fn colliding_keys_stay_exact_and_evict_from_anywhere_in_the_chain() {
        FORCE_COLLISIONS.with(|c| c.set(true));
        let mut pool = BlockPool::new(4, 2);
        let blocks: Vec<_> = (0..4).map(|_| pool.allocate().unwrap()).collect();
        let hashes: Vec<_> = blocks
            .iter()
            .map(|&b| pool.cache_block(b, ROOT_HASH, &[b, b]))
            .collect();
        for (&b, &h) in blocks.iter().zip(&hashes) {
            assert_eq!(pool.lookup(ROOT_HASH, &[b, b]), Some((b, h)));
        }
        // free in an order that evicts the middle, the head and the tail of the chain
        for &b in &[1, 3, 0, 2] {
            pool.free(blocks[b]);
        }
        for evicted in 0..4 {
            let b = pool.allocate().unwrap();
            assert_eq!(pool.lookup(ROOT_HASH, &[b, b]), None, "evicted {evicted}");
            pool.check_integrity().unwrap();
            for other in (0..4u32).filter(|&o| pool.ref_count(o) == 0) {
                assert!(pool.lookup(ROOT_HASH, &[other, other]).is_some());
            }
        }
        FORCE_COLLISIONS.with(|c| c.set(false));
    }

    #[test]
    fn allocates_in_index_order_then_lru_order() {
        let mut pool = BlockPool::new(3, 2);
        assert_eq!(pool.allocate(), Some(0));
        assert_eq!(pool.allocate(), Some(1));
        pool.free(0);
        // 2 was never used, 0 was just freed: 2 is the least recently freed.
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.allocate(), Some(0));
        assert_eq!(pool.allocate(), None);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn free_plus_used_is_total_and_shared_blocks_need_every_free() {
        let mut pool = BlockPool::new(4, 2);
        let b = pool.allocate().unwrap();
        pool.touch(b);
        assert_eq!(pool.ref_count(b), 2);
        pool.free(b);
        assert_eq!(pool.num_free(), 3);
        pool.free(b);
        assert_eq!(pool.num_free(), 4);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn freed_block_keeps_its_cache_entry_until_reallocated() {
        let mut pool = BlockPool::new(2, 2);
        let b = pool.allocate().unwrap();
        let h = pool.cache_block(b, ROOT_HASH, &[1, 2]);
        pool.free(b);
        assert_eq!(pool.lookup(ROOT_HASH, &[1, 2]), Some((b, h)));
        // a hit on a free block takes it off the free list
        pool.touch(b);
        assert_eq!(pool.num_free(), 1);
        pool.free(b);
        // exhaust the pool: the cached block is handed out again and evicted
        let x = pool.allocate().unwrap();
        let y = pool.allocate().unwrap();
        assert!(x == b || y == b);
        assert_eq!(pool.lookup(ROOT_HASH, &[1, 2]), None);
        pool.check_integrity().unwrap();
    }

    #[test]
    fn keys_are_exact_parent_and_tokens() {
        let mut pool = BlockPool::new(3, 2);
        let a = pool.allocate().unwrap();
        let ha = pool.cache_block(a, ROOT_HASH, &[1, 2]);
        let b = pool.allocate().unwrap();
        let hb = pool.cache_block(b, ha, &[3, 4]);
        assert_ne!(ha, hb);
        assert_eq!(pool.lookup(ROOT_HASH, &[3, 4]), None);
        assert_eq!(pool.lookup(ha, &[3, 4]), Some((b, hb)));
        assert_eq!(pool.lookup(ha, &[3, 5]), None);
        // caching the same prefix again returns the existing hash, block stays uncached
        let c = pool.allocate().unwrap();
        assert_eq!(pool.cache_block(c, ROOT_HASH, &[1, 2]), ha);
        assert!(!pool.is_cached(c));
        pool.check_integrity().unwrap();
    }
}
