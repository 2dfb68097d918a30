//! Token trees in the core (docs/trees.md "Rust core"), one behaviour per test:
//! packing (positions, slots, masks, rows) in both scorer modes, budget cuts,
//! the accepted path and its KV copy list, bad parents, preemption, cancellation.

use specinfer_scheduler::{Scheduler, SchedulerConfig, SchedulerOutput, StopParams};

const BS: usize = 4;

fn config(budget: usize, batch_expansion: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 32,
        block_size: BS,
        max_num_seqs: 8,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        enable_prefix_caching: true,
        num_lookahead_tokens: 5,
        batch_expansion,
        sliding_window: None,
    }
}

fn stop(max_tokens: u32) -> StopParams {
    StopParams {
        max_tokens,
        ..Default::default()
    }
}

/// Request 1: prompt 100..106 prefilled, root token 42 emitted (num_computed 6,
/// 7 tokens), then the tree  root -> {0:a, 1:b}; 0 -> {2:c, 3:d}; 1 -> {4:e}.
const TREE: [u32; 5] = [1, 2, 3, 4, 5];
const PARENTS: [i32; 5] = [-1, -1, 0, 0, 1];

fn with_tree(cfg: SchedulerConfig) -> Scheduler {
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, (100..106).collect(), stop(20)).unwrap();
    loop {
        // (chunked when the budget is small)
        let out = s.schedule().unwrap();
        if out.cu_num_logits[1] == 1 {
            s.update(&[42], &[0, 1]).unwrap();
            break;
        }
        s.update(&[], &[0, 0]).unwrap();
    }
    s.set_draft_tokens(&[1], &[0, 5], &TREE, Some(&PARENTS))
        .unwrap();
    s
}

fn slot(s: &Scheduler, id: u64, pos: usize) -> i64 {
    let r = s.request(id).unwrap();
    r.block_ids[pos / BS] as i64 * BS as i64 + (pos % BS) as i64
}

fn slots(s: &Scheduler, id: u64, positions: std::ops::Range<usize>) -> Vec<i64> {
    positions.map(|p| slot(s, id, p)).collect()
}

const MASKS: [i64; 6] = [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101];

fn assert_tree_rows(out: &SchedulerOutput) {
    assert_eq!(out.input_ids, vec![42, 1, 2, 3, 4, 5]);
    assert_eq!(
        out.positions,
        vec![6, 7, 7, 8, 8, 8],
        "RoPE position = root + depth"
    );
    assert_eq!(out.tree_mask, MASKS.to_vec());
    assert_eq!(out.num_draft_tokens, vec![5]);
    assert_eq!(out.draft_token_ids, vec![1, 2, 3, 4, 5]);
    assert_eq!(out.draft_parents, PARENTS.to_vec());
    assert_eq!(
        out.cu_num_logits,
        vec![0, 6],
        "every node has a row, plus the root's"
    );
    assert_eq!(out.logits_indices, (0..6).collect::<Vec<i64>>());
}

#[test]
fn mqa_packs_a_tree_as_one_sequence_with_slot_and_rope_positions() {
    let mut s = with_tree(config(100, false));
    let out = s.schedule().unwrap();
    assert_tree_rows(&out);
    assert_eq!(
        out.slot_mapping,
        slots(&s, 1, 6..12),
        "node i at slot position root + i"
    );
    assert_eq!((out.query_start_loc, out.seq_lens), (vec![0, 6], vec![12]));
    assert_eq!(out.tree_start, vec![6]);
    assert_eq!(out.num_verify_requests, 1);
    s.check_invariants().unwrap();
}

#[test]
fn batch_expansion_gives_each_node_its_own_sequence() {
    let mut s = with_tree(config(100, true));
    let out = s.schedule().unwrap();
    assert_tree_rows(&out);
    assert_eq!(out.slot_mapping, slots(&s, 1, 6..12));
    assert_eq!(out.query_start_loc, (0..=6).collect::<Vec<i32>>());
    assert_eq!(
        out.seq_lens,
        vec![7, 8, 9, 10, 11, 12],
        "seq_len = root + i + 1"
    );
    assert_eq!(out.tree_start, vec![6; 6]);
    assert_eq!(out.seq_req_indices, vec![0; 6]);
    assert_eq!(out.max_query_len, 1);
}

