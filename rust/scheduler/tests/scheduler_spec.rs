//! The scheduler's contract (docs/core_api.md), one behaviour per test.

use specinfer_scheduler::{CoreError, Scheduler, SchedulerConfig, StopParams};

fn config(num_blocks: usize, block_size: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        enable_prefix_caching: true,
        num_lookahead_tokens: 0,
        batch_expansion: false,
        sliding_window: None,
    }
}

fn stop(max_tokens: u32) -> StopParams {
    StopParams {
        max_tokens,
        ..Default::default()
    }
}

fn prompt(len: u32, base: u32) -> Vec<u32> {
    (0..len).map(|i| base + i).collect()
}

#[test]
fn prefill_then_decode() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(7, prompt(10, 100), stop(5)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![7]);
    assert_eq!(out.num_scheduled_tokens, vec![10]);
    assert_eq!(out.positions, (0..10).collect::<Vec<i64>>());
    assert_eq!(out.input_ids, (100..110).collect::<Vec<i64>>());
    assert_eq!(out.cu_num_logits, vec![0, 1]);
    assert_eq!(out.logits_indices, vec![9]);
    assert_eq!((out.num_prefill_tokens, out.num_prefill_requests), (10, 1));
    let row = out.block_table_row(0).to_vec();
    for (p, &slot) in out.slot_mapping.iter().enumerate() {
        assert_eq!(slot, row[p / 4] as i64 * 4 + (p % 4) as i64);
    }
    assert_eq!(out.seq_lens, vec![10]);
    let up = s.update(&[42], &[0, 1]).unwrap();
    assert_eq!((up.req_ids, up.new_token_ids), (vec![7], vec![42]));

    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![1]);
    assert_eq!(out.num_computed_tokens, vec![10]);
    assert_eq!((out.input_ids[0], out.positions[0]), (42, 10));
    assert_eq!(out.num_prefill_tokens, 0);
    s.update(&[43], &[0, 1]).unwrap();
    assert_eq!(s.request(7).unwrap().token_ids[10..], [42, 43]);
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_samples_only_the_final_chunk() {
    let mut s = Scheduler::new(config(16, 4, 4)).unwrap();
    s.add_request(1, prompt(10, 0), stop(5)).unwrap();
    let mut chunks = vec![];
    loop {
        let out = s.schedule().unwrap();
        chunks.push((
            out.num_scheduled_tokens[0],
            out.cu_num_logits[1],
            out.num_prefill_tokens,
        ));
        let sampled: Vec<u32> = if out.cu_num_logits[1] == 1 {
            vec![9]
        } else {
            vec![]
        };
        s.update(&sampled, &[0, sampled.len() as i32]).unwrap();
        if !sampled.is_empty() {
            break;
        }
    }
    assert_eq!(chunks, vec![(4, 0, 4), (4, 0, 4), (2, 1, 2)]);
}

