//! Padding a packed batch's token axis up to a shape bucket, for static-shape devices.
//!
//! A graph compiled (Gaudi) or captured (CUDA graphs) for one token count is reused only for
//! that count, so the packer rounds every batch's `T` up to the smallest warmed bucket. The
//! padded tokens are inert:
//!
//! - they belong to no query sequence (`query_start_loc`, `seq_lens`, the block table and
//!   `logits_indices` are untouched), so no real token attends to them and they attend to
//!   nothing real;
//! - they write their K/V into the **null block**, one block past the pool
//!   (`null_block >= num_blocks`), which the KV cache allocates but the pool never hands out,
//!   so no real KV slot is ever read or written by a padded row;
//! - `input_ids` 0, `positions` 0: any valid embedding row and rotary angle;
//! - `tree_mask` 0 (when the batch has tree runs): ordinary tokens; `tree_start`, per
//!   sequence, is untouched.
//!
//! `total_num_scheduled_tokens` stays the real count; `input_ids.len() - total` is the padding.

use crate::batch::SchedulerOutput;
use crate::error::{CoreError, Result};

/// The token-count buckets a batch is padded to, and where padded rows write their K/V.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPadding {
    /// Strictly increasing, each >= 1.
    buckets: Vec<usize>,
    /// A block id outside the pool (>= num_blocks): padded rows write only there.
    null_block: u32,
}

impl TokenPadding {
    /// Checks the buckets (non-empty, strictly increasing, >= 1) and that the null block lies
    /// outside the pool of `num_blocks` blocks.
    pub fn new(buckets: Vec<usize>, null_block: u32, num_blocks: usize) -> Result<Self> {
        if buckets.is_empty() || buckets[0] == 0 || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CoreError::invalid(
                "token_buckets",
                format!(
                    "must be a non-empty strictly increasing list of ints >= 1, got {buckets:?}"
                ),
            ));
        }
        if (null_block as usize) < num_blocks {
            return Err(CoreError::invalid(
                "null_block",
                format!("{null_block} is a real block of the pool (0..{num_blocks}); use a block id >= num_blocks"),
            ));
        }
        Ok(TokenPadding {
            buckets,
            null_block,
        })
    }

    pub fn buckets(&self) -> &[usize] {
        &self.buckets
    }

    /// The smallest bucket >= `t`; past the largest, the next multiple of the largest.
    pub fn padded_len(&self, t: usize) -> usize {
        match self.buckets.iter().find(|&&b| b >= t) {
            Some(&b) => b,
            None => {
                let top = *self.buckets.last().expect("non-empty");
                t.div_ceil(top) * top
            }
        }
    }

    /// Appends inert tokens to `out` up to `padded_len(T)`; an empty batch stays empty.
    /// Returns the number of padded tokens.
    pub fn pad(&self, out: &mut SchedulerOutput, block_size: usize) -> usize {
        let t = out.input_ids.len();
        if t == 0 {
            return 0;
        }
        let n = self.padded_len(t) - t;
        let base = self.null_block as i64 * block_size as i64;
        out.input_ids.resize(t + n, 0);
        out.positions.resize(t + n, 0);
        if !out.tree_mask.is_empty() {
            out.tree_mask.resize(t + n, 0);
        }
        out.slot_mapping.reserve(n);
        for j in 0..n {
            out.slot_mapping.push(base + (j % block_size) as i64);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(t: usize) -> SchedulerOutput {
        SchedulerOutput {
            input_ids: (1..=t as i64).collect(),
            positions: (0..t as i64).collect(),
            slot_mapping: (0..t as i64).collect(),
            query_start_loc: vec![0, t as i32],
            seq_lens: vec![t as i32],
            logits_indices: vec![t as i64 - 1],
            total_num_scheduled_tokens: t,
            ..Default::default()
        }
    }

    #[test]
    fn pads_up_to_the_smallest_bucket_and_past_the_largest_to_a_multiple() {
        let p = TokenPadding::new(vec![1, 2, 4, 8, 16], 10, 10).unwrap();
        assert_eq!(
            [1, 2, 3, 5, 16, 17, 40].map(|t| p.padded_len(t)),
            [1, 2, 4, 8, 16, 32, 48]
        );
    }

    #[test]
    fn padded_rows_are_inert_and_write_only_the_null_block() {
        let p = TokenPadding::new(vec![4, 8], 7, 7).unwrap();
        let mut out = batch(5);
        assert_eq!(p.pad(&mut out, 2), 3);
        assert_eq!(out.input_ids, vec![1, 2, 3, 4, 5, 0, 0, 0]);
        assert_eq!(out.positions, vec![0, 1, 2, 3, 4, 0, 0, 0]);
        assert_eq!(out.slot_mapping, vec![0, 1, 2, 3, 4, 14, 15, 14]); // null block 7 * block_size 2
                                                                       // the sequences, the logits rows and the real token count are untouched
        assert_eq!((out.query_start_loc, out.seq_lens), (vec![0, 5], vec![5]));
        assert_eq!(
            (out.logits_indices, out.total_num_scheduled_tokens),
            (vec![4], 5)
        );
    }

    #[test]
    fn a_tree_batch_pads_its_tree_mask_with_causal_zeros() {
        let p = TokenPadding::new(vec![8], 7, 7).unwrap();
        let mut out = batch(5);
        out.tree_mask = vec![0, 0, 1, 3, 5];
        out.tree_start = vec![2];
        assert_eq!(p.pad(&mut out, 2), 3);
        assert_eq!(out.tree_mask, vec![0, 0, 1, 3, 5, 0, 0, 0]);
        assert_eq!(out.tree_start, vec![2]);
        let mut chain = batch(5); // no tree run: the tree arrays stay empty
        p.pad(&mut chain, 2);
        assert!(chain.tree_mask.is_empty() && chain.tree_start.is_empty());
    }

    #[test]
    fn an_exact_fit_and_an_empty_batch_get_no_padding() {
        let p = TokenPadding::new(vec![4], 3, 2).unwrap();
        let mut out = batch(4);
        assert_eq!(p.pad(&mut out, 16), 0);
        assert_eq!(out.input_ids.len(), 4);
        let mut empty = SchedulerOutput::default();
        assert_eq!(p.pad(&mut empty, 16), 0);
        assert!(empty.input_ids.is_empty());
    }

    #[test]
    fn bad_buckets_and_a_null_block_inside_the_pool_are_refused() {
        for b in [vec![], vec![0, 4], vec![4, 4], vec![8, 4]] {
            let err = TokenPadding::new(b, 9, 9).unwrap_err().to_string();
            assert!(err.contains("token_buckets"), "{err}");
        }
        let err = TokenPadding::new(vec![4], 8, 9).unwrap_err().to_string();
        assert!(err.contains("null_block"), "{err}");
    }
}