#[test]
fn trees_share_a_batch_with_prefills_and_chains() {
    for expansion in [false, true] {
        let mut s = Scheduler::new(config(100, expansion)).unwrap();
        for id in [1, 2] {
            s.add_request(id, (100..106).collect(), stop(20)).unwrap();
        }
        s.schedule().unwrap();
        s.update(&[42, 43], &[0, 1, 2]).unwrap();
        s.set_draft_tokens(
            &[1, 2],
            &[0, 5, 7],
            &[1, 2, 3, 4, 5, 8, 9],
            Some(&[-1, -1, 0, 0, 1, -1, 0]),
        )
        .unwrap();
        assert!(
            s.request(2).unwrap().draft_parents.is_empty(),
            "chain parents give a chain"
        );
        s.add_request(3, (200..203).collect(), stop(20)).unwrap();
        let out = s.schedule().unwrap();
        assert_eq!(out.req_ids, vec![1, 2, 3]);
        assert_eq!(out.draft_parents, vec![-1, -1, 0, 0, 1, -1, 0]);
        assert_eq!(&out.tree_mask[..6], &MASKS);
        assert_eq!(
            &out.tree_mask[6..],
            &[0; 6],
            "chain and prefill tokens are causal"
        );
        assert_eq!(&out.positions[6..], &[6, 7, 8, 0, 1, 2]);
        if expansion {
            // tree: 6 sequences, chain: 3, prefill: 1
            assert_eq!(out.tree_start, vec![6, 6, 6, 6, 6, 6, 6, 7, 8, 0]);
            assert_eq!(out.seq_lens, vec![7, 8, 9, 10, 11, 12, 7, 8, 9, 3]);
        } else {
            assert_eq!(out.tree_start, vec![6, 6, 0]);
            assert_eq!(out.seq_lens, vec![12, 9, 3]);
        }
        assert_eq!(out.cu_num_logits, vec![0, 6, 9, 10]);
        s.check_invariants().unwrap();
    }
}

#[test]
fn chains_get_chain_parents_and_no_tree_arrays() {
    let mut s = Scheduler::new(config(100, false)).unwrap();
    s.add_request(1, (100..106).collect(), stop(20)).unwrap();
    let out = s.schedule().unwrap();
    assert!(out.tree_mask.is_empty() && out.tree_start.is_empty() && out.draft_parents.is_empty());
    s.update(&[42], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1], &[0, 3], &[7, 8, 9], None).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.draft_parents, vec![-1, 0, 1]);
    assert!(out.tree_mask.is_empty() && out.tree_start.is_empty());
    assert_eq!(out.positions, vec![6, 7, 8, 9]);
}

#[test]
fn update_compacts_the_accepted_path_with_a_copy_list() {
    for expansion in [false, true] {
        let mut s = with_tree(config(100, expansion));
        let out = s.schedule().unwrap();
        // accept b (node 1, tree index 2) then e (node 4, tree index 5), bonus 9
        let up = s.update(&[2, 5, 9], &[0, 3]).unwrap();
        assert_eq!(up.new_token_ids, vec![2, 5, 9]);
        assert_eq!(up.kv_copy_src, vec![slot(&s, 1, 8), slot(&s, 1, 11)]);
        assert_eq!(up.kv_copy_dst, vec![slot(&s, 1, 7), slot(&s, 1, 8)]);
        assert_eq!(
            up.kv_copy_src,
            vec![out.slot_mapping[2], out.slot_mapping[5]]
        );
        let r = s.request(1).unwrap();
        assert_eq!(r.num_computed_tokens, 6 + 1 + 2, "root + 1 + accepted");
        assert_eq!(r.token_ids[6..], [42, 2, 5, 9]);
        assert!(r.draft_token_ids.is_empty() && r.draft_parents.is_empty());
        s.check_invariants().unwrap();
        // the next step continues from the compacted KV
        let out = s.schedule().unwrap();
        assert_eq!(
            (out.input_ids.clone(), out.positions.clone()),
            (vec![9], vec![9])
        );
        assert!(out.tree_mask.is_empty());
    }
}

#[test]
fn a_path_along_the_first_nodes_needs_no_copies_and_a_rejection_none() {
    let mut s = with_tree(config(100, false));
    s.schedule().unwrap();
    let up = s.update(&[1, 3, 9], &[0, 3]).unwrap(); // a (index 1), c (index 3): 3 -> 2
    assert_eq!(
        (up.kv_copy_src, up.kv_copy_dst),
        (vec![slot(&s, 1, 9)], vec![slot(&s, 1, 8)])
    );
    s.set_draft_tokens(&[1], &[0, 2], &[5, 6], Some(&[-1, -1]))
        .unwrap();
    s.schedule().unwrap();
    let up = s.update(&[5, 7], &[0, 2]).unwrap(); // first child accepted: in place
    assert!(up.kv_copy_src.is_empty() && up.kv_copy_dst.is_empty());
    s.set_draft_tokens(&[1], &[0, 2], &[5, 6], Some(&[-1, -1]))
        .unwrap();
    s.schedule().unwrap();
    let up = s.update(&[7], &[0, 1]).unwrap(); // everything rejected
    assert!(up.kv_copy_src.is_empty());
    assert_eq!(s.request(1).unwrap().num_computed_tokens, 12);
    s.check_invariants().unwrap();
}

