//! `Scheduler::update` and its result, and validation of the ragged (`cu_*`)
//! arrays that cross the boundary.
//!
//! A verified token tree: the emitted tokens are the accepted path plus one
//! recovered or bonus token; the path is inferred by descending from the root into
//! the lowest-index child whose token is the emitted one (`tree::accepted_path`).
//! The accepted node at tree index i_j (root = 0; j = 1..a) has its KV at slot
//! position `root + i_j` and belongs at `root + j`: the copy list says so
//! (`kv_copy_src` -> `kv_copy_dst`, flat slots, increasing j, src == dst omitted;
//! every dst < its src and never a later src, so applying the copies in order is
//! safe). The request then has `root + 1 + a` computed tokens; the slots past them
//! are rolled back like rejected chain drafts.
//!
//! Under a sliding window, each request that goes on then gives back the blocks that
//! fell out of the window of every later query (`KvCacheManager::free_dead_blocks`).

use crate::error::{CoreError, Result};
use crate::request::{FinishReason, Request, RequestId, RequestStatus};
use crate::scheduler::Scheduler;
use crate::tree::{accepted_path, MAX_TREE_NODES};

/// Tokens appended by one `update` (M = requests that got tokens, N = tokens,
/// F = finished requests).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UpdateOutput {
    pub req_ids: Vec<u64>,                 // [M]
    pub cu_num_new: Vec<i32>,              // [M + 1]
    pub new_token_ids: Vec<i64>,           // [N]
    pub finished_req_ids: Vec<u64>,        // [F]
    pub finish_reasons: Vec<FinishReason>, // [F]
    pub stop_token: Vec<i64>,              // [F] token that caused "stop", or -1
    /// KV copies compacting verified trees' accepted paths (C pairs, flat slots
    /// `block * block_size + offset`); apply in order to every KV cache. Empty
    /// (unallocated) when no tree path needs moving.
    pub kv_copy_src: Vec<i64>, // [C]
    pub kv_copy_dst: Vec<i64>,             // [C]
}

impl UpdateOutput {
    pub fn with_capacity(num_reqs: usize, num_tokens: usize) -> Self {
        let mut cu_num_new = Vec::with_capacity(num_reqs + 1);
        cu_num_new.push(0);
        UpdateOutput {
            req_ids: Vec::with_capacity(num_reqs),
            cu_num_new,
            new_token_ids: Vec::with_capacity(num_tokens),
            ..Default::default()
        }
    }

    pub(crate) fn push_tokens(&mut self, id: RequestId, tokens: &[u32]) {
        self.req_ids.push(id);
        self.new_token_ids.extend(tokens.iter().map(|&t| t as i64));
        self.cu_num_new.push(self.new_token_ids.len() as i32);
    }

    pub(crate) fn push_finished(&mut self, id: RequestId, reason: FinishReason, stop_token: i64) {
        self.finished_req_ids.push(id);
        self.finish_reasons.push(reason);
        self.stop_token.push(stop_token);
    }
}

