//! A step scheduled ahead: while step N is pending (scheduled, its forward on the device,
//! not yet updated), `schedule_ahead` schedules step N+1, so the host packs and launches
//! N+1 before N's tokens exist and the device never waits for the host between them.
//!
//! Only plain steps: N verifies no drafts, N+1 holds none (a verification's length
//! depends on N's acceptance). Every run of N that samples is assumed to emit its one
//! token and go on: its request gets a placeholder token, and N+1 decodes from it (the
//! packed `input_ids` entry is `AHEAD_INPUT`; `ahead_input_pos`/`ahead_src` say which
//! of N's emitted tokens goes there, written on the device). A request whose token
//! ends it by length (`max_tokens`, `max_model_len`) is not scheduled again; one that
//! N's token ends otherwise (EOS, a stop token, an abort) leaves a dead run in N+1,
//! skipped by N+1's update (its KV write lands in blocks already freed; the device runs
//! steps in order, so a later step that reuses them writes after it). N+1 never
//! preempts: if it would have to, nothing is scheduled ahead.
//!
//! `update` of N then replaces the placeholders by the real tokens, confirms (prefix
//! caching) only what N computed, frees sliding-window blocks only below the window of N+1's
//! queries (`num_confirmed_tokens`), and promotes N+1 to the pending step. `cancel_step`
//! cancels N+1 first (`cancel_ahead`), then N.

use crate::batch::{pack, ScheduledRun, SchedulerOutput};
use crate::error::{CoreError, Result};
use crate::request::RequestStatus;
use crate::scheduler::Scheduler;

/// `input_ids` entry of a token the device fills in from the pending step's output.
pub const AHEAD_INPUT: i64 = -1;
/// The placeholder token a request holds while its next token is in flight.
pub const PLACEHOLDER_TOKEN: u32 = u32::MAX;

/// The step scheduled ahead of the pending one.
#[derive(Debug, Default, Clone)]
pub(crate) struct AheadStep {
    pub runs: Vec<ScheduledRun>,
    /// (slot, generation) of each request holding a placeholder token.
    pub placeholders: Vec<(u32, u64)>,
}

impl Scheduler {
    /// Whether a step scheduled ahead is waiting behind the pending one.
    pub fn has_ahead_step(&self) -> bool {
        self.ahead.is_some()
    }

    /// Schedules step N+1 while step N is pending (see the module doc); None when N+1
    /// cannot be scheduled ahead (N or N+1 would verify drafts, a preemption would be
    /// needed, suffix decoding's tries are on, or nothing would run): then schedule
    /// after N's update as usual. An error unless exactly one step is pending.
    pub fn schedule_ahead(&mut self, block_table_buf: Vec<i32>) -> Result<Option<SchedulerOutput>> {
        if !self.pending_update || self.ahead.is_some() {
            return Err(CoreError::InvalidCallOrder(
                "schedule_ahead() needs exactly one pending step: call it between schedule() and update()",
            ));
        }
        if self.suffix.is_some()
            || self
                .runs
                .iter()
                .any(|r| r.num_verified_drafts > 0 || r.num_draft_tokens > 0)
        {
            return Ok(None);
        }
        let max_len = self.config.max_model_len;
        let mut placeholders = Vec::new();
        let mut src_of_slot = vec![-1i64; self.requests.len()];
        let mut num_sampled = 0i64;
        for run in &self.runs {
            if !run.sampled {
                continue;
            }
            let src = num_sampled;
            num_sampled += 1;
            let Some(req) = self.requests[run.slot as usize].as_mut() else {
                continue;
            };
            if req.generation != run.generation || req.status != RequestStatus::Running {
                continue;
            }
            // the token ends the request by length: it is not scheduled again
            if req.num_output_tokens() + 1 >= req.stop.max_tokens as usize
                || req.num_tokens() + 1 >= max_len
            {
                continue;
            }
            req.token_ids.push(PLACEHOLDER_TOKEN);
            req.has_placeholder = true;
            placeholders.push((run.slot, run.generation));
            src_of_slot[run.slot as usize] = src;
        }
        let mut runs = Vec::new();
        let mut budget = self.config.max_num_batched_tokens;
        let fits = self.schedule_running(&mut runs, &mut budget, None);
        if fits {
            self.admit_waiting(&mut runs, &mut budget);
        }
        // a waiting request may hold a kept chain proposal that its recompute reaches
        let plain = runs
            .iter()
            .all(|r| r.num_draft_tokens == 0 && r.num_verified_drafts == 0);
        if !fits || !plain || runs.is_empty() {
            self.undo_runs(&runs);
            self.drop_placeholders(&placeholders);
            return Ok(None);
        }
        self.stats.num_steps += 1;
        let mut out = pack(
            &runs,
            &self.requests,
            self.config.block_size,
            self.config.batch_expansion,
            Vec::new(),
            block_table_buf,
        );
        for (r, run) in runs.iter().enumerate() {
            let req = self.requests[run.slot as usize]
                .as_mut()
                .expect("scheduled request is live");
            req.num_ahead_tokens = run.num_scheduled_tokens;
            if !req.has_placeholder {
                continue;
            }
            // the run decodes from the placeholder: [c, c + 1) with c its position
            let pos = req.num_tokens() - 1;
            debug_assert_eq!(run.num_computed_tokens as usize, pos);
            debug_assert_eq!(run.num_scheduled_tokens, 1);
            // without drafts every run is one query sequence
            let t = out.query_start_loc[r] as usize;
            out.input_ids[t] = AHEAD_INPUT;
            out.ahead_input_pos.push(t as i64);
            out.ahead_src.push(src_of_slot[run.slot as usize]);
        }
        self.ahead = Some(AheadStep { runs, placeholders });
        Ok(Some(out))
    }

    /// Undoes the step scheduled ahead (as `cancel_step` undoes a step) and removes the
    /// placeholders; N stays pending. False when there was none.
    pub fn cancel_ahead(&mut self) -> bool {
        let Some(ahead) = self.ahead.take() else {
            return false;
        };
        self.clear_ahead_tokens(&ahead.runs);
        self.undo_runs(&ahead.runs);
        self.drop_placeholders(&ahead.placeholders);
        true
    }

    /// At the end of the pending step's update: the step scheduled ahead becomes the
    /// pending one.
    pub(crate) fn promote_ahead(&mut self) {
        let Some(ahead) = self.ahead.take() else {
            return;
        };
        self.clear_ahead_tokens(&ahead.runs);
        self.runs = ahead.runs;
        self.pending_update = true;
    }

    fn clear_ahead_tokens(&mut self, runs: &[ScheduledRun]) {
        for run in runs {
            if let Some(req) = self.requests[run.slot as usize].as_mut() {
                if req.generation == run.generation {
                    req.num_ahead_tokens = 0;
                }
            }
        }
    }

    fn drop_placeholders(&mut self, placeholders: &[(u32, u64)]) {
        for &(slot, generation) in placeholders {
            if let Some(req) = self.requests[slot as usize].as_mut() {
                if req.generation == generation && req.has_placeholder {
                    req.token_ids.pop();
                    req.has_placeholder = false;
                }
            }
        }
    }
}
