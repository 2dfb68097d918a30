//! Scheduler configuration, validated once at construction.

use crate::error::{CoreError, Result};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// KV blocks in the pool (target + draft share each block).
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Cap on running requests.
    pub max_num_seqs: usize,
    /// Token budget of one step (query tokens of all runs together).
    pub max_num_batched_tokens: usize,
    /// Cap on prompt + output tokens of one request.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Extra KV slots reserved past the last query token of every sampled run.
    pub num_lookahead_tokens: usize,
    /// Pack verification runs as single-token query sequences.
    pub batch_expansion: bool,
    /// Every KV user attends within this sliding window W (a query at position p sees keys
    /// j with p - W < j <= p): after each update, blocks wholly below
    /// `num_computed_tokens - W + 1` go back to the pool. None: keep every block.
    pub sliding_window: Option<usize>,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(CoreError::invalid(field, "must be > 0"));
            }
        }
        if self.sliding_window == Some(0) {
            return Err(CoreError::invalid(
                "sliding_window",
                "must be > 0 (or None)",
            ));
        }
        if self.num_blocks >= u32::MAX as usize || self.max_model_len > i32::MAX as usize {
            return Err(CoreError::invalid("num_blocks", "too large"));
        }
        if self.num_blocks.saturating_mul(self.block_size) < self.max_model_len {
            return Err(CoreError::invalid(
                "num_kv_blocks",
                format!(
                    "num_blocks * block_size = {} * {} = {} < max_model_len = {}: the KV pool \
                     cannot hold one request of max_model_len tokens",
                    self.num_blocks,
                    self.block_size,
                    self.num_blocks * self.block_size,
                    self.max_model_len
                ),
            ));
        }
        Ok(())
    }
}
