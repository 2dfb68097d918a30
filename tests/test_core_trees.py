"""Token trees through specinfer._core (docs/trees.md "Rust core"): the new batch arrays
(draft_parents, tree_mask, tree_start) in both scorer modes and under token padding, errors for
bad parents, and the KV copy list of update() checked on a simulated KV cache: after the copies,
every confirmed position's slot holds the KV written for that token along the accepted path."""
from __future__ import annotations

import numpy as np
import pytest

from specinfer._core import SchedulerCore

BS = 4
TREE = np.array([1, 2, 3, 4, 5], np.int64)  # root -> {0:a, 1:b}; 0 -> {2:c, 3:d}; 1 -> {4:e}
PARENTS = np.array([-1, -1, 0, 0, 1], np.int32)
MASKS = [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]  # root, then nodes: self + ancestors + root


def owned_by_rust(a: np.ndarray) -> bool:
    base = a
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return False
        base = base.base
    return type(base).__name__ == "PySliceContainer"


def decoding_core(batch_expansion: bool = False, **kw) -> SchedulerCore:
    """Request 1 with prompt 100..105 prefilled and root token 42 emitted (6 tokens computed)."""
    args = dict(num_blocks=32, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                num_lookahead_tokens=5, batch_expansion=batch_expansion)
    args.update(kw)
    core = SchedulerCore(**args)
    core.add_request(1, np.arange(100, 106), max_tokens=20)
    core.schedule()
    core.update(np.array([42]), np.array([0, 1], np.int32))
    return core


def set_tree(core: SchedulerCore, req_id: int = 1) -> None:
    core.set_draft_tokens(np.array([req_id], np.uint64), np.array([0, 5], np.int32), TREE, PARENTS)


@pytest.mark.parametrize("batch_expansion", [False, True])
def test_tree_batch_arrays_have_their_dtypes_shapes_and_values(batch_expansion):
    core = decoding_core(batch_expansion)
    set_tree(core)
    out = core.schedule()
    for name, dtype in [("draft_parents", np.int32), ("tree_mask", np.int64), ("tree_start", np.int32)]:
        a = getattr(out, name)
        assert a.dtype == dtype and a.ndim == 1 and owned_by_rust(a), name
    assert out.input_ids.tolist() == [42, 1, 2, 3, 4, 5]
    assert out.positions.tolist() == [6, 7, 7, 8, 8, 8]  # RoPE position: root + depth
    assert out.tree_mask.tolist() == MASKS
    assert out.draft_parents.tolist() == PARENTS.tolist()
    assert out.num_draft_tokens.tolist() == [5] and out.logits_indices.tolist() == list(range(6))
    row = out.block_table[0]
    assert out.slot_mapping.tolist() == [row[p // BS] * BS + p % BS for p in range(6, 12)]  # root + i
    if batch_expansion:
        assert out.seq_lens.tolist() == [7, 8, 9, 10, 11, 12]
        assert out.tree_start.tolist() == [6] * 6
    else:
        assert out.seq_lens.tolist() == [12] and out.tree_start.tolist() == [6]
    core.check_invariants()


def test_chains_get_chain_parents_and_empty_tree_arrays():
    core = decoding_core()
    core.set_draft_tokens(np.array([1], np.uint64), np.array([0, 3], np.int32), np.array([7, 8, 9]))
    out = core.schedule()
    assert out.draft_parents.tolist() == [-1, 0, 1]
    assert out.tree_mask.shape == (0,) and out.tree_start.shape == (0,)
    assert out.tree_mask.dtype == np.int64 and out.tree_start.dtype == np.int32
    upd = core.update(np.array([7, 8, 9, 10]), np.array([0, 4], np.int32))
    assert upd.kv_copy_src.shape == (0,) and upd.kv_copy_dst.dtype == np.int64


def test_token_padding_pads_the_tree_mask_with_causal_zeros():
    core = decoding_core()
    core.set_token_padding([8, 16], null_block=32)
    set_tree(core)
    out = core.schedule()
    assert len(out.input_ids) == len(out.tree_mask) == 8
    assert out.tree_mask.tolist() == MASKS + [0, 0]
    assert out.tree_start.tolist() == [6] and out.total_num_scheduled_tokens == 6


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, -1, 0, 0, 4], "parent 4"),  # own index
        ([-1, -1, 0, 0, 9], "parent 9"),  # a later node
        ([-2, -1, 0, 0, 1], "parent -2"),
        ([-1, -1, 0, 0], "entries"),  # length
        ([-1, -1, 0, 0, 2**40], "out of range"),
    ],
)
def test_bad_parents_are_refused_naming_the_field(parents, match):
    core = decoding_core()
    with pytest.raises(ValueError, match=f"draft_parents.*{match}"):
        core.set_draft_tokens(np.array([1], np.uint64), np.array([0, 5], np.int32), TREE, np.array(parents))
    out = core.schedule()  # nothing was stored
    assert out.num_draft_tokens.tolist() == [0]


