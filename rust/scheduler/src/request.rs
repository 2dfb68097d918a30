//! One request's state: its tokens (prompt + output), how much of them is in the KV
//! cache, its pending draft, its stop parameters and its blocks.
//!
//! Token bookkeeping (positions are token indices):
//! - `token_ids[..num_prompt_tokens]` is the prompt, the rest is output.
//! - `num_computed_tokens` tokens have their KV in the cache. After every `update`
//!   a request that sampled has `num_computed_tokens == num_tokens() - 1`: the last
//!   emitted token is the next query.
//! - `draft_token_ids` are appended virtually: `num_tokens_with_spec()` counts them,
//!   and a verification run is the last token plus the drafts.
//! - `draft_parents` (empty = a chain) makes the proposal a token tree (see `tree`):
//!   the drafts then sit at consecutive KV slots after the root but at RoPE positions
//!   root + depth, and only the accepted path is kept.

use crate::block_pool::{BlockHash, BlockId};

/// Request id chosen by Python.
pub type RequestId = u64;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// In the waiting queue (new, or preempted and to be recomputed).
    Waiting,
    /// Admitted: holds blocks and is scheduled each step as the budget allows.
    Running,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id was emitted (the token is kept in the output).
    Stop,
    /// `max_tokens` output tokens or `max_model_len` tokens in total.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Stop conditions checked by `update` after each appended token.
#[derive(Debug, Clone, Default)]
pub struct StopParams {
    /// Finish with "length" once this many output tokens exist. >= 1.
    pub max_tokens: u32,
    /// EOS and stop token ids are ignored until this many output tokens exist.
    pub min_tokens: u32,
    pub eos_token_id: Option<u32>,
    pub ignore_eos: bool,
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    /// Prompt followed by output tokens.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is in the cache (may include drafts between schedule and update).
    pub num_computed_tokens: usize,
    /// The proposal awaiting verification; cleared after the step that verified it.
    pub draft_token_ids: Vec<u32>,
    /// Parent of each draft (-1 = the root) when the proposal is a tree that is not a
    /// chain; empty for a chain (and for no proposal).
    pub draft_parents: Vec<i32>,
    pub stop: StopParams,
    pub status: RequestStatus,
    /// The request's block table row: block i holds positions [i*bs, (i+1)*bs). The
    /// first `num_dead_blocks` entries are `DEAD_BLOCK` (given back under a sliding window).
    pub block_ids: Vec<BlockId>,
    /// Leading block-table entries freed because no later query can read them (sliding
    /// window); they stay in the row as `DEAD_BLOCK` so the row remains positional.
    pub num_dead_blocks: usize,
    /// Prefix-cache hashes of the leading full, confirmed blocks (`<= block_ids.len()`),
    /// dead ones included (a later block's hash chains through them).
    pub block_hashes: Vec<BlockHash>,
    /// Unique per `add_request` (the scheduler's counter): a pending run belongs to this
    /// request only if their generations match (guards `update` and `cancel_step` against
    /// a request aborted, and maybe re-added under its id, since `schedule`).
    pub generation: u64,
    /// The last token is a placeholder for the token the pending step will emit: a step
    /// scheduled ahead (`schedule_ahead`) decodes from it. `update` replaces it.
    pub has_placeholder: bool,
    /// Tokens the step scheduled ahead added to `num_computed_tokens` (not yet confirmed
    /// when the older step is updated).
    pub num_ahead_tokens: u32,
}

impl Request {
    pub fn new(id: RequestId, prompt: Vec<u32>, stop: StopParams) -> Self {
        Request {
            id,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            num_computed_tokens: 0,
            draft_token_ids: Vec::new(),
            draft_parents: Vec::new(),
            stop,
            status: RequestStatus::Waiting,
            block_ids: Vec::new(),
            num_dead_blocks: 0,
            block_hashes: Vec::new(),
            generation: 0,
            has_placeholder: false,
            num_ahead_tokens: 0,
        }
    }