#[test]
fn verification_rolls_back_rejected_drafts() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(5, 0), stop(20)).unwrap();
    s.schedule().unwrap();
    s.update(&[50], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1], &[0, 3], &[51, 52, 53], None)
        .unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![4]);
    assert_eq!(out.num_draft_tokens, vec![3]);
    assert_eq!(out.input_ids, vec![50, 51, 52, 53]);
    assert_eq!(out.cu_num_logits, vec![0, 4]);
    assert_eq!(out.logits_indices, vec![0, 1, 2, 3]);
    assert_eq!(out.num_verify_requests, 1);
    // 51 accepted, 52 rejected -> recovered token 60
    let up = s.update(&[51, 60], &[0, 2]).unwrap();
    assert_eq!(up.new_token_ids, vec![51, 60]);
    let r = s.request(1).unwrap();
    assert_eq!(r.num_computed_tokens, 7);
    assert_eq!(r.num_tokens(), 8);
    assert!(r.draft_token_ids.is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn budget_cut_splits_a_proposal_and_keeps_its_rest() {
    let mut s = Scheduler::new(config(16, 4, 8)).unwrap();
    s.add_request(1, prompt(5, 0), stop(20)).unwrap();
    s.add_request(2, prompt(6, 0), stop(20)).unwrap();
    s.schedule().unwrap(); // 5 + 3 tokens
    s.update(&[9], &[0, 1, 1]).unwrap();
    s.schedule().unwrap(); // 1 + 3 (rest of prompt 2)
    s.update(&[9, 9], &[0, 1, 2]).unwrap();
    s.set_draft_tokens(&[1, 2], &[0, 4, 8], &[1, 2, 3, 4, 5, 6, 7, 8], None)
        .unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![5, 3]);
    // request 2's run holds 2 drafts; its last row scores the third: 3 verified, no bonus
    assert_eq!(out.num_draft_tokens, vec![4, 3]);
    assert_eq!(out.draft_token_ids, vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(out.cu_num_logits, vec![0, 5, 8]);
    assert_eq!(s.request(2).unwrap().draft_token_ids, vec![5, 6, 7, 8]);
    // every verified draft accepted: the rest of the proposal waits for the next step
    s.update(&[1, 2, 3, 4, 10, 5, 6, 7], &[0, 5, 8]).unwrap();
    let r2 = s.request(2).unwrap();
    assert_eq!(r2.draft_token_ids, vec![8]);
    assert_eq!(r2.num_computed_tokens + 1, r2.num_tokens());
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![1, 2]);
    assert_eq!(out.num_draft_tokens, vec![0, 1]);
    assert_eq!(out.draft_token_ids, vec![8]);
    assert_eq!(&out.input_ids[1..], &[7, 8]);
    s.update(&[11, 8, 12], &[0, 1, 3]).unwrap();
    assert!(s.request(2).unwrap().draft_token_ids.is_empty());
}

#[test]
fn a_rejection_inside_a_split_proposal_drops_its_rest() {
    let mut s = Scheduler::new(config(16, 4, 4)).unwrap();
    s.add_request(1, prompt(4, 0), stop(20)).unwrap();
    s.schedule().unwrap();
    s.update(&[9], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1], &[0, 5], &[1, 2, 3, 4, 5], None)
        .unwrap();
    let out = s.schedule().unwrap(); // 1 + 3 drafts fit, the 4th is scored by the last row
    assert_eq!(out.num_draft_tokens, vec![4]);
    s.update(&[1, 2, 7], &[0, 3]).unwrap(); // third draft rejected, 7 recovered
    let r = s.request(1).unwrap();
    assert!(r.draft_token_ids.is_empty());
    assert_eq!(r.num_computed_tokens + 1, r.num_tokens());
    assert_eq!(&r.token_ids[4..], &[9, 1, 2, 7]);
}

#[test]
fn preemption_keeps_the_proposal_for_after_the_recompute() {
    let mut cfg = config(4, 4, 100);
    cfg.max_model_len = 16;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(7, 0), stop(10)).unwrap();
    s.add_request(2, prompt(7, 50), stop(10)).unwrap();
    s.schedule().unwrap();
    s.update(&[8, 9], &[0, 1, 2]).unwrap();
    s.set_draft_tokens(&[2], &[0, 1], &[33], None).unwrap();
    let out = s.schedule().unwrap(); // request 1 needs a new block: request 2 is preempted
    assert_eq!(out.preempted_req_ids, vec![2]);
    assert_eq!(s.request(2).unwrap().draft_token_ids, vec![33]);
    s.update(&[8], &[0, 1]).unwrap();
    assert!(s.abort_request(1));
    // the recompute's last row scores the kept draft
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![2]);
    assert_eq!(out.num_computed_tokens[0] + out.num_scheduled_tokens[0], 8); // a prefix hit may cover the head
    assert_eq!(
        (out.num_draft_tokens.clone(), out.draft_token_ids.clone()),
        (vec![1], vec![33])
    );
    assert_eq!(out.cu_num_logits, vec![0, 1]);
    s.update(&[33], &[0, 1]).unwrap();
    let r = s.request(2).unwrap();
    assert_eq!((r.num_computed_tokens, r.num_tokens()), (8, 9));
    assert!(r.draft_token_ids.is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn drafts_are_clamped_to_max_tokens() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(5, 0), stop(3)).unwrap();
    s.schedule().unwrap();
    s.update(&[9], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1, 99], &[0, 4, 5], &[1, 2, 3, 4, 5], None)
        .unwrap();
    assert_eq!(s.request(1).unwrap().draft_token_ids, vec![1]);
}

