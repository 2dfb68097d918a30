//! Packing one step's runs into the flat arrays the forward pass consumes.
//!
//! Shapes (R = scheduled requests, S = attention query sequences, T = tokens,
//! L = logits rows, W = widest block table row in the batch). With
//! `batch_expansion`, a verification run of `1 + k` tokens becomes `1 + k`
//! single-token sequences sharing the request's block table row; otherwise S == R.
//!
//! A tree run (docs/trees.md) is the root at position c plus its m nodes: node i
//! (root = 0) has KV slot position c + i, RoPE position (`positions`) c + depth(i),
//! a logits row, and `tree_mask` bit j set for every node j it may see. `tree_mask`
//! and `tree_start` are allocated only when the batch holds a tree run.

use crate::block_pool::DEAD_BLOCK;
use crate::request::{Request, RequestId};
use crate::tree::TreeLayout;

/// One request's share of a step, decided by the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct ScheduledRun {
    pub slot: u32,
    pub req_id: RequestId,
    /// The request's `generation` when scheduled (the run is dead if it differs now).
    pub generation: u64,
    /// Context already in the KV cache before this step (after any prefix-cache hit).
    pub num_computed_tokens: u32,
    pub num_scheduled_tokens: u32,
    /// Drafts inside this run's query (0 for a prefill chunk or plain decode); the
    /// run's logits rows are `1 + num_draft_tokens` when sampled.
    pub num_draft_tokens: u32,
    /// Drafts this run verifies: `num_draft_tokens`, or one more when the budget
    /// split the proposal (then the last row scores a draft, not a bonus token).
    pub num_verified_drafts: u32,
    /// The run reaches the end of the known tokens: its logits are sampled.
    pub sampled: bool,
    /// The run is a prompt chunk (see `Request::is_prefilling`).
    pub is_prefill: bool,
    /// The run verifies a token tree: root + `num_draft_tokens` >= 1 nodes (the first
    /// ones of the request's tree proposal).
    pub is_tree: bool,
    /// Prefix-cache hit tokens found on this admission, else 0.
    pub num_cached_tokens: u32,
    /// Admitted from the waiting queue by this step (undone by `cancel_step`).
    pub newly_admitted: bool,
    /// Blocks the request held before this step allocated (undone by `cancel_step`).
    pub num_blocks_before: u32,
}

/// Everything one forward pass needs; built once per step, handed over without copies.
#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    pub req_ids: Vec<u64>,              // [R]
    pub num_scheduled_tokens: Vec<i32>, // [R]
    pub num_computed_tokens: Vec<i32>,  // [R]
    pub num_draft_tokens: Vec<i32>,     // [R] drafts verified (rows - 1, or rows when split)
    pub draft_token_ids: Vec<i64>,      // [sum num_draft_tokens] the verified drafts
    pub draft_parents: Vec<i32>,        // [sum num_draft_tokens] -1: root; chains -1, 0, 1..
    pub cu_num_logits: Vec<i32>,        // [R + 1]
    pub logits_indices: Vec<i64>,       // [L] rows of the token batch, request order
    pub input_ids: Vec<i64>,            // [T]
    pub positions: Vec<i64>,            // [T] RoPE positions
    pub slot_mapping: Vec<i64>,         // [T] block_id * block_size + pos % block_size
    pub query_start_loc: Vec<i32>,      // [S + 1]
    pub seq_lens: Vec<i32>,             // [S] KV context incl. this query
    pub tree_mask: Vec<i64>,            // [T] bit j: sees tree node j; 0: causal; [] if no tree
    pub tree_start: Vec<i32>,           // [S] root's KV position (seq_len - query_len if no tree)
    pub block_table: Vec<i32>,          // [S * W] row-major, padded with 0; dead blocks 0
    pub block_table_width: usize,       // W
    pub seq_req_indices: Vec<i32>,      // [S]
    pub preempted_req_ids: Vec<u64>,    // [P]
    pub num_cached_tokens: Vec<i32>,    // [R]
    /// A step scheduled ahead (`Scheduler::schedule_ahead`): the token indices of
    /// `input_ids` that decode from the pending step's emitted tokens (written -1), and
    /// for each the index of its token in that step's emitted tokens (one per sampled
    /// run, in run order). Empty for `schedule`.
    pub ahead_input_pos: Vec<i64>, // [A]
    pub ahead_src: Vec<i64>,            // [A]
    pub num_prefill_tokens: usize,
    pub num_prefill_requests: usize,
    pub num_verify_requests: usize,
    pub total_num_scheduled_tokens: usize,
    pub max_query_len: usize,
    pub max_seq_len: usize,
}