    /// Blocks the request holds in the pool (its row less the dead placeholders).
    pub fn num_live_blocks(&self) -> usize {
        self.block_ids.len() - self.num_dead_blocks
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Tokens whose KV is confirmed: computed by updated steps (a step scheduled ahead's
    /// tokens are not, until the step before it is updated and it becomes the pending one).
    pub fn num_confirmed_tokens(&self) -> usize {
        self.num_computed_tokens - self.num_ahead_tokens as usize
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Whether the pending proposal is a tree (not a chain).
    #[inline]
    pub fn has_draft_tree(&self) -> bool {
        !self.draft_parents.is_empty()
    }

    /// Drops the pending proposal (chain or tree).
    pub fn clear_drafts(&mut self) {
        self.draft_token_ids.clear();
        self.draft_parents.clear();
    }

    pub fn num_tokens_with_spec(&self) -> usize {
        self.token_ids.len() + self.draft_token_ids.len()
    }

    /// Token at `pos` of prompt + output + drafts.
    #[inline]
    pub fn token_with_spec(&self, pos: usize) -> u32 {
        match self.token_ids.get(pos) {
            Some(&t) => t,
            None => self.draft_token_ids[pos - self.token_ids.len()],
        }
    }

    /// Whether a run starting at the current `num_computed_tokens` is a prompt chunk
    /// (the request has not sampled since its prompt — or, after preemption, its
    /// prompt + earlier output — was last computed).
    pub fn is_prefilling(&self) -> bool {
        self.num_computed_tokens + 1 < self.num_tokens() || self.num_output_tokens() == 0
    }

    /// The largest proposal that cannot push the request past `max_tokens` or
    /// `max_model_len` even with the bonus token.
    pub fn max_num_draft_tokens(&self, max_model_len: usize) -> usize {
        let by_tokens = (self.stop.max_tokens as usize)
            .saturating_sub(self.num_output_tokens())
            .saturating_sub(1);
        let by_len = max_model_len.saturating_sub(self.num_tokens() + 1);
        by_tokens.min(by_len)
    }

    /// Appends one emitted token and reports the stop condition it triggers, if any.
    pub fn append_token(&mut self, token: u32, max_model_len: usize) -> Option<FinishReason> {
        self.token_ids.push(token);
        let num_output = self.num_output_tokens();
        let past_min = num_output >= self.stop.min_tokens as usize;
        if past_min && !self.stop.ignore_eos && self.stop.eos_token_id == Some(token) {
            return Some(FinishReason::Stop);
        }
        if past_min && self.stop.stop_token_ids.contains(&token) {
            return Some(FinishReason::Stop);
        }
        if num_output >= self.stop.max_tokens as usize || self.num_tokens() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(max_tokens: u32, min_tokens: u32) -> Request {
        let stop = StopParams {
            max_tokens,
            min_tokens,
            eos_token_id: Some(2),
            ignore_eos: false,
            stop_token_ids: vec![7],
        };
        Request::new(1, vec![5, 6, 8], stop)
    }

    #[test]
    fn eos_and_stop_tokens_stop_only_after_min_tokens() {
        let mut r = req(10, 2);
        assert_eq!(r.append_token(2, 100), None);
        assert_eq!(r.append_token(7, 100), Some(FinishReason::Stop));
        let mut r = req(10, 0);
        assert_eq!(r.append_token(2, 100), Some(FinishReason::Stop));
    }

    #[test]
    fn ignore_eos_keeps_going_until_length() {
        let mut r = req(2, 0);
        r.stop.ignore_eos = true;
        assert_eq!(r.append_token(2, 100), None);
        assert_eq!(r.append_token(2, 100), Some(FinishReason::Length));
    }

    #[test]
    fn max_model_len_is_a_length_stop() {
        let mut r = req(10, 0);
        assert_eq!(r.append_token(9, 4), Some(FinishReason::Length));
    }

    #[test]
    fn drafts_are_clamped_by_max_tokens_and_max_model_len() {
        let r = req(4, 0); // 3 prompt tokens, 0 output
        assert_eq!(r.max_num_draft_tokens(100), 3);
        assert_eq!(r.max_num_draft_tokens(6), 2);
        assert_eq!(r.max_num_draft_tokens(3), 0);
    }

    #[test]
    fn tokens_with_spec_continue_into_drafts() {
        let mut r = req(10, 0);
        r.draft_token_ids = vec![40, 41];
        assert_eq!(r.num_tokens_with_spec(), 5);
        assert_eq!(r.token_with_spec(2), 8);
        assert_eq!(r.token_with_spec(4), 41);
    }
}
