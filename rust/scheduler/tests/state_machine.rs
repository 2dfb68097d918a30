//! Property test: random sequences of add / set drafts / schedule + update (random
//! partial acceptance, random stops) / abort / finish on small pools (forcing
//! preemption) with shared prompt prefixes (hitting the prefix cache). After every
//! step the bookkeeping invariants hold; after draining, every block is free.
//! Failures are injected between schedule and update (`cancel_step`, sometimes
//! with an abort in between): every request not preempted is back where it was,
//! and when nothing was preempted the next schedule equals the cancelled one.
//! Token trees: proposals are random chains or random trees (duplicate sibling
//! tokens included), cut by the budget, dropped by preemption, restored by
//! cancellation; emitted tokens follow random paths. A simulated KV (`tree_sim`)
//! checks after every update that each confirmed position's slot holds the KV of
//! its token along the accepted path, i.e. that packing and the copy list are right.
//! Steps scheduled ahead (`schedule_ahead`, op `Ahead`): through, cancelled with or
//! without the step before, with aborts between; the simulated KV checked after each.
//! Also: the O(len) n-gram proposer equals a naive reference.

mod tree_sim;

use proptest::prelude::*;
use specinfer_scheduler::ngram::propose;
use specinfer_scheduler::{
    Scheduler, SchedulerConfig, SchedulerOutput, StopParams, AHEAD_INPUT, DEAD_BLOCK,
    PLACEHOLDER_TOKEN,
};
use tree_sim::{expected_copies, random_path, SimKv};

const VOCAB: u32 = 6;
const EOS: u32 = 0;

#[derive(Debug, Clone)]
enum Op {
    Add {
        shared: usize,
        suffix: Vec<u32>,
        max_tokens: u32,
        min_tokens: u32,
        ignore_eos: bool,
    },
    SetDrafts {
        seed: u64,
    },
    NgramDrafts {
        k: usize,
        max_n: usize,
        budgeted: bool,
    },
    Step {
        seed: u64,
    },
    FailedStep {
        abort_pick: Option<usize>,
    },
    Abort {
        pick: usize,
    },
    Finish {
        pick: usize,
    },
    /// schedule N, schedule N+1 ahead of it, then per `mode`: 0 both go through, 1 a
    /// failure cancels both, 2 N+1 alone is cancelled, 3 N goes through and N+1's forward
    /// fails (cancelled once pending); `abort_pick` aborts a request between N's update
    /// and N+1's (modes 0, 3) or before the cancel.
    Ahead {
        seed: u64,
        mode: u8,
        abort_pick: Option<usize>,
    },
    /// a proposal drafted on the device: placeholders stored, its step scheduled with
    /// them, the real tokens given while that step is pending (`launched_step`)
    Launched {
        seed: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..12, prop::collection::vec(0..VOCAB, 0..10), 1u32..8, 0u32..3, any::<bool>()).prop_map(
            |(shared, suffix, max_tokens, min_tokens, ignore_eos)| Op::Add { shared, suffix, max_tokens, min_tokens, ignore_eos }
        ),
        2 => any::<u64>().prop_map(|seed| Op::SetDrafts { seed }),
        2 => (0usize..6, 1usize..4, any::<bool>())
            .prop_map(|(k, max_n, budgeted)| Op::NgramDrafts { k, max_n, budgeted }),
        6 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        2 => prop::option::weighted(0.3, any::<usize>()).prop_map(|abort_pick| Op::FailedStep { abort_pick }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
        4 => (any::<u64>(), 0u8..4, prop::option::weighted(0.3, any::<usize>()))
            .prop_map(|(seed, mode, abort_pick)| Op::Ahead { seed, mode, abort_pick }),
        2 => any::<u64>().prop_map(|seed| Op::Launched { seed }),
    ]
}

/// Ops for the tree runs: shorter prompts, longer outputs, mostly no stop tokens
/// (requests live long enough to verify several trees).
fn op_trees() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0usize..8, prop::collection::vec(0..VOCAB, 0..6), 2u32..16, 0u32..3, prop::bool::weighted(0.7)).prop_map(
            |(shared, suffix, max_tokens, min_tokens, ignore_eos)| Op::Add { shared, suffix, max_tokens, min_tokens, ignore_eos }
        ),
        2 => any::<u64>().prop_map(|seed| Op::SetDrafts { seed }),
        8 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        2 => prop::option::weighted(0.3, any::<usize>()).prop_map(|abort_pick| Op::FailedStep { abort_pick }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        2 => (any::<u64>(), 0u8..4, prop::option::weighted(0.3, any::<usize>()))
            .prop_map(|(seed, mode, abort_pick)| Op::Ahead { seed, mode, abort_pick }),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        4usize..24,
        1usize..5,
        1usize..6,
        1usize..24,
        0usize..4,
        any::<bool>(),
        any::<bool>(),
        prop::option::of(2usize..10),
    )
        .prop_map(
            |(
                num_blocks,
                block_size,
                max_num_seqs,
                budget,
                lookahead,
                expansion,
                caching,
                window,
            )| {
                SchedulerConfig {
                    num_blocks,
                    block_size,
                    max_num_seqs,
                    max_num_batched_tokens: budget,
                    max_model_len: (num_blocks * block_size).min(24),
                    enable_prefix_caching: caching,
                    num_lookahead_tokens: lookahead,
                    batch_expansion: expansion,
                    sliding_window: window,
                }
            },
        )
}

