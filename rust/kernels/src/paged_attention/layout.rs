//! The batch's layout, validated once per forward and shared by every layer: runs, slots,
//! block table, token-tree masks, and the checks that make the kernel's raw reads safe.

use super::{err, AttentionError, HeadGeometry};

/// The batch's runs, validated once per forward and reused by every layer.
#[derive(Clone, Debug)]
pub struct BatchLayout {
    pub(super) slot_mapping: Vec<i64>, // [T] flat cache slot (block * block_size + offset) of each new token
    pub(super) query_start_loc: Vec<i32>, // [S + 1]
    pub(super) seq_lens: Vec<i32>,     // [S] context length including the query
    pub(super) block_table: Vec<i32>,  // [S, table_width] row-major
    pub(super) table_width: usize,
    pub(super) block_size: usize,
    pub(super) max_block: i64,  // largest block id a run reads (-1: none)
    pub(super) max_slot: i64,   // largest slot a token writes (-1: none)
    pub(super) skip: Vec<bool>, // [S] runs `paged_attention` leaves to the caller (their KV is still stored)
    pub(super) tree: Option<TreeMasks>, // None: every token is causal
    pub(super) batch_invariant: bool, // see `set_batch_invariant`
}

/// Tree masks of a batch (see the module doc), validated by `set_tree_masks`.
#[derive(Clone, Debug)]
pub(super) struct TreeMasks {
    pub(super) mask: Vec<u64>, // [T] bit j: the key at tree_start + j is visible; 0: a causal token
    pub(super) start: Vec<usize>, // [S] KV position of each run's tree root
    pub(super) has_tree: Vec<bool>, // [S] whether the run has a tree token
}

/// Keys visible to tree masks hold at most this many positions past `tree_start`.
pub const TREE_SLOTS: usize = 64;

/// The last key position (< seq_len) a tree token may see: the prefix before `start` or the
/// highest bit of its mask.
#[inline(always)]
pub(super) fn tree_limit(mask: u64, start: usize, seq_len: usize) -> usize {
    let high = start + (63 - mask.leading_zeros() as usize);
    high.max(start.saturating_sub(1)).min(seq_len - 1)
}

/// Whether a tree token (mask != 0) of a run rooted at `start` sees key position `pos`.
#[inline(always)]
pub(super) fn tree_visible(mask: u64, start: usize, pos: usize) -> bool {
    pos < start || (pos - start < TREE_SLOTS && (mask >> (pos - start)) & 1 == 1)
}

impl BatchLayout {
    pub fn new(
        slot_mapping: Vec<i64>,
        query_start_loc: Vec<i32>,
        seq_lens: Vec<i32>,
        block_table: Vec<i32>,
        table_width: usize,
        block_size: usize,
    ) -> Result<Self, AttentionError> {
        if block_size == 0 {
            return err("block_size", "must be >= 1");
        }
        let s = seq_lens.len();
        if query_start_loc.len() != s + 1 {
            return err(
                "query_start_loc",
                format!(
                    "has {} entries for {s} sequences (want S + 1)",
                    query_start_loc.len()
                ),
            );
        }
        if block_table.len() != s * table_width {
            return err(
                "block_table",
                format!(
                    "has {} entries, expected {s} x {table_width}",
                    block_table.len()
                ),
            );
        }
        if query_start_loc[0] != 0 {
            return err(
                "query_start_loc",
                format!("must start at 0, got {}", query_start_loc[0]),
            );
        }
        if query_start_loc[s] as i64 != slot_mapping.len() as i64 {
            return err(
                "query_start_loc",
                format!(
                    "ends at {} but slot_mapping has {} tokens",
                    query_start_loc[s],
                    slot_mapping.len()
                ),
            );
        }
        let mut max_block = -1i64;
        for i in 0..s {
            let n = query_start_loc[i + 1] as i64 - query_start_loc[i] as i64;
            let len = seq_lens[i] as i64;
            if n < 0 {
                return err("query_start_loc", format!("decreases at sequence {i}"));
            }
            if len < n {
                return err(
                    "seq_lens",
                    format!("sequence {i}: context {len} shorter than its query {n}"),
                );
            }
            let blocks = (len as usize).div_ceil(block_size);
            if blocks > table_width {
                return err(
                    "block_table",
                    format!(
                        "sequence {i} needs {blocks} blocks, the table has {table_width} columns"
                    ),
                );
            }
            for &b in &block_table[i * table_width..i * table_width + blocks] {
                if b < 0 {
                    return err(
                        "block_table",
                        format!("sequence {i}: negative block id {b}"),
                    );
                }
                max_block = max_block.max(b as i64);
            }
        }
        let mut max_slot = -1i64;
        for &slot in &slot_mapping {
            if slot < 0 {
                return err("slot_mapping", format!("negative slot {slot}"));
            }
            max_slot = max_slot.max(slot);
        }
        Ok(BatchLayout {
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_table,
            table_width,
            block_size,
            max_block,
            max_slot,
            skip: vec![false; s],
            tree: None,
            batch_invariant: false,
        })
    }