impl Scheduler {
    /// Applies the emitted tokens of the pending step (see the module doc).
    pub fn update(
        &mut self,
        sampled_token_ids: &[u32],
        cu_num_sampled: &[i32],
    ) -> Result<UpdateOutput> {
        if !self.pending_update {
            return Err(CoreError::InvalidCallOrder(
                "update() called without a pending non-empty schedule()",
            ));
        }
        validate_cu(
            "cu_num_sampled",
            cu_num_sampled,
            self.runs.len(),
            sampled_token_ids.len(),
        )?;
        for (i, run) in self.runs.iter().enumerate() {
            let emitted = (cu_num_sampled[i + 1] - cu_num_sampled[i]) as u32;
            let max = if run.sampled {
                1 + run.num_draft_tokens
            } else {
                0
            };
            let min = u32::from(run.sampled);
            if emitted < min || emitted > max {
                return Err(CoreError::invalid(
                    "cu_num_sampled",
                    format!(
                        "request {} emitted {emitted} tokens; expected {min}..={max}",
                        run.req_id
                    ),
                ));
            }
            if run.is_tree {
                let Some(req) = self.live_scheduled(run) else {
                    continue;
                };
                let tokens =
                    &sampled_token_ids[cu_num_sampled[i] as usize..cu_num_sampled[i + 1] as usize];
                let (drafts, parents) = verified_tree(req, run.num_draft_tokens as usize);
                let mut path = [0u8; MAX_TREE_NODES];
                let accepted = &tokens[..tokens.len() - 1];
                if accepted_path(drafts, parents, accepted, &mut path).is_none() {
                    return Err(CoreError::invalid(
                        "sampled_token_ids",
                        format!(
                            "request {}: the emitted tokens {tokens:?} do not follow a path of \
                             its draft tree (each accepted token descends into the lowest-index \
                             child with that token)",
                            run.req_id
                        ),
                    ));
                }
            }
        }
        self.pending_update = false;
        let max_len = self.config.max_model_len;
        let mut out = UpdateOutput::with_capacity(self.runs.len(), sampled_token_ids.len());
        let mut any_finished = false;
        for (i, run) in self.runs.iter().enumerate() {
            let Some(req) = self.requests[run.slot as usize].as_mut() else {
                continue;
            };
            if req.generation != run.generation || req.status != RequestStatus::Running {
                continue; // aborted (and maybe replaced) since schedule()
            }
            if req.has_placeholder {
                // a step scheduled ahead decodes from this step's token: it takes the
                // placeholder's place (run.sampled: one token, no drafts)
                req.token_ids.pop();
                req.has_placeholder = false;
            }
            let tokens =
                &sampled_token_ids[cu_num_sampled[i] as usize..cu_num_sampled[i + 1] as usize];
            let mut path = [0u8; MAX_TREE_NODES];
            let mut path_len = 0;
            if run.is_tree {
                let (drafts, parents) = verified_tree(req, run.num_draft_tokens as usize);
                path_len = accepted_path(drafts, parents, &tokens[..tokens.len() - 1], &mut path)
                    .expect("checked above");
            }
            if run.sampled {
                let rejected = run.num_draft_tokens as usize + 1 - tokens.len();
                self.kv.rollback(req, rejected);
                // Verified drafts are spent. The unverified rest of a split proposal
                // stays only if every verified draft was accepted (no recovered token).
                let v = run.num_verified_drafts as usize;
                let split_and_all_accepted = v > run.num_draft_tokens as usize
                    && tokens.len() == v
                    && tokens == &req.draft_token_ids[..v];
                if split_and_all_accepted {
                    req.draft_token_ids.drain(..v);
                } else {
                    req.clear_drafts();
                }
            }
            let mut finish = None;
            let mut num_new = 0;
            for &t in tokens {
                num_new += 1;
                if let Some(reason) = req.append_token(t, max_len) {
                    finish = Some((reason, t));
                    break;
                }
            }
            if num_new > 0 {
                out.push_tokens(req.id, &tokens[..num_new]);
                if let Some(sc) = self.suffix.as_mut() {
                    sc.extend(req.id, &req.token_ids, num_new);
                }
            }
            // Before caching (a cached block must hold its tokens' KV) and freeing:
            // copies into a finished request's freed blocks are harmless, and needed
            // where those blocks stay in the prefix cache.
            let root = run.num_computed_tokens as usize;
            let bs = self.config.block_size;
            for (j, &node) in path[..path_len.min(num_new)].iter().enumerate() {
                let (src, dst) = (root + 1 + node as usize, root + 1 + j);
                if src != dst {
                    out.kv_copy_src.push(flat_slot(req, src, bs));
                    out.kv_copy_dst.push(flat_slot(req, dst, bs));
                }
            }
            self.kv.cache_confirmed_blocks(req);
            if finish.is_none() {
                // sliding window: blocks no later query of this request can read (below the
                // window of its first unconfirmed position, where a step scheduled ahead queries)
                self.stats.num_window_freed_blocks += self.kv.free_dead_blocks(req) as u64;
            }
            if let Some((reason, t)) = finish {
                self.kv.free(req);
                if let Some(sc) = self.suffix.as_mut() {
                    sc.finish(req.id, &req.token_ids[req.num_prompt_tokens..]);
                }
                let stop_token = if reason == FinishReason::Stop {
                    t as i64
                } else {
                    -1
                };
                out.push_finished(req.id, reason, stop_token);
                any_finished = true;
            }
        }
        if any_finished {
            for &id in &out.finished_req_ids {
                let slot = self.index.remove(&id).expect("finished request is indexed");
                self.requests[slot as usize] = None;
                self.free_slots.push(slot);
            }
            let requests = &self.requests;
            self.running.retain(|&s| requests[s as usize].is_some());
        }
        self.promote_ahead();
        Ok(out)
    }

    /// The request of a pending run, unless it was aborted (and maybe replaced) since.
    fn live_scheduled(&self, run: &crate::batch::ScheduledRun) -> Option<&Request> {
        let req = self.requests[run.slot as usize].as_ref()?;
        (req.generation == run.generation && req.status == RequestStatus::Running).then_some(req)
    }
}

/// The first `m` nodes of a request's tree proposal: (tokens, parents).
fn verified_tree(req: &Request, m: usize) -> (&[u32], &[i32]) {
    (&req.draft_token_ids[..m], &req.draft_parents[..m])
}

/// Flat KV slot (`block * block_size + offset`) of position `pos` of a request.
#[inline]
fn flat_slot(req: &Request, pos: usize, block_size: usize) -> i64 {
    debug_assert!(req.block_ids[pos / block_size] != crate::block_pool::DEAD_BLOCK);
    req.block_ids[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64
}

/// Checks a cumulative-offsets array of `num_rows + 1` entries: starts at 0, never
/// decreases, ends at `num_items`.
pub fn validate_cu(
    field: &'static str,
    cu: &[i32],
    num_rows: usize,
    num_items: usize,
) -> Result<()> {
    if cu.len() != num_rows + 1 {
        return Err(CoreError::invalid(
            field,
            format!("has {} entries, expected {}", cu.len(), num_rows + 1),
        ));
    }
    if cu[0] != 0 {
        return Err(CoreError::invalid(
            field,
            format!("must start at 0, got {}", cu[0]),
        ));
    }
    if cu.windows(2).any(|w| w[1] < w[0]) {
        return Err(CoreError::invalid(field, "must be non-decreasing"));
    }
    if cu[num_rows] as usize != num_items {
        return Err(CoreError::invalid(
            field,
            format!("ends at {} but {num_items} tokens were given", cu[num_rows]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_arrays_are_checked_and_name_their_field() {
        assert!(validate_cu("cu", &[0, 1, 3], 2, 3).is_ok());
        let err = validate_cu("cu_num_sampled", &[0, 2, 1], 2, 1).unwrap_err();
        assert!(err.to_string().starts_with("cu_num_sampled:"));
        assert!(validate_cu("cu", &[1, 2], 1, 2).is_err());
        assert!(validate_cu("cu", &[0, 2], 1, 3).is_err());
        assert!(validate_cu("cu", &[0], 1, 0).is_err());
    }
}