/// xorshift64*: per-step randomness derived from the op's seed.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// Batch-level checks: caps, shapes, slot mapping == block table == request rows,
/// lookahead reserved for every sampled run.
fn check_batch(s: &Scheduler, out: &SchedulerOutput) {
    let cfg = s.config();
    let bs = cfg.block_size;
    assert!(
        out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens,
        "token budget exceeded"
    );
    assert!(
        out.num_reqs() <= cfg.max_num_seqs && s.num_running() <= cfg.max_num_seqs,
        "max_num_seqs exceeded"
    );
    assert_eq!(
        out.query_start_loc.last().copied().unwrap() as usize,
        out.input_ids.len()
    );
    assert_eq!(
        *out.cu_num_logits.last().unwrap() as usize,
        out.logits_indices.len()
    );
    for seq in 0..out.num_seqs() {
        let row = out.block_table_row(seq);
        let r = out.seq_req_indices[seq] as usize;
        let req = s
            .request(out.req_ids[r])
            .expect("scheduled request is live");
        assert_eq!(
            &row[..req.block_ids.len()],
            req.block_ids
                .iter()
                .map(|&b| if b == DEAD_BLOCK { 0 } else { b as i32 })
                .collect::<Vec<_>>(),
            "the row, dead sliding-window blocks exported as block 0"
        );
        let (q0, q1) = (
            out.query_start_loc[seq] as usize,
            out.query_start_loc[seq + 1] as usize,
        );
        let mut last_slot_pos = 0;
        for t in q0..q1 {
            // KV slot position: the position, or for a tree node root + its index
            let mask = out.tree_mask.get(t).copied().unwrap_or(0) as u64;
            let pos = if mask == 0 {
                out.positions[t] as usize
            } else {
                out.tree_start[seq] as usize + 63 - mask.leading_zeros() as usize
            };
            assert_eq!(
                out.slot_mapping[t],
                row[pos / bs] as i64 * bs as i64 + (pos % bs) as i64
            );
            if out.input_ids[t] == AHEAD_INPUT {
                // a step scheduled ahead decodes from the pending step's token
                assert_eq!(req.token_with_spec(pos), PLACEHOLDER_TOKEN);
                assert!(out.ahead_input_pos.contains(&(t as i64)));
            } else {
                assert_eq!(out.input_ids[t], req.token_with_spec(pos) as i64);
            }
            last_slot_pos = pos;
        }
        assert_eq!(out.seq_lens[seq] as usize, last_slot_pos + 1);
        if !out.tree_start.is_empty() && out.tree_mask[q0] == 0 {
            assert_eq!(out.tree_start[seq], out.seq_lens[seq] - (q1 - q0) as i32);
        }
    }
    let num_trees = (0..out.num_reqs()).filter(|&r| is_tree_run(out, r)).count();
    assert_eq!(
        out.tree_mask.is_empty(),
        num_trees == 0,
        "tree arrays exist iff a tree run does"
    );
    if num_trees > 0 {
        assert_eq!(out.tree_mask.len(), out.input_ids.len());
        assert_eq!(out.tree_start.len(), out.num_seqs());
    }
    assert_eq!(out.draft_parents.len(), out.draft_token_ids.len());
    for r in 0..out.num_reqs() {
        let req = s.request(out.req_ids[r]).unwrap();
        let end = (out.num_computed_tokens[r] + out.num_scheduled_tokens[r]) as usize;
        assert_eq!(req.num_computed_tokens, end);
        assert!(end <= req.num_tokens_with_spec());
        let logits = out.cu_num_logits[r + 1] - out.cu_num_logits[r];
        let verified = out.num_draft_tokens[r];
        let d0: i32 = out.num_draft_tokens[..r].iter().sum();
        let parents = &out.draft_parents[d0 as usize..(d0 + verified) as usize];
        if is_tree_run(out, r) {
            assert_eq!(parents, &req.draft_parents[..verified as usize]);
        } else {
            assert!(parents.iter().enumerate().all(|(k, &p)| p == k as i32 - 1));
        }
        assert_eq!(
            &out.draft_token_ids[d0 as usize..(d0 + verified) as usize],
            req.draft_token_ids[..verified as usize]
                .iter()
                .map(|&t| t as i64)
                .collect::<Vec<_>>(),
            "the verified drafts are the proposal's first ones"
        );
        if logits > 0 {
            // the sampled rows are the run's last 1 + d tokens (d drafts in the query);
            // they verify d drafts plus a bonus row, or d + 1 drafts when split
            let in_query = logits - 1;
            assert!(
                verified == in_query
                    || (verified == in_query + 1 && req.draft_token_ids.len() > in_query as usize)
            );
            if req.draft_parents.is_empty() {
                assert_eq!(
                    verified as usize,
                    req.draft_token_ids.len().min(in_query as usize + 1)
                );
            } else {
                assert_eq!(verified, in_query, "a tree is cut, never split");
                assert_eq!(is_tree_run(out, r), in_query > 0);
            }
            let seq_end = out
                .seq_req_indices
                .iter()
                .rposition(|&x| x as usize == r)
                .unwrap();
            let tok_end = out.query_start_loc[seq_end + 1] as i64;
            let rows = &out.logits_indices
                [out.cu_num_logits[r] as usize..out.cu_num_logits[r + 1] as usize];
            assert_eq!(
                rows.to_vec(),
                (tok_end - logits as i64..tok_end).collect::<Vec<_>>()
            );
            assert_eq!(
                end,
                req.num_tokens() + in_query as usize,
                "a sampled run reaches the last token and holds d drafts"
            );
            let want = (end + cfg.num_lookahead_tokens).min(cfg.max_model_len);
            assert!(req.block_ids.len() * bs >= want, "lookahead not reserved");
        } else {
            assert_eq!(verified, 0);
        }
    }
}