#[test]
fn duplicate_siblings_resolve_to_the_lowest_index_child() {
    let mut s = with_tree(config(100, false));
    s.set_draft_tokens(&[1], &[0, 4], &[7, 7, 8, 9], Some(&[-1, -1, 1, 0]))
        .unwrap();
    s.schedule().unwrap();
    // 7 then 9: node 0 (lowest 7) has child 9 (node 3, tree index 4)
    let up = s.update(&[7, 9, 1], &[0, 3]).unwrap();
    assert_eq!(
        (up.kv_copy_src, up.kv_copy_dst),
        (vec![slot(&s, 1, 10)], vec![slot(&s, 1, 8)])
    );
    // 7 then 8 would need node 1's child: not the lowest-index 7, so not a path
    let mut s = with_tree(config(100, false));
    s.set_draft_tokens(&[1], &[0, 4], &[7, 7, 8, 9], Some(&[-1, -1, 1, 0]))
        .unwrap();
    s.schedule().unwrap();
    let err = s.update(&[7, 8, 1], &[0, 3]).unwrap_err().to_string();
    assert!(err.starts_with("sampled_token_ids:"), "{err}");
    // the step is still pending and can be completed correctly
    s.update(&[7, 9, 1], &[0, 3]).unwrap();
    s.check_invariants().unwrap();
}

#[test]
fn a_budget_cut_keeps_the_first_nodes_with_a_bonus_row_and_drops_the_rest() {
    for expansion in [false, true] {
        let mut s = with_tree(config(4, expansion));
        let out = s.schedule().unwrap();
        assert_eq!(out.input_ids, vec![42, 1, 2, 3]);
        assert_eq!(out.positions, vec![6, 7, 7, 8]);
        assert_eq!(out.tree_mask, MASKS[..4].to_vec());
        assert_eq!(
            out.num_draft_tokens,
            vec![3],
            "3 nodes verified, never split"
        );
        assert_eq!(out.draft_parents, vec![-1, -1, 0]);
        assert_eq!(out.cu_num_logits, vec![0, 4]);
        // d (node 3) was cut: a, d is not a path of the verified tree
        let err = s.update(&[1, 4, 9], &[0, 3]).unwrap_err().to_string();
        assert!(err.starts_with("sampled_token_ids:"), "{err}");
        let up = s.update(&[1, 3, 9], &[0, 3]).unwrap();
        assert_eq!(up.kv_copy_src, vec![slot(&s, 1, 9)]);
        let r = s.request(1).unwrap();
        assert!(
            r.draft_token_ids.is_empty(),
            "the rest of a cut tree is dropped"
        );
        assert_eq!(r.num_computed_tokens, 9);
    }
    // a budget of one token: a plain decode, the whole tree dropped
    let mut s = with_tree(config(1, false));
    let out = s.schedule().unwrap();
    assert_eq!(
        (out.num_draft_tokens.clone(), out.cu_num_logits.clone()),
        (vec![0], vec![0, 1])
    );
    assert!(out.tree_mask.is_empty());
    s.update(&[9], &[0, 1]).unwrap();
    assert!(s.request(1).unwrap().draft_token_ids.is_empty());
}

#[test]
fn bad_parents_are_refused_naming_the_field_and_change_nothing() {
    let mut s = with_tree(config(100, false));
    for (parents, cu) in [
        (vec![-1, 1], vec![0, 2]),  // own index
        (vec![-1, -2], vec![0, 2]), // below -1
        (vec![-1], vec![0, 2]),     // length
    ] {
        let err = s
            .set_draft_tokens(&[1], &cu, &[5, 6], Some(&parents))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("draft_parents:"), "{err}");
    }
    let big: Vec<i32> = (0..64).map(|k| if k == 0 { -1 } else { 0 }).collect();
    let err = s
        .set_draft_tokens(&[1], &[0, 64], &[5; 64], Some(&big))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("draft_parents:") && err.contains("63"),
        "{err}"
    );
    assert_eq!(
        s.request(1).unwrap().draft_parents,
        PARENTS.to_vec(),
        "unchanged"
    );
}