    /// Attach token-tree masks: `tree_mask` int64[T] (bit patterns; 0 = causal token) and
    /// `tree_start` int32[S] (read only for runs with a tree token). Every tree token must see
    /// key 0 (`tree_start > 0` or bit 0 set: the root), so no row is left without a key.
    pub fn set_tree_masks(
        &mut self,
        tree_mask: Vec<i64>,
        tree_start: Vec<i32>,
    ) -> Result<(), AttentionError> {
        let (t, s) = (self.num_tokens(), self.num_seqs());
        if tree_mask.len() != t {
            return err(
                "tree_mask",
                format!("has {} entries for {t} tokens", tree_mask.len()),
            );
        }
        if tree_start.len() != s {
            return err(
                "tree_start",
                format!("has {} entries for {s} sequences", tree_start.len()),
            );
        }
        let mask: Vec<u64> = tree_mask.iter().map(|&m| m as u64).collect();
        let mut has_tree = vec![false; s];
        let mut start = vec![0usize; s];
        for i in 0..s {
            let tokens = self.query_start_loc[i] as usize..self.query_start_loc[i + 1] as usize;
            has_tree[i] = mask[tokens.clone()].iter().any(|&m| m != 0);
            if !has_tree[i] {
                continue;
            }
            let (ts, len) = (tree_start[i], self.seq_lens[i]);
            if ts < 0 || ts > len {
                return err(
                    "tree_start",
                    format!("sequence {i}: {ts} is outside its context 0..={len}"),
                );
            }
            start[i] = ts as usize;
            if let Some(tok) = tokens.into_iter().find(|&tok| {
                let m = mask[tok];
                m != 0 && ts == 0 && m & 1 == 0
            }) {
                return err(
                    "tree_mask",
                    format!(
                        "token {tok} (sequence {i}, tree_start 0) does not see its root (bit 0)"
                    ),
                );
            }
        }
        self.tree = if has_tree.iter().any(|&h| h) {
            Some(TreeMasks {
                mask,
                start,
                has_tree,
            })
        } else {
            None
        };
        Ok(())
    }

    /// Leave the flagged runs' output rows to the caller (who attends them some other way);
    /// `store_kv` still writes their keys and values.
    /// Each query row is computed by the same operations in the same order whether it is a
    /// decode, in a verification run or in a prefill chunk of any length: with AVX-512, head_dim
    /// 32 / 64 / 128 and no tree mask every item takes the few-rows path (not only decodes and
    /// short runs); otherwise every item takes the per-row path (`attend_item`), never the
    /// row-parallel one. For exact speculation where float noise matters (W8A8 rounds each GEMM
    /// input to a grid; bit-equal logprobs). Costs 10-30 % of attention time on AVX-512 on long
    /// runs, more on the per-row path.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.batch_invariant = on;
    }

    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    pub fn skip_attention(&mut self, skip: Vec<bool>) -> Result<(), AttentionError> {
        if skip.len() != self.num_seqs() {
            return err(
                "skip",
                format!("has {} flags for {} sequences", skip.len(), self.num_seqs()),
            );
        }
        self.skip = skip;
        Ok(())
    }

    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    pub(super) fn check_cache(&self, geo: &HeadGeometry) -> Result<(), AttentionError> {
        geo.validate()?;
        if geo.block_size != self.block_size {
            return err(
                "block_size",
                format!(
                    "cache has {}, the batch was laid out for {}",
                    geo.block_size, self.block_size
                ),
            );
        }
        if self.max_block >= geo.num_blocks as i64 {
            return err(
                "block_table",
                format!(
                    "block id {} out of range (num_blocks {})",
                    self.max_block, geo.num_blocks
                ),
            );
        }
        if self.max_slot >= (geo.num_blocks * geo.block_size) as i64 {
            return err(
                "slot_mapping",
                format!(
                    "slot {} out of range ({} blocks of {})",
                    self.max_slot, geo.num_blocks, geo.block_size
                ),
            );
        }
        Ok(())
    }
}