/// A request's drafts and parents, whether the n-gram step drafts for it, its clip and the
/// lookup's proposal.
type Before = (Vec<u32>, Vec<i32>, bool, usize, Vec<u32>);

/// The core's own n-gram step (`propose_ngram_drafts`): a request running, ready to decode
/// and without a proposal gets the lookup's drafts clipped to min(k, its budget); every other
/// request keeps what it had. `budgeted`: a policy's budget per request instead of one k
/// (`propose_ngram_drafts_budgeted`).
fn ngram_drafts(s: &mut Scheduler, live: &[u64], k: usize, max_n: usize, budgeted: bool) {
    let max_model_len = s.config().max_model_len;
    let budgets: Vec<u32> = (0..live.len()).map(|i| ((k + 3 * i) % 6) as u32).collect();
    let before: Vec<Before> = live
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let k = if budgeted { budgets[i] as usize } else { k };
            let req = s.request(id).unwrap();
            let ready = req.status == specinfer_scheduler::RequestStatus::Running
                && req.num_computed_tokens + 1 == req.num_tokens()
                && req.draft_token_ids.is_empty();
            let n = k.min(req.max_num_draft_tokens(max_model_len));
            let want = propose(&req.token_ids, 1, max_n, n).to_vec();
            (
                req.draft_token_ids.clone(),
                req.draft_parents.clone(),
                ready,
                n,
                want,
            )
        })
        .collect();
    let set = if budgeted {
        s.propose_ngram_drafts_budgeted(live, &budgets, 1, max_n)
            .unwrap()
    } else {
        s.propose_ngram_drafts(live, k, 1, max_n).unwrap()
    };
    let mut total = 0;
    for (&id, (drafts, parents, ready, n, want)) in live.iter().zip(before) {
        let req = s.request(id).unwrap();
        if ready {
            assert!(want.len() <= n);
            assert_eq!(req.draft_token_ids, want, "the lookup's drafts, clipped");
            assert!(req.draft_parents.is_empty());
            total += want.len();
        } else {
            assert_eq!(
                (&req.draft_token_ids, &req.draft_parents),
                (&drafts, &parents),
                "untouched"
            );
        }
    }
    assert_eq!(set, total);
}

/// Random proposals for every live request, the core clamps them: chains of 0..=4
/// tokens or (when `trees`) random trees of 0..=7 nodes, duplicate sibling tokens
/// included (the vocabulary is tiny).
fn set_random_drafts(s: &mut Scheduler, live: &[u64], rng: &mut Rng, trees: bool) {
    let mut cu = vec![0i32];
    let mut drafts = vec![];
    let mut parents = vec![];
    for _ in live {
        let tree = trees && rng.below(3) > 0;
        let n = rng.below(if tree { 8 } else { 5 });
        for k in 0..n {
            drafts.push(rng.below(VOCAB as u64) as u32);
            parents.push(if tree {
                rng.below(k + 1) as i32 - 1
            } else {
                k as i32 - 1
            });
        }
        cu.push(drafts.len() as i32);
    }
    let parents = (trees || rng.below(2) == 0).then_some(&parents[..]);
    s.set_draft_tokens(live, &cu, &drafts, parents).unwrap();
    let max_model_len = s.config().max_model_len;
    for (i, &id) in live.iter().enumerate() {
        let req = s.request(id).unwrap();
        assert!(req.draft_token_ids.len() <= req.max_num_draft_tokens(max_model_len));
        let n = req.draft_token_ids.len();
        let decoding = req.status == specinfer_scheduler::RequestStatus::Running
            && req.num_computed_tokens + 1 == req.num_tokens();
        if decoding {
            let given = cu[i] as usize..cu[i] as usize + n;
            assert_eq!(
                req.draft_token_ids,
                drafts[given.clone()],
                "the first nodes are kept"
            );
            match parents {
                Some(p) if !is_chain(&p[given.clone()]) => assert_eq!(req.draft_parents, p[given]),
                _ => assert!(req.draft_parents.is_empty(), "a chain is stored as a chain"),
            }
        } else {
            assert!(
                req.draft_parents.is_empty(),
                "only decoding requests hold trees"
            );
        }
    }
}