#[test]
fn lookahead_is_reserved_only_for_sampled_runs() {
    let mut cfg = config(32, 4, 6);
    cfg.num_lookahead_tokens = 5;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(10, 0), stop(20)).unwrap();
    s.schedule().unwrap(); // chunk of 6: not sampled, no lookahead
    assert_eq!(s.request(1).unwrap().block_ids.len(), 2);
    s.update(&[], &[0, 0]).unwrap();
    s.schedule().unwrap(); // final chunk: 10 tokens + 5 lookahead = 15 slots
    assert_eq!(s.request(1).unwrap().block_ids.len(), 4);
}

#[test]
fn preemption_recomputes_the_most_recently_admitted_request() {
    // 4 blocks of 4 slots: two prompts of 7 take all of them.
    let mut cfg = config(4, 4, 100);
    cfg.max_model_len = 16;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(7, 0), stop(10)).unwrap();
    s.add_request(2, prompt(7, 50), stop(10)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![1, 2]);
    s.update(&[8, 9], &[0, 1, 2]).unwrap();
    // decode step needs a slot at position 7: still in block 1 of each. Then position 8 needs new blocks.
    s.schedule().unwrap();
    s.update(&[8, 9], &[0, 1, 2]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![1]);
    assert_eq!(out.preempted_req_ids, vec![2]);
    assert_eq!(s.stats().num_preemptions, 1);
    let r2 = s.request(2).unwrap();
    assert_eq!(
        (
            r2.num_computed_tokens,
            r2.block_ids.len(),
            r2.num_output_tokens()
        ),
        (0, 0, 2)
    );
    s.check_invariants().unwrap();
    s.update(&[8], &[0, 1]).unwrap();
    assert!(s.abort_request(1));
    // request 2 comes back with prompt + its 2 outputs recomputed (prefix cache may cover part)
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![2]);
    assert_eq!(out.num_computed_tokens[0] + out.num_scheduled_tokens[0], 9);
    assert_eq!(out.cu_num_logits, vec![0, 1]);
    s.check_invariants().unwrap();
}

#[test]
fn stop_conditions_never_overshoot() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    let p = StopParams {
        max_tokens: 10,
        min_tokens: 2,
        eos_token_id: Some(0),
        ..Default::default()
    };
    s.add_request(1, prompt(3, 10), p).unwrap();
    s.add_request(2, prompt(3, 10), stop(2)).unwrap();
    s.schedule().unwrap();
    let up = s.update(&[0, 5], &[0, 1, 2]).unwrap(); // EOS before min_tokens is kept
    assert!(up.finished_req_ids.is_empty());
    s.set_draft_tokens(&[1, 2], &[0, 3, 4], &[0, 7, 7, 7], None)
        .unwrap();
    assert_eq!(s.request(2).unwrap().draft_token_ids.len(), 0); // 1 left: no room for drafts
    s.schedule().unwrap();
    let up = s.update(&[7, 0, 7, 7], &[0, 3, 4]).unwrap();
    assert_eq!(up.new_token_ids, vec![7, 0, 7]);
    assert_eq!(up.cu_num_new, vec![0, 2, 3]);
    assert_eq!(up.finished_req_ids, vec![1, 2]);
    let reasons: Vec<_> = up.finish_reasons.iter().map(|r| r.as_str()).collect();
    assert_eq!(reasons, vec!["stop", "length"]);
    assert_eq!(up.stop_token, vec![0, -1]);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.num_free_blocks(), 16);
    s.check_invariants().unwrap();
}

