//! `Scheduler::check_invariants`: the bookkeeping rules that must hold between
//! any two public calls. Used by the property tests and exposed to Python.

use std::collections::HashSet;

use crate::block_pool::DEAD_BLOCK;
use crate::error::{CoreError, Result};
use crate::kv_cache_manager::cdiv;
use crate::lookahead::PLACEHOLDER_TOKEN;
use crate::request::RequestStatus;
use crate::scheduler::Scheduler;
use crate::tree::{is_chain, MAX_TREE_NODES};

impl Scheduler {
    /// Describes the first broken invariant: free-list integrity, ref counts equal
    /// to block-table references (no leaks; dead sliding-window placeholders hold
    /// none), free + used == total, computed <= tokens, queue membership, caps, draft
    /// trees well formed and only on decoding requests.
    pub fn check_invariants(&self) -> Result<()> {
        let broken = |msg: String| Err(CoreError::InvariantViolation(msg));
        let pool = &self.kv.pool;
        if let Err(e) = pool.check_integrity() {
            return broken(format!("block pool: {e}"));
        }
        let bs = self.config.block_size;
        let mut refs = vec![0u32; pool.num_total()];
        let mut seen = HashSet::new();
        for (queue, status, slots) in [
            (
                "waiting",
                RequestStatus::Waiting,
                self.waiting.iter().copied().collect::<Vec<_>>(),
            ),
            ("running", RequestStatus::Running, self.running.clone()),
        ] {
            for slot in slots {
                let Some(req) = self.requests.get(slot as usize).and_then(Option::as_ref) else {
                    return broken(format!("{queue} queue holds empty slot {slot}"));
                };
                if !seen.insert(slot) {
                    return broken(format!("request {} is queued twice", req.id));
                }
                if req.status != status {
                    return broken(format!(
                        "request {} in {queue} queue has status {:?}",
                        req.id, req.status
                    ));
                }
                if self.index.get(&req.id) != Some(&slot) {
                    return broken(format!("request {} is not indexed at its slot", req.id));
                }
                if req.num_computed_tokens > req.num_tokens_with_spec() {
                    return broken(format!(
                        "request {}: num_computed_tokens {} > num_tokens_with_spec {}",
                        req.id,
                        req.num_computed_tokens,
                        req.num_tokens_with_spec()
                    ));
                }
                if req.num_tokens() > self.config.max_model_len
                    || req.num_output_tokens() > req.stop.max_tokens as usize
                {
                    return broken(format!(
                        "request {} is past max_model_len or max_tokens",
                        req.id
                    ));
                }
                if req.block_ids.len() * bs < req.num_computed_tokens {
                    return broken(format!(
                        "request {}: computed tokens without KV slots",
                        req.id
                    ));
                }
                if req.has_draft_tree() {
                    let (d, p) = (&req.draft_token_ids, &req.draft_parents);
                    let valid = p.len() == d.len()
                        && p.len() <= MAX_TREE_NODES
                        && p.iter().enumerate().all(|(k, &x)| x >= -1 && x < k as i32)
                        && !is_chain(p);
                    if !valid {
                        return broken(format!(
                            "request {}: draft tree with parents {p:?} for {} drafts",
                            req.id,
                            d.len()
                        ));
                    }
                    // set only when decoding; dropped by preemption
                    if status == RequestStatus::Waiting
                        || req.num_computed_tokens + 1 < req.num_tokens()
                    {
                        return broken(format!(
                            "request {}: a draft tree on a request that is not decoding",
                            req.id
                        ));
                    }
                }
                if self.ahead.is_none() && (req.has_placeholder || req.num_ahead_tokens != 0) {
                    return broken(format!(
                        "request {}: a placeholder or ahead tokens with no step scheduled ahead",
                        req.id
                    ));
                }
                if req.has_placeholder != (req.token_ids.last() == Some(&PLACEHOLDER_TOKEN)) {
                    return broken(format!(
                        "request {}: placeholder flag and tokens disagree",
                        req.id
                    ));
                }
                if req.num_ahead_tokens as usize > req.num_computed_tokens {
                    return broken(format!(
                        "request {}: more ahead tokens than computed",
                        req.id
                    ));
                }
                if req.block_hashes.len() > req.block_ids.len() {
                    return broken(format!("request {}: more block hashes than blocks", req.id));
                }
                if status == RequestStatus::Waiting
                    && (!req.block_ids.is_empty() || req.num_computed_tokens != 0)
                {
                    return broken(format!("waiting request {} holds KV", req.id));
                }
                let max_blocks = cdiv(self.config.max_model_len, bs);
                if req.block_ids.len() > max_blocks {
                    return broken(format!(
                        "request {} holds {} blocks > {max_blocks}",
                        req.id,
                        req.block_ids.len()
                    ));
                }
                // dead placeholders: exactly the leading `num_dead_blocks` entries, each
                // wholly outside the sliding window of every later query, and never in
                // the pool (they were given back); hashes chain through them
                let dead = req.num_dead_blocks;
                if dead > req.block_ids.len()
                    || dead > self.kv.num_dead_blocks_for(req.num_computed_tokens)
                {
                    return broken(format!(
                        "request {}: {dead} dead blocks with {} computed tokens under window {:?}",
                        req.id, req.num_computed_tokens, self.config.sliding_window
                    ));
                }
                if self.config.enable_prefix_caching && req.block_hashes.len() < dead {
                    return broken(format!("request {}: a dead block was never cached", req.id));
                }
                for (i, &b) in req.block_ids.iter().enumerate() {
                    if (b == DEAD_BLOCK) != (i < dead) {
                        return broken(format!(
                            "request {}: block-table entry {i} is {b} with {dead} dead blocks",
                            req.id
                        ));
                    }
                    if b != DEAD_BLOCK {
                        refs[b as usize] += 1;
                    }
                }
            }
        }
        if seen.len() != self.index.len() {
            return broken(format!(
                "{} requests indexed but {} queued",
                self.index.len(),
                seen.len()
            ));
        }
        if self.running.len() > self.config.max_num_seqs {
            return broken(format!("{} running > max_num_seqs", self.running.len()));
        }
        let mut used = 0;
        for (b, &r) in refs.iter().enumerate() {
            if pool.ref_count(b as u32) != r {
                return broken(format!(
                    "block {b}: ref_cnt {} but {r} block-table references (leak or double free)",
                    pool.ref_count(b as u32)
                ));
            }
            used += usize::from(r > 0);
        }
        if used + pool.num_free() != pool.num_total() {
            return broken(format!(
                "free {} + used {used} != total {}",
                pool.num_free(),
                pool.num_total()
            ));
        }
        if let Some(sc) = self.suffix.as_ref() {
            for (id, len) in sc.local_lengths() {
                match self.request(id) {
                    None => return broken(format!("suffix trie kept for ended request {id}")),
                    Some(r) if r.token_ids.len() != len => {
                        return broken(format!(
                            "suffix trie of request {id} holds {len} tokens, the request {}",
                            r.token_ids.len()
                        ))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
