//! The token-budget scheduler.
//!
//! Algorithm (one `schedule`): there are no phases, only tokens. Every request has
//! `num_computed_tokens` and `num_tokens_with_spec`; a run of query tokens closes
//! part of that gap. A prefill chunk, a decode (1 token) and a verification (1 + k)
//! are all runs.
//! 1. Running requests, FCFS: each gets its whole gap, capped by the remaining
//!    token budget. A budget cut splits a verification: the run verifies the drafts
//!    in its query plus the next one (scored by its last row), and the rest of the
//!    proposal waits for the next step, so a cut never changes what is emitted
//!    (the same drafts meet the same verification, only later). A token tree is
//!    cut, not split: the run keeps the first nodes that fit (still a tree, with a
//!    bonus row) and the rest of the tree is dropped. If its KV
//!    slots cannot be allocated, the most recently admitted running request is
//!    preempted (recompute) until the allocation succeeds or the request itself
//!    was the one preempted.
//! 2. Waiting requests, FCFS (only in steps without preemption): prefix-cache
//!    lookup, then a run of the rest of the prompt capped by the budget; stop at
//!    the first that does not fit or when `max_num_seqs` are running.
//!
//! Every run whose logits are sampled reserves `num_lookahead_tokens` more slots.
//!
//! `update` (update.rs) applies the step's emitted tokens: rollback of rejected
//! drafts, compaction of a tree's accepted path, stop conditions (never
//! overshooting), prefix caching of confirmed blocks, freeing (of finished requests,
//! and under `sliding_window` of the blocks that fell out of every later query's window).

use std::collections::{HashMap, VecDeque};