#[test]
fn shared_prefix_is_served_from_the_cache() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(10, 0), stop(1)).unwrap();
    s.schedule().unwrap();
    s.update(&[3], &[0, 1]).unwrap(); // finishes; blocks freed but stay cached
    let mut p = prompt(9, 0);
    p.push(77);
    s.add_request(2, p, stop(1)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_cached_tokens, vec![8]);
    assert_eq!(out.num_computed_tokens, vec![8]);
    assert_eq!(out.num_scheduled_tokens, vec![2]);
    let st = s.stats();
    assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (20, 8));
}

#[test]
fn batch_expansion_splits_verification_into_single_token_queries() {
    let mut cfg = config(16, 4, 100);
    cfg.batch_expansion = true;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(5, 0), stop(20)).unwrap();
    s.add_request(2, prompt(3, 0), stop(20)).unwrap();
    s.schedule().unwrap();
    s.update(&[9, 9], &[0, 1, 2]).unwrap();
    s.set_draft_tokens(&[1], &[0, 2], &[4, 4], None).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.num_scheduled_tokens, vec![3, 1]);
    assert_eq!(out.query_start_loc, vec![0, 1, 2, 3, 4]);
    assert_eq!(out.seq_lens, vec![6, 7, 8, 4]);
    assert_eq!(out.seq_req_indices, vec![0, 0, 0, 1]);
    assert_eq!(out.block_table_row(0), out.block_table_row(2));
    assert_eq!(out.max_query_len, 1);
}

#[test]
fn max_num_seqs_caps_admission() {
    let mut cfg = config(64, 4, 1000);
    cfg.max_num_seqs = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    for id in 0..4 {
        s.add_request(id, prompt(3, 0), stop(5)).unwrap();
    }
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![0, 1]);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn abort_between_schedule_and_update_is_safe() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(3, 0), stop(5)).unwrap();
    s.add_request(2, prompt(3, 0), stop(5)).unwrap();
    s.schedule().unwrap();
    assert!(s.abort_request(1));
    assert!(!s.abort_request(1));
    s.add_request(3, prompt(3, 0), stop(5)).unwrap(); // may reuse the slot
    let up = s.update(&[5, 6], &[0, 1, 2]).unwrap();
    assert_eq!(up.req_ids, vec![2]);
    s.check_invariants().unwrap();
}

#[test]
fn bad_input_names_the_field() {
    let mut cfg = config(3, 4, 100);
    let err = Scheduler::new(cfg.clone()).unwrap_err();
    assert!(err.to_string().contains("num_kv_blocks"), "{err}");
    cfg.num_blocks = 16;
    cfg.block_size = 0;
    assert!(Scheduler::new(cfg)
        .unwrap_err()
        .to_string()
        .starts_with("block_size"));
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, vec![1], stop(5)).unwrap();
    assert_eq!(
        s.add_request(1, vec![1], stop(5)),
        Err(CoreError::DuplicateRequest(1))
    );
    assert!(s
        .add_request(2, vec![], stop(5))
        .unwrap_err()
        .to_string()
        .contains("empty prompt"));
    assert!(s
        .add_request(2, prompt(65, 0), stop(5))
        .unwrap_err()
        .to_string()
        .contains("max_model_len"));
    assert!(matches!(
        s.update(&[], &[0]),
        Err(CoreError::InvalidCallOrder(_))
    ));
    s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(CoreError::InvalidCallOrder(_))));
    let err = s.update(&[1, 2], &[0, 2]).unwrap_err();
    assert!(err.to_string().starts_with("cu_num_sampled"), "{err}");
    s.update(&[1], &[0, 1]).unwrap(); // the failed update changed nothing
    assert_eq!(s.request(1).unwrap().num_output_tokens(), 1);
}