#[test]
fn clamping_keeps_the_first_nodes() {
    let mut s = Scheduler::new(config(100, false)).unwrap();
    s.add_request(1, (100..106).collect(), stop(4)).unwrap();
    s.schedule().unwrap();
    s.update(&[42], &[0, 1]).unwrap();
    // 1 output token of 4: at most 2 drafts
    s.set_draft_tokens(&[1], &[0, 5], &TREE, Some(&PARENTS))
        .unwrap();
    let r = s.request(1).unwrap();
    assert_eq!(
        (r.draft_token_ids.clone(), r.draft_parents.clone()),
        (vec![1, 2], vec![-1, -1])
    );
    // a tree clamped to a chain is a chain
    s.set_draft_tokens(&[1], &[0, 3], &[1, 2, 3], Some(&[-1, 0, -1]))
        .unwrap();
    assert!(s.request(1).unwrap().draft_parents.is_empty());
}

#[test]
fn preemption_drops_a_tree_but_keeps_a_chain() {
    let cfg = SchedulerConfig {
        num_blocks: 4,
        max_model_len: 16,
        num_lookahead_tokens: 0,
        ..config(100, false)
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(1, (100..104).collect(), stop(10)).unwrap();
    s.add_request(2, (200..204).collect(), stop(10)).unwrap();
    s.schedule().unwrap();
    s.update(&[1, 2], &[0, 1, 2]).unwrap();
    // request 1's chain needs two more blocks, request 2's tree one: 2 is preempted
    s.set_draft_tokens(
        &[1, 2],
        &[0, 4, 6],
        &[5, 6, 7, 8, 9, 9],
        Some(&[-1, 0, 1, 2, -1, -1]),
    )
    .unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted_req_ids, vec![2]);
    assert!(s.request(2).unwrap().draft_token_ids.is_empty());
    s.check_invariants().unwrap();
    s.cancel_step();
    // and a preempted chain keeps its proposal (the chain request is the victim now)
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 4,
        max_model_len: 16,
        num_lookahead_tokens: 0,
        ..config(100, false)
    })
    .unwrap();
    s.add_request(1, (100..104).collect(), stop(10)).unwrap();
    s.add_request(2, (200..204).collect(), stop(10)).unwrap();
    s.schedule().unwrap();
    s.update(&[1, 2], &[0, 1, 2]).unwrap();
    s.set_draft_tokens(&[1, 2], &[0, 4, 6], &[5, 6, 7, 8, 9, 9], None)
        .unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.preempted_req_ids, vec![2]);
    assert_eq!(s.request(2).unwrap().draft_token_ids, vec![9, 9]);
}

#[test]
fn cancel_step_restores_a_tree_run_exactly() {
    for expansion in [false, true] {
        let mut s = with_tree(config(100, expansion));
        let free = s.num_free_blocks();
        let out = s.schedule().unwrap();
        assert!(s.cancel_step());
        assert_eq!(s.num_free_blocks(), free);
        let r = s.request(1).unwrap();
        assert_eq!(
            (r.num_computed_tokens, r.draft_parents.clone()),
            (6, PARENTS.to_vec())
        );
        let again = s.schedule().unwrap();
        assert_eq!(again.input_ids, out.input_ids);
        assert_eq!(again.positions, out.positions);
        assert_eq!(again.slot_mapping, out.slot_mapping);
        assert_eq!(again.tree_mask, out.tree_mask);
        assert_eq!(again.tree_start, out.tree_start);
        assert_eq!(again.seq_lens, out.seq_lens);
        s.check_invariants().unwrap();
    }
}

#[test]
fn a_stop_inside_the_path_still_compacts_the_confirmed_tokens() {
    let mut s = Scheduler::new(config(100, false)).unwrap();
    let st = StopParams {
        max_tokens: 20,
        stop_token_ids: vec![5],
        ..Default::default()
    };
    s.add_request(1, (100..106).collect(), st).unwrap();
    s.schedule().unwrap();
    s.update(&[42], &[0, 1]).unwrap();
    s.set_draft_tokens(&[1], &[0, 5], &TREE, Some(&PARENTS))
        .unwrap();
    let out = s.schedule().unwrap();
    let (s8, s11, s7) = (
        out.slot_mapping[2],
        out.slot_mapping[5],
        out.slot_mapping[1],
    );
    // b then e (= stop token 5) then a bonus: the request stops at e
    let up = s.update(&[2, 5, 9], &[0, 3]).unwrap();
    assert_eq!(up.finished_req_ids, vec![1]);
    assert_eq!(up.new_token_ids, vec![2, 5]);
    assert_eq!(
        (up.kv_copy_src, up.kv_copy_dst),
        (vec![s8, s11], vec![s7, s8])
    );
    assert_eq!(s.num_free_blocks(), s.num_total_blocks());
    s.check_invariants().unwrap();
}