def test_a_tree_of_64_nodes_is_refused():
    core = decoding_core()
    parents = np.array([-1] + [0] * 63)
    with pytest.raises(ValueError, match="draft_parents.*63"):
        core.set_draft_tokens(np.array([1], np.uint64), np.array([0, 64], np.int32), np.full(64, 5), parents)


def test_emitted_tokens_off_the_tree_are_refused_and_the_step_stays_pending():
    core = decoding_core()
    set_tree(core)
    core.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        core.update(np.array([1, 5, 9]), np.array([0, 3], np.int32))  # e is b's child, not a's
    core.update(np.array([2, 5, 9]), np.array([0, 3], np.int32))
    core.check_invariants()


class SimulatedKv:
    """One int per KV slot: the forward writes each query token's id into its slot; the copy list
    moves them. (Tree correctness of the content itself is the Rust state machine's job.)"""

    def __init__(self, num_slots: int):
        self.kv = np.full(num_slots, -1, np.int64)

    def forward(self, out) -> None:
        t = out.total_num_scheduled_tokens
        self.kv[out.slot_mapping[:t]] = out.input_ids[:t]

    def apply(self, upd) -> None:
        for src, dst in zip(upd.kv_copy_src.tolist(), upd.kv_copy_dst.tolist()):
            assert dst < src
            self.kv[dst] = self.kv[src]


@pytest.mark.parametrize("batch_expansion", [False, True])
def test_copy_list_compacts_the_accepted_path(batch_expansion):
    core = decoding_core(batch_expansion)
    kv = SimulatedKv(32 * BS)
    set_tree(core)
    out = core.schedule()
    row = out.block_table[0]
    kv.forward(out)
    upd = core.update(np.array([2, 5, 9]), np.array([0, 3], np.int32))  # b (node 1), e (node 4), bonus
    slot = lambda p: row[p // BS] * BS + p % BS  # noqa: E731
    assert upd.kv_copy_src.tolist() == [slot(8), slot(11)]
    assert upd.kv_copy_dst.tolist() == [slot(7), slot(8)]
    kv.apply(upd)
    tokens = core.get_token_ids(1)
    assert tokens[6:].tolist() == [42, 2, 5, 9]
    assert [kv.kv[slot(p)] for p in range(6, 9)] == [42, 2, 5]  # root + accepted path, contiguous
    # the next step runs the bonus token at position 9 after the compacted path
    out = core.schedule()
    assert out.positions.tolist() == [9] and out.input_ids.tolist() == [9]
    core.check_invariants()


def test_a_block_completed_by_a_compacted_path_is_a_correct_prefix_cache_hit():
    core = decoding_core()
    kv = SimulatedKv(32 * BS)
    # the prefill's KV (decoding_core ran it without a simulated forward): positions 0..5
    set_tree(core)
    out = core.schedule()
    row = out.block_table[0]
    slot = lambda p: row[p // BS] * BS + p % BS  # noqa: E731
    kv.kv[[slot(p) for p in range(6)]] = np.arange(100, 106)
    kv.forward(out)
    upd = core.update(np.array([2, 5, 9]), np.array([0, 3], np.int32))
    kv.apply(upd)
    # positions 0..8 are confirmed: blocks 0 and 1 (positions 0..7) went to the prefix cache,
    # block 1 completed by the copied node b at position 7
    tokens = core.get_token_ids(1).tolist()
    assert core.finish_request(1)
    core.add_request(2, np.array(tokens + [7]), max_tokens=4)
    out = core.schedule()
    assert out.num_cached_tokens.tolist() == [8]
    hit = out.block_table[0][:2]
    assert [kv.kv[b * BS + o] for b in hit for o in range(BS)] == tokens[:8] == [100, 101, 102, 103, 104, 105, 42, 2]
    core.check_invariants()