#[test]
fn empty_step_has_no_rows() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(
        (
            out.num_reqs(),
            out.query_start_loc.len(),
            out.cu_num_logits.len()
        ),
        (0, 1, 1)
    );
    assert!(s.update(&[], &[0]).is_err());
}

/// A long generation with speculation under chunked prefill: (max live blocks after the
/// prompt, blocks freed by the window), all blocks back at the end.
fn long_generation(window: Option<usize>) -> (usize, u64) {
    let mut cfg = config(80, 4, 8); // a 30-token prompt goes in 4 chunks
    cfg.max_model_len = 300;
    cfg.num_lookahead_tokens = 3;
    cfg.sliding_window = window;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(30, 100), stop(250)).unwrap();
    let mut max_live = 0;
    let mut step = 0u32;
    while s.has_unfinished_requests() {
        let out = s.schedule().unwrap();
        s.check_invariants().unwrap();
        let req = s.request(1).unwrap();
        let row = out.block_table_row(0);
        for (i, &b) in req.block_ids.iter().enumerate() {
            let want = if i < req.num_dead_blocks { 0 } else { b as i32 };
            assert_eq!(row[i], want, "dead blocks are exported as block 0");
        }
        for &slot in &out.slot_mapping {
            let block = (slot / 4) as u32;
            assert!(req.block_ids[req.num_dead_blocks..].contains(&block));
        }
        // accept drafts in a rotating pattern: 0, 1, 2 or 3 of 3
        let logits = (out.cu_num_logits[1] - out.cu_num_logits[0]) as usize;
        let emitted: Vec<u32> = if logits == 0 {
            vec![]
        } else {
            let drafts: Vec<u32> = out.draft_token_ids.iter().map(|&t| t as u32).collect();
            let accepted = (step as usize % 4).min(drafts.len());
            let mut e = drafts[..accepted].to_vec();
            e.push(7);
            e
        };
        let up = s.update(&emitted, &[0, emitted.len() as i32]).unwrap();
        step += 1;
        s.check_invariants().unwrap();
        if up.finished_req_ids.is_empty() {
            let req = s.request(1).unwrap();
            if !req.is_prefilling() {
                max_live = max_live.max(req.num_live_blocks());
            }
            s.set_draft_tokens(&[1], &[0, 3], &[5, 6, 7], None).unwrap();
        }
    }
    assert_eq!(s.num_free_blocks(), s.num_total_blocks(), "blocks leaked");
    (max_live, s.stats().num_window_freed_blocks)
}

#[test]
fn sliding_window_bounds_the_blocks_of_a_long_generation() {
    let (full, freed) = long_generation(None);
    assert_eq!(freed, 0);
    assert_eq!(
        full,
        280usize.div_ceil(4),
        "full attention keeps every block"
    );
    let (windowed, freed) = long_generation(Some(10));
    // live positions: the last W - 1 = 9 keys, the next query (1 + 3 drafts), 3 lookahead
    // slots: 16 positions, rounded out to whole blocks at both ends: at most 16 / 4 + 2
    assert!(windowed <= 6, "{windowed} blocks held");
    assert!(freed >= 60, "{freed} blocks freed by the window");
}

#[test]
fn sliding_window_frees_room_for_waiting_requests_and_abort_skips_dead_blocks() {
    let mut cfg = config(16, 4, 40);
    cfg.sliding_window = Some(8);
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, prompt(40, 100), stop(20)).unwrap();
    s.add_request(2, prompt(40, 200), stop(20)).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.req_ids, vec![1], "10 blocks each: only one fits");
    s.update(&[9], &[0, 1]).unwrap();
    // 41 tokens, 40 computed: keys below 33 are dead, i.e. blocks 0..8
    let r = s.request(1).unwrap();
    assert_eq!((r.num_dead_blocks, r.num_live_blocks()), (8, 2));
    assert_eq!(s.num_free_blocks(), 14);
    let out = s.schedule().unwrap();
    assert_eq!(
        out.req_ids,
        vec![1, 2],
        "the freed blocks admit the second request"
    );
    assert_eq!(out.num_scheduled_tokens, vec![1, 39]);
    s.update(&[9], &[0, 1, 1]).unwrap();
    // request 2: 39 computed, keys below 32 dead
    assert_eq!(s.request(2).unwrap().num_dead_blocks, 8);
    s.check_invariants().unwrap();
    assert!(s.abort_request(1));
    assert!(s.abort_request(2));
    s.check_invariants().unwrap();
    assert_eq!(s.num_free_blocks(), 16);
    assert_eq!(s.stats().num_window_freed_blocks, 16);
}