fn is_chain(p: &[i32]) -> bool {
    p.iter().enumerate().all(|(k, &x)| x == k as i32 - 1)
}

/// Whether run `r` of a batch verifies a tree (its root token carries a tree mask).
fn is_tree_run(out: &SchedulerOutput, r: usize) -> bool {
    if out.tree_mask.is_empty() {
        return false;
    }
    let seq = out
        .seq_req_indices
        .iter()
        .position(|&x| x as usize == r)
        .unwrap();
    out.tree_mask[out.query_start_loc[seq] as usize] != 0
}

/// What a request looks like to the next step.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    token_ids: Vec<u32>,
    num_computed_tokens: usize,
    draft_token_ids: Vec<u32>,
    draft_parents: Vec<i32>,
    num_blocks: usize,
    running: bool,
}

fn snapshot(s: &Scheduler, id: u64) -> Snapshot {
    let r = s.request(id).unwrap();
    Snapshot {
        token_ids: r.token_ids.clone(),
        num_computed_tokens: r.num_computed_tokens,
        draft_token_ids: r.draft_token_ids.clone(),
        draft_parents: r.draft_parents.clone(),
        num_blocks: r.block_ids.len(),
        running: r.status == specinfer_scheduler::RequestStatus::Running,
    }
}

/// The runs of the first `n` requests of a batch as the forward sees them (id,
/// context, query length, drafts), without the physical slots.
fn leading_runs(out: &SchedulerOutput, n: usize) -> Vec<(u64, i32, i32, i32)> {
    (0..n)
        .map(|r| {
            (
                out.req_ids[r],
                out.num_computed_tokens[r],
                out.num_scheduled_tokens[r],
                out.num_draft_tokens[r],
            )
        })
        .collect()
}

/// schedule, then a failure: optionally abort one request, then cancel_step.
fn failed_step(s: &mut Scheduler, live: &mut Vec<u64>, abort_pick: Option<usize>, kv: &mut SimKv) {
    let before: Vec<(u64, Snapshot)> = live.iter().map(|&id| (id, snapshot(s, id))).collect();
    let free_before = s.num_free_blocks();
    let was_running: Vec<u64> = before
        .iter()
        .filter(|(_, b)| b.running)
        .map(|(id, _)| *id)
        .collect();
    let out = s.schedule().unwrap();
    check_batch(s, &out);
    kv.forward(&out, s.config().block_size); // the failure came after the forward
    let mut aborted = None;
    if let Some(pick) = abort_pick.filter(|_| !live.is_empty()) {
        let id = live.remove(pick % live.len());
        assert!(s.abort_request(id));
        aborted = Some(id);
    }
    let pending = out.num_reqs() > 0;
    assert_eq!(s.cancel_step(), pending);
    assert!(!s.cancel_step(), "a second cancel finds nothing pending");
    s.check_invariants().unwrap();
    let preempted = &out.preempted_req_ids;
    for (id, snap) in before.into_iter().filter(|(id, _)| Some(*id) != aborted) {
        if preempted.contains(&id) {
            let r = s.request(id).unwrap();
            assert_eq!(r.num_computed_tokens, 0, "a preempted request recomputes");
            assert!(r.block_ids.is_empty());
            if snap.draft_parents.is_empty() {
                assert_eq!(
                    r.draft_token_ids, snap.draft_token_ids,
                    "preemption keeps a chain proposal"
                );
            } else {
                assert!(r.draft_token_ids.is_empty() && r.draft_parents.is_empty());
            }
        } else {
            assert_eq!(
                snapshot(s, id),
                snap,
                "request {id} not restored by cancel_step"
            );
        }
    }
    if preempted.is_empty() && aborted.is_none() {
        assert_eq!(
            s.num_free_blocks(),
            free_before,
            "cancel_step leaked or took blocks"
        );
        if pending {
            // the failed step never happened: the requests that were running get the
            // same runs again (admissions may differ: the cancelled step's allocations
            // may have evicted prefix-cache entries, which cancel does not bring back)
            let again = s.schedule().unwrap();
            check_batch(s, &again);
            for r in 0..n_running(&out, &was_running) {
                assert_eq!(is_tree_run(&again, r), is_tree_run(&out, r));
            }
            let n = out
                .req_ids
                .iter()
                .take_while(|id| was_running.contains(id))
                .count();
            assert_eq!(leading_runs(&again, n), leading_runs(&out, n));
            assert!(s.cancel_step());
            s.check_invariants().unwrap();
        }
    }
}

/// Sliding window W after an update: every block wholly below `num_computed - W + 1`
/// was given back (and none above), so a request holds at most about
/// (W + drafts + lookahead) / block_size + 2 blocks whatever its length.
fn check_window(s: &Scheduler, id: u64) {
    check_window_pending(s, id, 0);
}