use crate::batch::{pack, ScheduledRun, SchedulerOutput};
use crate::config::SchedulerConfig;
use crate::error::{CoreError, Result};
use crate::hash::FxBuildHasher;
use crate::kv_cache_manager::{CachedPrefix, KvCacheManager};
use crate::lookahead::AheadStep;
use crate::ngram::{propose_with, NgramScratch};
use crate::request::{Request, RequestId, RequestStatus, StopParams};
use crate::suffix::{SuffixCache, SuffixProposal};
use crate::tree::{is_chain, validate_draft_parents};
use crate::update::validate_cu;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_preemptions: u64,
    /// Tokens of admitted requests looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found.
    pub prefix_cache_hits: u64,
    pub num_steps: u64,
    /// Blocks given back because they fell out of the sliding window (`sliding_window`).
    pub num_window_freed_blocks: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    pub(crate) config: SchedulerConfig,
    pub(crate) kv: KvCacheManager,
    /// Slab of live requests; `index` maps ids to slots.
    pub(crate) requests: Vec<Option<Request>>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) index: HashMap<RequestId, u32, FxBuildHasher>,
    pub(crate) waiting: VecDeque<u32>,
    /// In admission order: the last one is preempted first.
    pub(crate) running: Vec<u32>,
    /// Runs of the step awaiting `update` (or of the last step).
    pub(crate) runs: Vec<ScheduledRun>,
    pub(crate) pending_update: bool,
    pub(crate) stats: SchedulerStats,
    prefix_scratch: CachedPrefix,
    ngram_scratch: NgramScratch,
    /// Suffix decoding's tries (`enable_suffix`); None unless that method runs.
    pub(crate) suffix: Option<SuffixCache>,
    /// The next request's `generation`.
    next_generation: u64,
    /// A step scheduled ahead of the pending one (`schedule_ahead`), not yet pending itself.
    pub(crate) ahead: Option<AheadStep>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Scheduler {
            kv: KvCacheManager::new(
                config.num_blocks,
                config.block_size,
                config.enable_prefix_caching,
            )
            .with_sliding_window(config.sliding_window),
            config,
            requests: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            runs: Vec::new(),
            pending_update: false,
            stats: SchedulerStats::default(),
            prefix_scratch: CachedPrefix::default(),
            ngram_scratch: NgramScratch::default(),
            suffix: None,
            next_generation: 0,
            ahead: None,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }
    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }
    pub fn num_free_blocks(&self) -> usize {
        self.kv.pool.num_free()
    }
    pub fn num_total_blocks(&self) -> usize {
        self.kv.pool.num_total()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn has_unfinished_requests(&self) -> bool {
        !self.index.is_empty()
    }
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        let slot = *self.index.get(&id)?;
        self.requests[slot as usize].as_ref()
    }

    /// Appends a request to the waiting queue.
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>, stop: StopParams) -> Result<()> {
        if self.index.contains_key(&id) {
            return Err(CoreError::DuplicateRequest(id));
        }
        if prompt.is_empty() {
            return Err(CoreError::invalid("prompt_token_ids", "empty prompt"));
        }
        if prompt.len() > self.config.max_model_len {
            return Err(CoreError::invalid(
                "prompt_token_ids",
                format!(
                    "prompt of {} tokens exceeds max_model_len = {}",
                    prompt.len(),
                    self.config.max_model_len
                ),
            ));
        }
        if stop.max_tokens == 0 {
            return Err(CoreError::invalid("max_tokens", "must be >= 1"));
        }
        // Room for every token the request can ever hold: appends never reallocate.
        let mut prompt = prompt;
        let max_len = (prompt.len() + stop.max_tokens as usize).min(self.config.max_model_len);
        prompt.reserve_exact(max_len - prompt.len());
        let mut req = Request::new(id, prompt, stop);
        req.generation = self.next_generation;
        self.next_generation += 1;
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.requests[s as usize] = Some(req);
                s
            }
            None => {
                self.requests.push(Some(req));
                (self.requests.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        self.waiting.push_back(slot);
        if let Some(sc) = self.suffix.as_mut() {
            let req = self.requests[slot as usize].as_ref().expect("just added");
            sc.start(id, &req.token_ids);
        }
        Ok(())
    }

    /// Removes a request wherever it is and frees its blocks; false if unknown.
    pub fn abort_request(&mut self, id: RequestId) -> bool {
        let Some(slot) = self.index.remove(&id) else {
            return false;
        };
        let mut req = self.requests[slot as usize]
            .take()
            .expect("indexed slot is live");
        match req.status {
            RequestStatus::Waiting => self.waiting.retain(|&s| s != slot),
            RequestStatus::Running => self.running.retain(|&s| s != slot),
        }
        self.kv.free(&mut req);
        self.free_slots.push(slot);
        if let Some(sc) = self.suffix.as_mut() {
            sc.finish(id, &req.token_ids[req.num_prompt_tokens..]);
        }
        true
    }

    /// A request Python decided is done (e.g. a stop string matched): same as abort.
    pub fn finish_request(&mut self, id: RequestId) -> bool {
        self.abort_request(id)
    }

    /// Stores each request's proposal for the next step, clamped so verification
    /// never passes `max_tokens` or `max_model_len` (clamping keeps the first nodes,
    /// still a tree). `draft_parents` (one per draft, -1 = child of the root) makes a
    /// proposal a token tree; None, or a chain's parents, give chains. Requests that
    /// are unknown or not decoding (waiting, or mid-prefill) are ignored.
    pub fn set_draft_tokens(
        &mut self,
        req_ids: &[RequestId],
        cu_num_draft: &[i32],
        drafts: &[u32],
        draft_parents: Option<&[i32]>,
    ) -> Result<()> {
        if self.pending_update {
            return Err(CoreError::InvalidCallOrder(
                "set_draft_tokens() called between schedule() and update(); call it after update()",
            ));
        }
        validate_cu("cu_num_draft", cu_num_draft, req_ids.len(), drafts.len())?;
        if let Some(parents) = draft_parents {
            validate_draft_parents(parents, cu_num_draft, drafts.len())?;
        }
        for (i, id) in req_ids.iter().enumerate() {
            let Some(req) = ready_to_decode(&mut self.requests, &self.index, id) else {
                continue;
            };
            let range = cu_num_draft[i] as usize..cu_num_draft[i + 1] as usize;
            let d = &drafts[range.clone()];
            let n = d
                .len()
                .min(req.max_num_draft_tokens(self.config.max_model_len));
            req.clear_drafts();
            req.draft_token_ids.extend_from_slice(&d[..n]);
            if let Some(parents) = draft_parents {
                let p = &parents[range][..n];
                if !is_chain(p) {
                    req.draft_parents.extend_from_slice(p);
                }
            }
        }
        Ok(())
    }

    /// Overwrites the tokens of each request's stored proposal with `drafts` (at most as many
    /// as it holds; its length and tree shape stay): the engine stores a proposal whose tokens are
    /// still being drafted on the device as placeholders (`set_draft_tokens`), schedules and
    /// launches the step that verifies them (the device fills the packed inputs), and gives the
    /// tokens here once they exist — so allowed while that step is pending, before its
    /// `update()` compares a split proposal's accepted drafts. Unknown ids are ignored.
    pub fn replace_draft_tokens(
        &mut self,
        req_ids: &[RequestId],
        cu_num_draft: &[i32],
        drafts: &[u32],
    ) -> Result<()> {
        validate_cu("cu_num_draft", cu_num_draft, req_ids.len(), drafts.len())?;
        for (i, id) in req_ids.iter().enumerate() {
            let Some(&slot) = self.index.get(id) else {
                continue;
            };
            let req = self.requests[slot as usize]
                .as_mut()
                .expect("indexed slot is live");
            let d = &drafts[cu_num_draft[i] as usize..cu_num_draft[i + 1] as usize];
            let n = d.len().min(req.draft_token_ids.len());
            req.draft_token_ids[..n].copy_from_slice(&d[..n]);
        }
        Ok(())
    }

    /// Prompt-lookup proposals for each request (empty for unknown ids), as
    /// (cu_num_draft [R + 1], draft token ids).
    pub fn propose_ngram(
        &mut self,
        req_ids: &[RequestId],
        k: usize,
        min_n: usize,
        max_n: usize,
    ) -> Result<(Vec<i32>, Vec<u32>)> {
        check_ngram_sizes(min_n, max_n)?;
        let mut cu = Vec::with_capacity(req_ids.len() + 1);
        let mut out = Vec::with_capacity(req_ids.len() * k);
        cu.push(0);
        for id in req_ids {
            if let Some(req) = self
                .index
                .get(id)
                .and_then(|&s| self.requests[s as usize].as_ref())
            {
                out.extend_from_slice(propose_with(
                    &mut self.ngram_scratch,
                    &req.token_ids,
                    min_n,
                    max_n,
                    k,
                ));
            }
            cu.push(out.len() as i32);
        }
        Ok((cu, out))
    }

    /// `propose_ngram` then `set_draft_tokens` in one call, for the engine's step with nothing
    /// between them: each given request that is running, ready to decode and holds no proposal
    /// (a split proposal's kept rest stays) gets its prompt-lookup drafts, at most `k` and
    /// clipped to its budget as `set_draft_tokens` clips; unknown ids and the others are
    /// skipped. -> draft tokens set, in all.
    pub fn propose_ngram_drafts(
        &mut self,
        req_ids: &[RequestId],
        k: usize,
        min_n: usize,
        max_n: usize,
    ) -> Result<usize> {
        self.propose_ngram_drafts_with(req_ids, |_| k, min_n, max_n)
    }

    /// `propose_ngram_drafts` with a budget per request (`budgets[i]` drafts at most for
    /// `req_ids[i]`, then clipped as `set_draft_tokens` clips): a speculation policy's choice.
    pub fn propose_ngram_drafts_budgeted(
        &mut self,
        req_ids: &[RequestId],
        budgets: &[u32],
        min_n: usize,
        max_n: usize,
    ) -> Result<usize> {
        if budgets.len() != req_ids.len() {
            return Err(CoreError::invalid(
                "budgets",
                format!("{} budgets for {} requests", budgets.len(), req_ids.len()),
            ));
        }
        self.propose_ngram_drafts_with(req_ids, |i| budgets[i] as usize, min_n, max_n)
    }

    fn propose_ngram_drafts_with(
        &mut self,
        req_ids: &[RequestId],
        budget: impl Fn(usize) -> usize,
        min_n: usize,
        max_n: usize,
    ) -> Result<usize> {
        check_ngram_sizes(min_n, max_n)?;
        if self.pending_update {
            return Err(CoreError::InvalidCallOrder(
                "propose_ngram_drafts() called between schedule() and update(); call it after update()",
            ));
        }
        let max_model_len = self.config.max_model_len;
        let mut drafts: Vec<u32> = Vec::new();
        let mut total = 0;
        for (i, id) in req_ids.iter().enumerate() {
            let Some(req) = ready_to_decode(&mut self.requests, &self.index, id) else {
                continue;
            };
            if !req.draft_token_ids.is_empty() {
                continue; // a split proposal's kept rest
            }
            let n = budget(i).min(req.max_num_draft_tokens(max_model_len));
            drafts.clear();
            drafts.extend_from_slice(propose_with(
                &mut self.ngram_scratch,
                &req.token_ids,
                min_n,
                max_n,
                n,
            ));
            req.draft_parents.clear();
            req.draft_token_ids.extend_from_slice(&drafts);
            total += drafts.len();
        }
        Ok(total)
    }

    /// Turns on suffix decoding: tries of depth `max_depth` (2..=64) per request, and a global
    /// one over the outputs of the last `max_cached_requests` ended requests (0: none).
    pub fn enable_suffix(&mut self, max_depth: usize, max_cached_requests: usize) -> Result<()> {
        if !(2..=64).contains(&max_depth) {
            return Err(CoreError::invalid(
                "max_depth",
                format!("must be in 2..=64 (got {max_depth})"),
            ));
        }
        self.suffix = Some(SuffixCache::new(max_depth, max_cached_requests));
        Ok(())
    }

    pub fn suffix_cache(&self) -> Option<&SuffixCache> {
        self.suffix.as_ref()
    }

    /// Suffix-decoding proposals (speculation trees), one per request (empty for unknown
    /// ids or a zero budget): per request its tokens, parents, match length and score.
    pub fn propose_suffix(
        &mut self,
        req_ids: &[RequestId],
        budgets: &[usize],
        max_spec_factor: f64,
        min_token_prob: f64,
    ) -> Result<Vec<SuffixProposal>> {
        let Some(sc) = self.suffix.as_mut() else {
            return Err(CoreError::InvalidCallOrder(
                "propose_suffix() before enable_suffix()",
            ));
        };
        if budgets.len() != req_ids.len() {
            return Err(CoreError::invalid(
                "budgets",
                format!("{} budgets for {} requests", budgets.len(), req_ids.len()),
            ));
        }
        if max_spec_factor.is_nan()
            || max_spec_factor < 0.0
            || !(0.0..=1.0).contains(&min_token_prob)
        {
            return Err(CoreError::invalid(
                "max_spec_factor",
                "max_spec_factor must be >= 0 and min_token_prob in [0, 1]",
            ));
        }
        let mut out = Vec::with_capacity(req_ids.len());
        for (id, &b) in req_ids.iter().zip(budgets) {
            match self
                .index
                .get(id)
                .and_then(|&s| self.requests[s as usize].as_ref())
            {
                Some(req) => {
                    out.push(sc.propose(*id, &req.token_ids, b, max_spec_factor, min_token_prob))
                }
                None => out.push(SuffixProposal::default()),
            }
        }
        Ok(out)
    }

    /// Decides the next step and packs it. See the module doc for the algorithm.
    pub fn schedule(&mut self) -> Result<SchedulerOutput> {
        self.schedule_reusing(Vec::new())
    }

    /// `schedule`, writing the block table into `block_table_buf` (a buffer of an
    /// earlier step that its consumer gave back): a warm buffer of the right
    /// capacity spares the largest allocation of a step and its page faults.
    pub fn schedule_reusing(&mut self, block_table_buf: Vec<i32>) -> Result<SchedulerOutput> {
        if self.pending_update {
            return Err(CoreError::InvalidCallOrder(
                "schedule() called again before update() of the previous step",
            ));
        }
        self.stats.num_steps += 1;
        let mut runs = std::mem::take(&mut self.runs);
        runs.clear();
        let mut budget = self.config.max_num_batched_tokens;
        let mut preempted = Vec::new();
        self.schedule_running(&mut runs, &mut budget, Some(&mut preempted));
        if preempted.is_empty() {
            self.admit_waiting(&mut runs, &mut budget);
        }
        self.pending_update = !runs.is_empty();
        let out = pack(
            &runs,
            &self.requests,
            self.config.block_size,
            self.config.batch_expansion,
            preempted,
            block_table_buf,
        );
        self.runs = runs;
        Ok(out)
    }

    /// Step 1 of the module doc: runs of the running requests, FCFS, appended to `runs`.
    /// With `preempted` None a slot allocation that would need a preemption stops the
    /// loop instead (a step scheduled ahead never preempts): -> false.
    pub(crate) fn schedule_running(
        &mut self,
        runs: &mut Vec<ScheduledRun>,
        budget: &mut usize,
        mut preempted: Option<&mut Vec<RequestId>>,
    ) -> bool {
        let (max_len, lookahead) = (self.config.max_model_len, self.config.num_lookahead_tokens);
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let req = self.requests[slot as usize]
                .as_mut()
                .expect("running slot is live");
            let n = (req.num_tokens_with_spec() - req.num_computed_tokens).min(*budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let end = req.num_computed_tokens + n;
            let sampled = end >= req.num_tokens();
            let reserve = if sampled { lookahead } else { 0 };
            let num_blocks_before = req.block_ids.len() as u32;
            let mut self_preempted = false;
            loop {
                let req = self.requests[slot as usize]
                    .as_mut()
                    .expect("running slot is live");
                if self.kv.allocate_slots(req, None, n, reserve, max_len) {
                    break;
                }
                let Some(preempted) = preempted.as_deref_mut() else {
                    return false;
                };
                let victim = self.running.pop().expect("the request itself is running");
                self.preempt(victim, preempted);
                if victim == slot {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let req = self.requests[slot as usize]
                .as_mut()
                .expect("running slot is live");
            runs.push(ScheduledRun {
                slot,
                req_id: req.id,
                generation: req.generation,
                num_computed_tokens: req.num_computed_tokens as u32,
                num_scheduled_tokens: n as u32,
                num_draft_tokens: end.saturating_sub(req.num_tokens()) as u32,
                num_verified_drafts: verified_drafts(req, end, sampled),
                sampled,
                is_prefill: req.is_prefilling(),
                is_tree: req.has_draft_tree() && sampled && end > req.num_tokens(),
                num_cached_tokens: 0,
                newly_admitted: false,
                num_blocks_before,
            });
            req.num_computed_tokens += n;
            *budget -= n;
            i += 1;
        }
        true
    }

    /// Step 2 of the module doc: waiting requests, FCFS, while they fit.
    pub(crate) fn admit_waiting(&mut self, runs: &mut Vec<ScheduledRun>, budget: &mut usize) {
        let bs = self.config.block_size;
        while let Some(&slot) = self.waiting.front() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 {
                break;
            }
            let req = self.requests[slot as usize]
                .as_mut()
                .expect("waiting slot is live");
            self.kv.find_cached_prefix(req, &mut self.prefix_scratch);
            let cached = self.prefix_scratch.num_tokens(bs);
            let n = (req.num_tokens() - cached).min(*budget);
            let sampled = cached + n >= req.num_tokens();
            let reserve = if sampled {
                self.config.num_lookahead_tokens
            } else {
                0
            };
            if !self.kv.allocate_slots(
                req,
                Some(&self.prefix_scratch),
                n,
                reserve,
                self.config.max_model_len,
            ) {
                break;
            }
            self.stats.prefix_cache_queries += req.num_tokens() as u64;
            self.stats.prefix_cache_hits += cached as u64;
            self.waiting.pop_front();
            req.status = RequestStatus::Running;
            self.running.push(slot);
            runs.push(ScheduledRun {
                slot,
                req_id: req.id,
                generation: req.generation,
                num_computed_tokens: req.num_computed_tokens as u32,
                num_scheduled_tokens: n as u32,
                num_draft_tokens: 0,
                num_verified_drafts: verified_drafts(req, cached + n, sampled),
                sampled,
                is_prefill: req.is_prefilling(),
                is_tree: false, // preemption drops a tree proposal
                num_cached_tokens: cached as u32,
                newly_admitted: true,
                num_blocks_before: 0,
            });
            req.num_computed_tokens += n;
            *budget -= n;
        }
    }

    /// Recompute preemption: free the blocks, forget the KV, go to the front of the
    /// waiting queue (output so far is kept and recomputed; a chain proposal is kept
    /// and verified once the recompute reaches its end, a tree proposal is dropped:
    /// a tree run starts at its root, never inside a recompute).
    fn preempt(&mut self, slot: u32, preempted: &mut Vec<RequestId>) {
        let req = self.requests[slot as usize]
            .as_mut()
            .expect("preempted slot is live");
        self.kv.free(req);
        if req.has_draft_tree() {
            req.clear_drafts();
        }
        req.num_computed_tokens = 0;
        req.status = RequestStatus::Waiting;
        self.waiting.push_front(slot);
        self.stats.num_preemptions += 1;
        preempted.push(req.id);
    }

    /// Undoes the pending step as if `schedule()` had not run (the step is a
    /// transaction: the forward, sampling or anything between `schedule` and
    /// `update` may fail), and a step scheduled ahead of it first (`cancel_ahead`).
    /// Each scheduled request gets back its computed-token count (its proposal was
    /// never touched); blocks allocated by the step are released; requests admitted
    /// by the step return to the front of the waiting queue in their order.
    /// Preemptions done by the step stand (a preempted request is in a consistent
    /// state: it recomputes). Requests aborted or finished since `schedule` are
    /// skipped. Returns false when no step was pending.
    pub fn cancel_step(&mut self) -> bool {
        if !self.pending_update {
            return false;
        }
        self.cancel_ahead();
        self.pending_update = false;
        let runs = std::mem::take(&mut self.runs);
        self.undo_runs(&runs);
        self.runs = runs;
        self.runs.clear();
        true
    }

    /// Gives back what `runs` (the newest scheduled step's) took: see `cancel_step`.
    pub(crate) fn undo_runs(&mut self, runs: &[ScheduledRun]) {
        let mut readmit = Vec::new();
        for run in runs {
            let Some(req) = self.requests[run.slot as usize].as_mut() else {
                continue;
            };
            if req.generation != run.generation || req.status != RequestStatus::Running {
                continue; // aborted (and maybe replaced) since schedule()
            }
            if run.newly_admitted {
                self.kv.free(req);
                req.num_computed_tokens = 0;
                req.status = RequestStatus::Waiting;
                self.stats.prefix_cache_queries -= req.num_tokens() as u64;
                self.stats.prefix_cache_hits -= u64::from(run.num_cached_tokens);
                readmit.push(run.slot);
            } else {
                // Blocks the step added are fresh (never cached): release newest first.
                // (Dead placeholders all lie below `num_blocks_before`.)
                let keep = run.num_blocks_before as usize;
                debug_assert!(req.num_dead_blocks <= keep);
                for &b in req.block_ids[keep..].iter().rev() {
                    self.kv.pool.free(b);
                }
                req.block_ids.truncate(keep);
                req.num_computed_tokens = run.num_computed_tokens as usize;
            }
        }
        if !readmit.is_empty() {
            let requests = &self.requests;
            self.running.retain(|&s| {
                requests[s as usize]
                    .as_ref()
                    .is_some_and(|r| r.status == RequestStatus::Running)
            });
            for &slot in readmit.iter().rev() {
                self.waiting.push_front(slot);
            }
        }
    }
}

/// Drafts a run ending at `end` verifies: a sampled run has `1 + d` logits rows for
/// the `d` drafts inside its query, so it verifies those plus, when the budget split
/// a chain proposal, the first draft after them (the last row scores it); otherwise
/// none. A tree is never split: a budget cut keeps its first d nodes, with a bonus row.
fn verified_drafts(req: &Request, end: usize, sampled: bool) -> u32 {
    if !sampled {
        return 0;
    }
    let in_query = end.saturating_sub(req.num_tokens());
    if req.has_draft_tree() {
        return req.draft_token_ids.len().min(in_query) as u32;
    }
    req.draft_token_ids.len().min(in_query + 1) as u32
}

/// The live request `id` if it is running and ready to decode (all its tokens but the last have
/// KV): the requests a proposal may be set for.
fn ready_to_decode<'a>(
    requests: &'a mut [Option<Request>],
    index: &HashMap<RequestId, u32, FxBuildHasher>,
    id: &RequestId,
) -> Option<&'a mut Request> {
    let req = requests[*index.get(id)? as usize]
        .as_mut()
        .expect("indexed slot is live");
    (req.status == RequestStatus::Running && req.num_computed_tokens + 1 == req.num_tokens())
        .then_some(req)
}

fn check_ngram_sizes(min_n: usize, max_n: usize) -> Result<()> {
    if min_n == 0 {
        return Err(CoreError::invalid("min_n", "must be >= 1"));
    }
    if max_n < min_n {
        return Err(CoreError::invalid(
            "max_n",
            format!("max_n = {max_n} < min_n = {min_n}"),
        ));
    }
    Ok(())
}