#[test]
fn sliding_window_zero_is_refused() {
    let mut cfg = config(16, 4, 48);
    cfg.sliding_window = Some(0);
    let err = Scheduler::new(cfg).unwrap_err();
    assert!(err.to_string().starts_with("sliding_window:"), "{err}");
}

#[test]
fn ngram_drafts_in_core_equal_propose_then_set() {
    // two twins: one takes propose_ngram + set_draft_tokens, the other propose_ngram_drafts
    let run = |in_core: bool| {
        let mut s = Scheduler::new(config(32, 4, 100)).unwrap();
        let p: Vec<u32> = vec![5, 6, 7, 8, 9, 5, 6, 7];
        s.add_request(1, p.clone(), stop(3)).unwrap(); // budget: 3 - 1 - 1 = 1 draft
        s.add_request(2, p.clone(), stop(20)).unwrap();
        s.add_request(3, vec![1, 2, 3], stop(20)).unwrap(); // no match: no drafts
        s.schedule().unwrap();
        s.update(&[8, 8, 4], &[0, 1, 2, 3]).unwrap();
        let ids = [1, 2, 3, 99];
        if in_core {
            assert_eq!(s.propose_ngram_drafts(&ids, 4, 1, 3).unwrap(), 1 + 4);
            // a second call keeps the proposals (each request holds one)
            assert_eq!(s.propose_ngram_drafts(&ids, 4, 1, 3).unwrap(), 0);
        } else {
            let (cu, d) = s.propose_ngram(&ids, 4, 1, 3).unwrap();
            s.set_draft_tokens(&ids, &cu, &d, None).unwrap();
        }
        let drafts: Vec<Vec<u32>> = ids[..3]
            .iter()
            .map(|&i| s.request(i).unwrap().draft_token_ids.clone())
            .collect();
        s.check_invariants().unwrap();
        drafts
    };
    let (core, twin) = (run(true), run(false));
    assert_eq!(core, twin);
    assert_eq!(core, vec![vec![9], vec![9, 5, 6, 7], vec![]]);
}

#[test]
fn ngram_drafts_in_core_refused_between_schedule_and_update() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(6, 10), stop(8)).unwrap();
    s.schedule().unwrap();
    assert!(matches!(
        s.propose_ngram_drafts(&[1], 4, 1, 3),
        Err(CoreError::InvalidCallOrder(_))
    ));
    assert!(matches!(
        s.propose_ngram_drafts(&[1], 4, 0, 3),
        Err(CoreError::InvalidArgument { .. })
    ));
}