/// `check_window` for a request with `pending` tokens of a scheduled step not yet updated (the
/// step scheduled ahead, promoted by the update before it): frees stop below the window of its
/// first unconfirmed position.
fn check_window_pending(s: &Scheduler, id: u64, pending: usize) {
    let cfg = s.config();
    let req = s.request(id).unwrap();
    let Some(w) = cfg.sliding_window else {
        assert_eq!(req.num_dead_blocks, 0);
        return;
    };
    let bs = cfg.block_size;
    let dead =
        ((req.num_computed_tokens - pending + 1).saturating_sub(w) / bs).min(req.block_ids.len());
    assert_eq!(
        req.num_dead_blocks, dead,
        "request {id}: dead blocks not (only) freed"
    );
    const MAX_DRAFTS: usize = 7;
    assert!(
        req.num_live_blocks() * bs <= w + MAX_DRAFTS + cfg.num_lookahead_tokens + 2 * bs,
        "request {id} holds {} blocks of {bs} under window {w}",
        req.num_live_blocks()
    );
}

fn n_running(out: &SchedulerOutput, was_running: &[u64]) -> usize {
    out.req_ids
        .iter()
        .take_while(|id| was_running.contains(id))
        .count()
}

/// The rest of a step once `out` is scheduled and its forward ran: random emitted tokens
/// (partial acceptance, tree paths, random stops), update and its checks, then usually
/// random drafts for the next step.
fn complete_step(
    s: &mut Scheduler,
    out: &SchedulerOutput,
    live: &mut Vec<u64>,
    rng: &mut Rng,
    all_accept: bool,
    kv: &mut SimKv,
    trees: bool,
) {
    let bs = s.config().block_size;
    let out = out.clone();
    let mut tokens = vec![];
    let mut cu = vec![0i32];
    let mut expect_kept = vec![];
    let mut tree_paths = vec![]; // (request, root, path)
    for r in 0..out.num_reqs() {
        let rows = (out.cu_num_logits[r + 1] - out.cu_num_logits[r]) as u64;
        let verified = out.num_draft_tokens[r] as usize;
        let d0 = out.num_draft_tokens[..r].iter().sum::<i32>() as usize;
        let drafts = &out.draft_token_ids[d0..d0 + verified];
        if rows == 0 {
        } else if all_accept {
            tokens.push(3);
        } else if is_tree_run(&out, r) {
            let parents = &out.draft_parents[d0..d0 + verified];
            let path = random_path(drafts, parents, |n| rng.below(n));
            tokens.extend(path.iter().map(|&k| drafts[k] as u32));
            tokens.push(rng.below(VOCAB as u64) as u32);
            tree_paths.push((r, path));
        } else {
            // accept a random prefix of the verified drafts, then a recovered or
            // bonus token unless every draft of a split proposal was accepted
            let accepted = rng.below(verified as u64 + 1) as usize;
            tokens.extend(drafts[..accepted].iter().map(|&t| t as u32));
            let split = verified as u64 == rows;
            if accepted < verified || !split {
                tokens.push(rng.below(VOCAB as u64) as u32);
            } else {
                let req = s.request(out.req_ids[r]).unwrap();
                expect_kept.push((out.req_ids[r], req.draft_token_ids[verified..].to_vec()));
            }
        }
        cu.push(tokens.len() as i32);
    }
    let up = s.update(&tokens, &cu).unwrap();
    // the copy list: exactly the accepted paths' moves, in the requests' blocks
    let mut want = vec![];
    for (r, path) in tree_paths {
        let m = up
            .req_ids
            .iter()
            .position(|&id| id == out.req_ids[r])
            .unwrap();
        let num_new = (up.cu_num_new[m + 1] - up.cu_num_new[m]) as usize;
        let seq = out
            .seq_req_indices
            .iter()
            .position(|&x| x as usize == r)
            .unwrap();
        let row = out.block_table_row(seq);
        let slot = |p: usize| row[p / bs] as i64 * bs as i64 + (p % bs) as i64;
        let root = out.num_computed_tokens[r] as usize;
        for (src, dst) in expected_copies(root, &path, num_new) {
            assert!(dst < src);
            want.push((slot(src), slot(dst)));
        }
    }
    let got: Vec<(i64, i64)> = up
        .kv_copy_src
        .iter()
        .copied()
        .zip(up.kv_copy_dst.iter().copied())
        .collect();
    assert_eq!(got, want, "copy list");
    // one gather then one scatter equals applying the pairs in order (the engine
    // relies on it): distinct dsts, and no src was written by an earlier pair
    let mut written = std::collections::HashSet::new();
    for (src, dst) in up.kv_copy_src.iter().zip(&up.kv_copy_dst) {
        assert!(
            !written.contains(src),
            "a copy reads a slot an earlier copy wrote"
        );
        assert!(written.insert(*dst), "duplicate copy destination");
    }
    kv.apply_copies(&up);
    live.retain(|id| !up.finished_req_ids.contains(id));
    kv.check(s, live);
    for (id, rest) in expect_kept {
        if let Some(req) = s.request(id) {
            assert_eq!(
                req.draft_token_ids, rest,
                "a fully accepted split keeps the rest"
            );
        }
    }
    if !all_accept && rng.below(3) > 0 {
        set_random_drafts(s, live, rng, trees); // usually speculate on the next step
    }
    for &id in live.iter() {
        let req = s.request(id).unwrap();
        assert!(
            req.num_computed_tokens < req.num_tokens(),
            "computed must trail tokens after update"
        );
        check_window(s, id);
    }
}