impl SchedulerOutput {
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }
    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }
    /// Block table row of query sequence `s`.
    pub fn block_table_row(&self, s: usize) -> &[i32] {
        let w = self.block_table_width;
        &self.block_table[s * w..(s + 1) * w]
    }
}

/// Packs the runs (in request order) into a `SchedulerOutput`. Every output vector
/// is allocated once at its exact size (the vectors then move to Python), except the
/// block table, written into `block_table` (cleared first; pass a recycled buffer).
pub fn pack(
    runs: &[ScheduledRun],
    requests: &[Option<Request>],
    block_size: usize,
    batch_expansion: bool,
    preempted: Vec<u64>,
    mut block_table: Vec<i32>,
) -> SchedulerOutput {
    let r = runs.len();
    let t: usize = runs.iter().map(|x| x.num_scheduled_tokens as usize).sum();
    let s: usize = if batch_expansion {
        runs.iter()
            .map(|x| {
                if x.num_draft_tokens > 0 {
                    1 + x.num_draft_tokens as usize
                } else {
                    1
                }
            })
            .sum()
    } else {
        r
    };
    let req = |run: &ScheduledRun| {
        requests[run.slot as usize]
            .as_ref()
            .expect("scheduled request exists")
    };
    let w = runs
        .iter()
        .map(|x| req(x).block_ids.len())
        .max()
        .unwrap_or(0);
    let num_verified: usize = runs.iter().map(|x| x.num_verified_drafts as usize).sum();
    let has_tree = runs.iter().any(|x| x.is_tree);

    let mut out = SchedulerOutput {
        req_ids: Vec::with_capacity(r),
        num_scheduled_tokens: Vec::with_capacity(r),
        num_computed_tokens: Vec::with_capacity(r),
        num_draft_tokens: Vec::with_capacity(r),
        draft_token_ids: Vec::with_capacity(num_verified),
        draft_parents: Vec::with_capacity(num_verified),
        cu_num_logits: Vec::with_capacity(r + 1),
        logits_indices: Vec::with_capacity(
            runs.iter()
                .map(|x| {
                    if x.sampled {
                        1 + x.num_draft_tokens as usize
                    } else {
                        0
                    }
                })
                .sum(),
        ),
        input_ids: Vec::with_capacity(t),
        positions: Vec::with_capacity(t),
        slot_mapping: Vec::with_capacity(t),
        query_start_loc: Vec::with_capacity(s + 1),
        seq_lens: Vec::with_capacity(s),
        block_table: {
            block_table.clear();
            block_table.reserve(s * w);
            block_table
        },
        block_table_width: w,
        seq_req_indices: Vec::with_capacity(s),
        preempted_req_ids: preempted,
        num_cached_tokens: Vec::with_capacity(r),
        tree_mask: if has_tree { vec![0; t] } else { Vec::new() },
        tree_start: if has_tree {
            Vec::with_capacity(s)
        } else {
            Vec::new()
        },
        total_num_scheduled_tokens: t,
        ..Default::default()
    };
    out.cu_num_logits.push(0);
    out.query_start_loc.push(0);
    let bs = block_size;
    let mut num_logits = 0i32;
    let mut seq = 0usize; // query sequences written so far
    for (row, run) in runs.iter().enumerate() {
        let rq = req(run);
        let start_tok = out.input_ids.len();
        let n = run.num_scheduled_tokens as usize;
        let c = run.num_computed_tokens as usize;
        out.req_ids.push(run.req_id);
        out.num_scheduled_tokens.push(n as i32);
        out.num_computed_tokens.push(c as i32);
        out.num_draft_tokens.push(run.num_verified_drafts as i32);
        out.draft_token_ids.extend(
            rq.draft_token_ids[..run.num_verified_drafts as usize]
                .iter()
                .map(|&t| t as i64),
        );
        out.num_cached_tokens.push(run.num_cached_tokens as i32);
        let v = run.num_verified_drafts as usize;
        let tree = if run.is_tree {
            debug_assert!(c + 1 == rq.num_tokens() && n == 1 + v);
            let parents = &rq.draft_parents[..v];
            out.draft_parents.extend_from_slice(parents);
            Some(TreeLayout::new(parents))
        } else {
            out.draft_parents.extend(-1..v as i32 - 1);
            None
        };
        for pos in c..c + n {
            out.input_ids.push(rq.token_with_spec(pos) as i64);
            let block = rq.block_ids[pos / bs];
            debug_assert!(block != DEAD_BLOCK, "a query token's slot is live");
            let block = block as i64;
            out.slot_mapping.push(block * bs as i64 + (pos % bs) as i64);
        }
        match &tree {
            None => out.positions.extend(c as i64..(c + n) as i64),
            Some(tl) => {
                // a tree run starts at its root: token i is tree node i
                out.positions
                    .extend(tl.depth[..n].iter().map(|&d| (c + d as usize) as i64));
                for (dst, &m) in out.tree_mask[start_tok..start_tok + n]
                    .iter_mut()
                    .zip(&tl.mask[..n])
                {
                    *dst = m as i64;
                }
            }
        }
        if run.sampled {
            let k = run.num_draft_tokens as usize;
            for i in start_tok + n - 1 - k..start_tok + n {
                out.logits_indices.push(i as i64);
            }
            num_logits += 1 + k as i32;
        }
        out.cu_num_logits.push(num_logits);
        if run.is_prefill {
            out.num_prefill_tokens += n;
            out.num_prefill_requests += 1;
        }
        if run.num_verified_drafts > 0 {
            out.num_verify_requests += 1;
        }
        out.max_query_len = out.max_query_len.max(n);
        out.max_seq_len = out.max_seq_len.max(c + n);
        let expand = batch_expansion && run.num_draft_tokens > 0;
        let num_seqs = if expand { n } else { 1 };
        for j in 0..num_seqs {
            let (q_end, seq_len) = if expand {
                (start_tok + j + 1, c + j + 1)
            } else {
                (start_tok + n, c + n)
            };
            out.query_start_loc.push(q_end as i32);
            out.seq_lens.push(seq_len as i32);
            if has_tree {
                let q_len = if expand { 1 } else { n };
                let root = if tree.is_some() { c } else { seq_len - q_len };
                out.tree_start.push(root as i32);
            }
            out.seq_req_indices.push(row as i32);
            // one write per entry: the row (a dead placeholder as block 0: it lies outside
            // every query's window, so attention never reads it), then its zero padding
            out.block_table.extend(rq.block_ids.iter().map(|&b| {
                if b == DEAD_BLOCK {
                    0
                } else {
                    b as i32
                }
            }));
            out.block_table.resize((seq + 1) * w, 0);
            seq += 1;
        }
    }
    if batch_expansion && out.num_verify_requests > 0 {
        out.max_query_len = out
            .query_start_loc
            .windows(2)
            .map(|x| (x[1] - x[0]) as usize)
            .max()
            .unwrap_or(0);
    }
    out
}