#[test]
fn a_step_scheduled_ahead_decodes_from_the_pending_steps_tokens() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(5, 100), stop(2)).unwrap();
    s.add_request(2, prompt(3, 200), stop(1)).unwrap(); // its first token ends it by length
    let eos = StopParams {
        max_tokens: 9,
        eos_token_id: Some(0),
        ..Default::default()
    };
    s.add_request(3, prompt(4, 300), eos).unwrap();
    assert!(matches!(
        s.schedule_ahead(Vec::new()),
        Err(CoreError::InvalidCallOrder(_))
    ));
    let n = s.schedule().unwrap();
    let ahead = s
        .schedule_ahead(Vec::new())
        .unwrap()
        .expect("plain: scheduled ahead");
    assert_eq!(ahead.req_ids, vec![1, 3], "request 2 ends by length at N");
    assert_eq!(ahead.num_computed_tokens, vec![5, 4]);
    assert_eq!(ahead.positions, vec![5, 4]);
    assert_eq!(ahead.input_ids, vec![-1, -1]);
    assert_eq!(
        (ahead.ahead_input_pos, ahead.ahead_src),
        (vec![0, 1], vec![0, 2])
    );
    s.check_invariants().unwrap();
    // N emits: request 3 hits EOS, so its run in N+1 is dead
    let up = s.update(&[50, 51, 0], &n.cu_num_logits).unwrap();
    assert_eq!(up.finished_req_ids, vec![2, 3]);
    assert_eq!(s.request(1).unwrap().token_ids[5..], [50]);
    assert!(s.request(3).is_none());
    s.check_invariants().unwrap();
    // N+1 is pending: its update takes request 1's token, skips the dead run
    assert!(s.schedule().is_err());
    let up = s.update(&[60, 61], &[0, 1, 2]).unwrap();
    assert_eq!((up.req_ids, up.new_token_ids), (vec![1], vec![60]));
    assert_eq!(up.finished_req_ids, vec![1]);
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.num_free_blocks(), 16);
}

#[test]
fn nothing_is_scheduled_ahead_of_a_verification_or_where_it_would_preempt() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(4, 100), stop(8)).unwrap();
    s.schedule().unwrap();
    s.update(&[7], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1], &[0, 2], &[8, 9], None).unwrap();
    s.schedule().unwrap();
    assert!(
        s.schedule_ahead(Vec::new()).unwrap().is_none(),
        "N verifies drafts"
    );
    assert!(!s.has_ahead_step());
    // two blocks of 2, two requests: N decodes both inside their blocks; N+1 would need a
    // third block, i.e. a preemption
    let mut cfg = config(2, 2, 100);
    cfg.max_model_len = 4;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, vec![100], stop(3)).unwrap();
    s.add_request(2, vec![200], stop(3)).unwrap();
    s.schedule().unwrap();
    s.update(&[7, 8], &[0, 1, 2]).unwrap();
    let n = s.schedule().unwrap();
    assert_eq!(n.req_ids, vec![1, 2]);
    let computed: Vec<usize> = [1, 2]
        .iter()
        .map(|&id| s.request(id).unwrap().num_computed_tokens)
        .collect();
    assert!(
        s.schedule_ahead(Vec::new()).unwrap().is_none(),
        "N+1 would preempt"
    );
    assert!(!s.has_ahead_step());
    for (id, c) in [1u64, 2].into_iter().zip(computed) {
        let r = s.request(id).unwrap();
        assert_eq!(
            (r.num_computed_tokens, r.token_ids.len(), r.has_placeholder),
            (c, 2, false)
        );
    }
    assert_eq!(s.num_free_blocks(), 0);
    s.check_invariants().unwrap();
    s.update(&[9, 9], &[0, 1, 2]).unwrap();
    assert_eq!(
        s.schedule().unwrap().preempted_req_ids,
        vec![2],
        "the usual schedule preempts"
    );
}

#[test]
fn cancelling_keeps_or_undoes_the_step_ahead_as_asked() {
    let mut s = Scheduler::new(config(16, 4, 100)).unwrap();
    s.add_request(1, prompt(6, 100), stop(8)).unwrap();
    let free = s.num_free_blocks();
    s.schedule().unwrap();
    s.schedule_ahead(Vec::new()).unwrap().unwrap();
    assert!(s.cancel_ahead() && !s.cancel_ahead());
    assert_eq!(
        s.request(1).unwrap().token_ids.len(),
        6,
        "the placeholder is gone"
    );
    s.schedule_ahead(Vec::new()).unwrap().unwrap();
    assert!(s.cancel_step(), "both go");
    let r = s.request(1).unwrap();
    assert_eq!((r.token_ids.len(), r.num_computed_tokens), (6, 0));
    assert_eq!(s.num_free_blocks(), free);
    s.check_invariants().unwrap();
}