/// A proposal drafted on the device (`Op::Launched`; the engine's draft model): the core
/// stores placeholders of its shape, the step that verifies it is scheduled and packed with
/// them, the real tokens replace them while that step is pending (`replace_draft_tokens`),
/// and the device's fill of the packed inputs and draft ids is simulated; the step then
/// completes as any other (the simulated KV holds every confirmed token, a fully accepted
/// split keeps the real rest).
fn launched_step(
    s: &mut Scheduler,
    live: &mut Vec<u64>,
    rng: &mut Rng,
    kv: &mut SimKv,
    trees: bool,
) {
    let mut cu = vec![0i32];
    let mut real = vec![];
    for _ in live.iter() {
        for _ in 0..rng.below(5) {
            real.push(rng.below(VOCAB as u64) as u32);
        }
        cu.push(real.len() as i32);
    }
    s.set_draft_tokens(live, &cu, &vec![0; real.len()], None)
        .unwrap();
    // the engine's proposal holds only requests ready to decode (the others keep what they had)
    let mut ids = vec![];
    let mut pcu = vec![0i32];
    let mut given = vec![];
    for (i, &id) in live.iter().enumerate() {
        let req = s.request(id).unwrap();
        if req.status == specinfer_scheduler::RequestStatus::Running
            && req.num_computed_tokens + 1 == req.num_tokens()
        {
            ids.push(id);
            given.extend_from_slice(&real[cu[i] as usize..cu[i + 1] as usize]);
            pcu.push(given.len() as i32);
        }
    }
    let mut out = s.schedule().unwrap();
    check_batch(s, &out);
    s.check_invariants().unwrap();
    s.replace_draft_tokens(&ids, &pcu, &given).unwrap();
    for (j, &id) in ids.iter().enumerate() {
        if let Some(req) = s.request(id) {
            let mine = &given[pcu[j] as usize..pcu[j + 1] as usize];
            assert_eq!(
                req.draft_token_ids,
                mine[..req.draft_token_ids.len()],
                "request {id}: a placeholder was left"
            );
        }
    }
    let (mut d0, mut t0) = (0usize, 0usize);
    for r in 0..out.num_reqs() {
        let v = out.num_draft_tokens[r] as usize;
        let n = out.num_scheduled_tokens[r] as usize;
        // (a run whose request holds an older proposal has its real drafts already)
        if let Some(j) = ids
            .iter()
            .position(|&id| id == out.req_ids[r])
            .filter(|_| v > 0)
        {
            // the query holds n - 1 drafts after the last token; a split's last row verifies one more
            let src = &given[pcu[j] as usize..pcu[j + 1] as usize];
            assert!(n - 1 <= v && v <= src.len());
            for j in 0..v {
                out.draft_token_ids[d0 + j] = i64::from(src[j]);
            }
            for j in 0..n - 1 {
                out.input_ids[t0 + 1 + j] = i64::from(src[j]);
            }
        }
        d0 += v;
        t0 += n;
    }
    kv.forward(&out, s.config().block_size);
    if out.num_reqs() == 0 {
        assert_eq!(s.num_running(), 0);
        return;
    }
    complete_step(s, &out, live, rng, false, kv, trees);
}

/// Step N, and N+1 scheduled ahead of it (`Op::Ahead`). N+1 must decode exactly the
/// requests N sampled that its token does not end by length (from placeholders, whose
/// packed inputs the device fills from N's tokens), continue prompt chunks, never
/// preempt, and hold no drafts; cancelling it (alone or with N) restores every request;
/// going through, the simulated KV holds every confirmed position's token.
fn ahead_step(
    s: &mut Scheduler,
    live: &mut Vec<u64>,
    rng: &mut Rng,
    mode: u8,
    abort_pick: Option<usize>,
    kv: &mut SimKv,
    trees: bool,
) {
    let bs = s.config().block_size;
    let max_len = s.config().max_model_len;
    let before: Vec<(u64, Snapshot)> = live.iter().map(|&id| (id, snapshot(s, id))).collect();
    let out = s.schedule().unwrap();
    check_batch(s, &out);
    kv.forward(&out, bs);
    if out.num_reqs() == 0 {
        return;
    }
    let scheduled: Vec<(u64, Snapshot)> = live.iter().map(|&id| (id, snapshot(s, id))).collect();
    let free_scheduled = s.num_free_blocks();
    let Some(mut ahead) = s.schedule_ahead(Vec::new()).unwrap() else {
        assert!(!s.has_ahead_step());
        s.check_invariants().unwrap();
        assert_eq!(
            scheduled,
            live.iter()
                .map(|&id| (id, snapshot(s, id)))
                .collect::<Vec<_>>(),
            "a refused schedule_ahead changes nothing"
        );
        assert_eq!(s.num_free_blocks(), free_scheduled);
        complete_step(s, &out, live, rng, false, kv, trees);
        return;
    };
    assert!(s.has_ahead_step());
    assert!(
        s.schedule_ahead(Vec::new()).is_err(),
        "one step ahead at most"
    );
    assert!(
        s.set_draft_tokens(&[], &[0], &[], None).is_err(),
        "no proposal while steps are pending"
    );
    s.check_invariants().unwrap();
    check_batch(s, &ahead);
    assert!(
        ahead.preempted_req_ids.is_empty(),
        "a step ahead never preempts"
    );
    assert!(ahead.num_draft_tokens.iter().all(|&d| d == 0));
    assert!(out.num_draft_tokens.iter().all(|&d| d == 0));
    // which of N's runs sample, in order: their index is the emitted token's
    let sampled: Vec<usize> = (0..out.num_reqs())
        .filter(|&r| out.cu_num_logits[r + 1] > out.cu_num_logits[r])
        .collect();
    for (&pos, &src) in ahead.ahead_input_pos.iter().zip(&ahead.ahead_src) {
        let id = out.req_ids[sampled[src as usize]];
        let seq = (0..ahead.num_seqs())
            .find(|&q| ahead.query_start_loc[q] as i64 == pos)
            .expect("a placeholder opens its run's query");
        assert_eq!(ahead.req_ids[ahead.seq_req_indices[seq] as usize], id);
    }
    for &r in &sampled {
        let id = out.req_ids[r];
        let req = s.request(id).unwrap();
        let ends_by_length =
            req.num_output_tokens() >= req.stop.max_tokens as usize || req.num_tokens() >= max_len;
        if req.has_placeholder {
            assert!(!ends_by_length);
        }
        if ahead.req_ids.contains(&id) {
            assert!(
                req.has_placeholder,
                "N+1 decodes a sampled request from its placeholder"
            );
        }
    }
    match mode {
        1 | 2 => {
            let mut aborted = None;
            if let Some(pick) = abort_pick.filter(|_| !live.is_empty()) {
                let id = live.remove(pick % live.len());
                assert!(s.abort_request(id));
                aborted = Some(id);
            }
            let restored = if mode == 1 {
                assert!(s.cancel_step());
                assert!(!s.has_ahead_step() && !s.cancel_step());
                &before
            } else {
                assert!(s.cancel_ahead());
                assert!(!s.cancel_ahead());
                &scheduled
            };
            s.check_invariants().unwrap();
            for (id, snap) in restored.iter().filter(|(id, _)| Some(*id) != aborted) {
                if mode == 1 && out.preempted_req_ids.contains(id) {
                    continue; // N's preemptions stand
                }
                assert_eq!(&snapshot(s, *id), snap, "request {id} not restored");
            }
            if mode == 2 {
                if aborted.is_none() {
                    assert_eq!(
                        s.num_free_blocks(),
                        free_scheduled,
                        "cancel_ahead leaked or took blocks"
                    );
                }
                complete_step(s, &out, live, rng, false, kv, trees);
            }
            return;
        }
        _ => {}
    }
    // N's tokens: one per sampled run (random: EOS and stop tokens end some requests)
    let tokens: Vec<u32> = sampled
        .iter()
        .map(|_| rng.below(VOCAB as u64) as u32)
        .collect();
    let mut cu = vec![0i32];
    let mut n = 0;
    for r in 0..out.num_reqs() {
        n += i32::from(out.cu_num_logits[r + 1] > out.cu_num_logits[r]);
        cu.push(n);
    }
    // the device: N+1's forward reads N's tokens, and runs before anything after it
    for (&pos, &src) in ahead.ahead_input_pos.iter().zip(&ahead.ahead_src) {
        ahead.input_ids[pos as usize] = tokens[src as usize] as i64;
    }
    if mode != 3 {
        kv.forward(&ahead, bs);
    }
    let up = s.update(&tokens, &cu).unwrap();
    assert!(up.kv_copy_src.is_empty());
    live.retain(|id| !up.finished_req_ids.contains(id));
    s.check_invariants().unwrap();
    if mode != 3 {
        kv.check(s, live); // (N+1's positions count as computed once it is the pending step)
    }
    for &id in live.iter().filter(|id| out.req_ids.contains(id)) {
        // N's requests: freed below the window of the first unconfirmed position (N+1's query)
        let pending = ahead
            .req_ids
            .iter()
            .position(|&x| x == id)
            .map_or(0, |r| ahead.num_scheduled_tokens[r] as usize);
        check_window_pending(s, id, pending);
    }
    for (r, &t) in sampled.iter().zip(&tokens) {
        let id = out.req_ids[*r];
        if let Some(req) = s.request(id) {
            assert!(!req.has_placeholder);
            let want = scheduled
                .iter()
                .find(|(i, _)| *i == id)
                .unwrap()
                .1
                .token_ids
                .len();
            assert_eq!(
                req.token_ids.len(),
                want + 1,
                "request {id}: N's token appended once"
            );
            assert_eq!(*req.token_ids.last().unwrap(), t);
        }
    }
    if let Some(pick) = abort_pick.filter(|_| !live.is_empty()) {
        let id = live.remove(pick % live.len());
        assert!(s.abort_request(id));
        s.check_invariants().unwrap();
    }
    if mode == 3 {
        // N+1's forward failed: cancelled, its KV never written; nothing N confirmed
        // (prefix-cached) may count on it
        assert!(s.cancel_step());
        s.check_invariants().unwrap();
        kv.check(s, live);
        return;
    }
    // N+1 is the pending step now: its dead runs (requests N ended, or aborted) are skipped
    complete_step(s, &ahead, live, rng, false, kv, trees);
}

fn run(cfg: SchedulerConfig, ops: Vec<Op>, trees: bool) {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut kv = SimKv::default();
    let mut live: Vec<u64> = vec![];
    let mut next_id = 0u64;
    let shared_prefix: Vec<u32> = [1, 2, 3, 4].repeat(3);
    let step = |s: &mut Scheduler,
                live: &mut Vec<u64>,
                rng: &mut Rng,
                all_accept: bool,
                kv: &mut SimKv| {
        let out = s.schedule().unwrap();
        check_batch(s, &out);
        s.check_invariants().unwrap();
        let bs = s.config().block_size;
        kv.forward(&out, bs);
        if out.num_reqs() == 0 {
            assert_eq!(s.num_running(), 0);
            return;
        }
        complete_step(s, &out, live, rng, all_accept, kv, trees);
    };
    for op in ops {
        match op {
            Op::Add {
                shared,
                suffix,
                max_tokens,
                min_tokens,
                ignore_eos,
            } => {
                let mut prompt = shared_prefix[..shared].to_vec();
                prompt.extend(suffix);
                prompt.truncate(cfg.max_model_len);
                if prompt.is_empty() {
                    prompt.push(5);
                }
                let stop = StopParams {
                    max_tokens,
                    min_tokens,
                    eos_token_id: Some(EOS),
                    ignore_eos,
                    // tree runs: an ignore_eos request runs to its length
                    stop_token_ids: if trees && ignore_eos {
                        vec![]
                    } else {
                        vec![VOCAB - 1]
                    },
                };
                s.add_request(next_id, prompt, stop).unwrap();
                live.push(next_id);
                next_id += 1;
            }
            Op::SetDrafts { seed } => set_random_drafts(&mut s, &live, &mut Rng(seed | 1), trees),
            Op::NgramDrafts { k, max_n, budgeted } => {
                ngram_drafts(&mut s, &live, k, max_n, budgeted)
            }
            Op::Step { seed } => step(&mut s, &mut live, &mut Rng(seed | 1), false, &mut kv),
            Op::FailedStep { abort_pick } => {
                failed_step(&mut s, &mut live, abort_pick, &mut kv);
                kv.check(&s, &live);
            }
            Op::Ahead {
                seed,
                mode,
                abort_pick,
            } => ahead_step(
                &mut s,
                &mut live,
                &mut Rng(seed | 1),
                mode,
                abort_pick,
                &mut kv,
                trees,
            ),
            Op::Launched { seed } => {
                launched_step(&mut s, &mut live, &mut Rng(seed | 1), &mut kv, trees)
            }
            Op::Abort { pick } | Op::Finish { pick } if !live.is_empty() => {
                let id = live.remove(pick % live.len());
                assert!(s.abort_request(id));
            }
            Op::Abort { .. } | Op::Finish { .. } => assert!(!s.finish_request(12345)),
        }
        s.check_invariants().unwrap();
        assert_eq!(s.num_waiting() + s.num_running(), live.len());
    }
    // Drain: no drafts, one token per sampled run; max_tokens is small so all finish.
    let mut rng = Rng(7);
    for _ in 0..10_000 {
        if !s.has_unfinished_requests() {
            break;
        }
        step(&mut s, &mut live, &mut rng, true, &mut kv);
    }
    assert!(!s.has_unfinished_requests(), "requests starved");
    assert_eq!(s.num_free_blocks(), s.num_total_blocks(), "blocks leaked");
    s.check_invariants().unwrap();
}

fn naive_ngram(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (min_n.max(1)..=max_n).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        for s in (0..len - n).rev() {
            if &tokens[s..s + n] == suffix {
                return tokens[s + n..(s + n + k).min(len)].to_vec();
            }
        }
    }
    vec![]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn bookkeeping_survives_any_op_sequence(cfg in config(), ops in prop::collection::vec(op(), 1..80)) {
        run(cfg, ops, false);
    }


    #[test]
    fn ngram_matches_naive_reference(
        tokens in prop::collection::vec(0u32..4, 0..200),
        min_n in 1usize..4,
        extra in 0usize..4,
        k in 0usize..6,
    ) {
        let max_n = min_n + extra;
        prop_assert_eq!(propose(&tokens, min_n, max_n, k).to_vec(), naive_ngram(&tokens, min_n, max_n, k));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn token_trees_keep_bookkeeping_and_kv_right(cfg in config(), ops in prop::collection::vec(op_trees(), 1..100)) {
        run(cfg, ops, true);
    }
}
