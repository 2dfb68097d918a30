"""specinfer._core through Python: dtypes/shapes without copies, a whole request
life cycle, a hypothesis state machine over the public API, and error messages
that name the offending field. The contract is docs/core_api.md."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from specinfer._core import SchedulerCore, SchedulerOutput, UpdateOutput

ARRAY_FIELDS = {
    # name: (dtype, ndim)
    "req_ids": (np.uint64, 1),
    "num_scheduled_tokens": (np.int32, 1),
    "num_computed_tokens": (np.int32, 1),
    "num_draft_tokens": (np.int32, 1),
    "cu_num_logits": (np.int32, 1),
    "logits_indices": (np.int64, 1),
    "input_ids": (np.int64, 1),
    "positions": (np.int64, 1),
    "slot_mapping": (np.int64, 1),
    "query_start_loc": (np.int32, 1),
    "seq_lens": (np.int32, 1),
    "block_table": (np.int32, 2),
    "seq_req_indices": (np.int32, 1),
    "preempted_req_ids": (np.uint64, 1),
    "num_cached_tokens": (np.int32, 1),
}


def make_core(**kw) -> SchedulerCore:
    args = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    args.update(kw)
    return SchedulerCore(**args)


def owned_by_rust(a: np.ndarray) -> bool:
    """The array's memory belongs to a Rust Vec handed over without copying."""
    base = a
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return False
        base = base.base
    # numpy crate's owner of a moved Vec, or the core's recycled block-table buffer
    return type(base).__name__ in ("PySliceContainer", "RecycledBuffer")


def check_batch(out: SchedulerOutput, block_size: int) -> None:
    """Shape relations of one batch, and slot mapping == block table lookup."""
    r, s, t = len(out.req_ids), len(out.seq_lens), len(out.input_ids)
    assert len(out.cu_num_logits) == r + 1 and len(out.query_start_loc) == s + 1
    assert out.query_start_loc[-1] == t == out.num_scheduled_tokens.sum() == out.total_num_scheduled_tokens
    assert len(out.logits_indices) == out.cu_num_logits[-1]
    assert out.block_table.shape[0] == s
    q = out.query_start_loc
    for seq in range(s):
        row = out.block_table[seq]
        for tok in range(q[seq], q[seq + 1]):
            pos = out.positions[tok]
            assert out.slot_mapping[tok] == row[pos // block_size] * block_size + pos % block_size
        assert out.seq_lens[seq] == out.positions[q[seq + 1] - 1] + 1


def test_every_field_is_a_zero_copy_array_of_the_contract_dtype():
    core = make_core(num_lookahead_tokens=2)
    core.add_request(1, np.arange(10, dtype=np.int64), max_tokens=4)
    core.add_request(2, [5, 6, 7], max_tokens=4)
    out = core.schedule()
    assert isinstance(out, SchedulerOutput) and len(out) == 2
    for name, (dtype, ndim) in ARRAY_FIELDS.items():
        a = getattr(out, name)
        assert isinstance(a, np.ndarray), name
        assert a.dtype == dtype and a.ndim == ndim, (name, a.dtype, a.ndim)
        if a.size:
            assert owned_by_rust(a), f"{name} was copied"
    assert out.block_table.shape == (2, 3)  # 10 tokens + 2 lookahead = 3 blocks of 4; W = widest row
    for name in ("num_prefill_tokens", "num_verify_requests", "num_prefill_requests",
                 "total_num_scheduled_tokens", "max_query_len", "max_seq_len"):
        assert isinstance(getattr(out, name), int), name
    assert (out.num_prefill_tokens, out.max_query_len, out.max_seq_len) == (13, 10, 10)
    check_batch(out, core.block_size)
    up = core.update(np.array([3, 4], dtype=np.int64), np.array([0, 1, 2], dtype=np.int32))
    assert isinstance(up, UpdateOutput)
    assert up.req_ids.dtype == np.uint64 and up.cu_num_new.dtype == np.int32
    assert up.new_token_ids.dtype == np.int64 and up.stop_token.dtype == np.int64
    assert up.finished_req_ids.dtype == np.uint64 and up.finish_reasons == []
    assert owned_by_rust(up.new_token_ids)


def test_block_table_stays_valid_after_later_steps():
    """Block-table buffers are recycled only once numpy has let go of them."""
    core = make_core()
    core.add_request(1, np.arange(10), max_tokens=20)
    core.add_request(2, np.arange(50, 60), max_tokens=20)
    first = core.schedule()
    table = first.block_table
    snapshot = table.copy()
    del first
    core.update(np.array([1, 1]), np.array([0, 1, 2], dtype=np.int32))
    for _ in range(6):  # the rows widen (3 -> 4 blocks): a reused buffer would change
        out = core.schedule()
        core.update(np.array([1, 1]), np.array([0, 1, 2], dtype=np.int32))
        del out
    np.testing.assert_array_equal(table, snapshot)


def test_prefill_decode_verify_finish_cycle():
    core = make_core(max_num_batched_tokens=8)
    prompt = np.arange(100, 112)
    core.add_request(7, prompt, max_tokens=10, eos_token_id=2)
    # chunked prefill: 8 then 4 tokens, logits only for the final chunk
    out = core.schedule()
    assert out.num_scheduled_tokens.tolist() == [8] and out.cu_num_logits.tolist() == [0, 0]
    assert core.update(np.array([], dtype=np.int64), np.array([0, 0], dtype=np.int32)).req_ids.size == 0
    out = core.schedule()
    assert out.num_scheduled_tokens.tolist() == [4] and out.logits_indices.tolist() == [3]
    core.update(np.array([50]), np.array([0, 1], dtype=np.int32))
    # decode
    out = core.schedule()
    assert out.input_ids.tolist() == [50] and out.positions.tolist() == [12]
    core.update(np.array([51]), np.array([0, 1], dtype=np.int32))
    # verification of 3 drafts: 2 accepted + recovered
    core.set_draft_tokens(np.array([7], dtype=np.uint64), np.array([0, 3], dtype=np.int32), np.array([52, 53, 54]))
    out = core.schedule()
    assert out.num_draft_tokens.tolist() == [3] and out.cu_num_logits.tolist() == [0, 4]
    assert out.input_ids.tolist() == [51, 52, 53, 54] and out.num_verify_requests == 1
    up = core.update(np.array([52, 53, 60]), np.array([0, 3], dtype=np.int32))
    assert up.new_token_ids.tolist() == [52, 53, 60]
    assert core.num_output_tokens(7) == 5
    # EOS ends it; the trailing token is discarded
    core.set_draft_tokens(np.array([7], dtype=np.uint64), np.array([0, 1], dtype=np.int32), np.array([2]))
    core.schedule()
    up = core.update(np.array([2, 9]), np.array([0, 2], dtype=np.int32))
    assert up.new_token_ids.tolist() == [2]
    assert up.finished_req_ids.tolist() == [7] and up.finish_reasons == ["stop"] and up.stop_token.tolist() == [2]
    assert not core.has_unfinished_requests()
    assert core.num_free_blocks() == core.num_total_blocks() == 64
    core.check_invariants()
    assert core.stats()["num_steps"] == 5


def test_ngram_proposal_comes_from_the_request_history():
    core = make_core()
    core.add_request(1, [1, 2, 3, 4, 1, 2], max_tokens=4)
    cu, drafts = core.propose_ngram(np.array([1, 99], dtype=np.uint64), k=3, min_n=1, max_n=2)
    assert cu.dtype == np.int32 and drafts.dtype == np.int64
    assert cu.tolist() == [0, 3, 3] and drafts.tolist() == [3, 4, 1]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_blocks=3), "num_kv_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_core(**kwargs)


def test_bad_requests_raise_value_error_naming_the_field():
    core = make_core()
    core.add_request(1, [1, 2], max_tokens=3)
    with pytest.raises(ValueError, match="duplicate request id"):
        core.add_request(1, [1, 2], max_tokens=3)
    with pytest.raises(ValueError, match="prompt_token_ids.*empty prompt"):
        core.add_request(2, [], max_tokens=3)
    with pytest.raises(ValueError, match="prompt_token_ids.*max_model_len"):
        core.add_request(2, np.ones(65, dtype=np.int64), max_tokens=3)
    with pytest.raises(ValueError, match="prompt_token_ids.*out of range"):
        core.add_request(2, [-5], max_tokens=3)
    with pytest.raises(ValueError, match="max_tokens"):
        core.add_request(2, [1], max_tokens=0)
    with pytest.raises(ValueError, match="req_id"):
        core.add_request(-3, [1], max_tokens=1)
    with pytest.raises(ValueError, match="req_id"):
        core.get_token_ids(12345)
    with pytest.raises(RuntimeError, match="update"):
        core.update(np.array([], dtype=np.int64), np.array([0], dtype=np.int32))
    core.schedule()
    with pytest.raises(ValueError, match="cu_num_sampled"):
        core.update(np.array([1, 2]), np.array([0, 2], dtype=np.int32))
    # the bad call changed nothing; the engine goes on
    core.update(np.array([1]), np.array([0, 1], dtype=np.int32))
    core.check_invariants()
    assert core.get_token_ids(1).tolist() == [1, 2, 1]


VOCAB = 6  # tiny vocabulary: EOS, stop tokens and ngram matches happen often
EOS = 0


class CoreMachine(RuleBasedStateMachine):
    """Random add / set drafts / step with partial acceptance / abort / finish."""

    @initialize(
        num_blocks=st.integers(6, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        lookahead=st.integers(0, 3),
        batch_expansion=st.booleans(),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, lookahead, batch_expansion):
        self.max_model_len = min(24, num_blocks * block_size)
        self.block_size, self.max_num_seqs, self.budget = block_size, max_num_seqs, budget
        self.core = SchedulerCore(num_blocks, block_size, max_num_seqs, budget, self.max_model_len,
                                  enable_prefix_caching=True, num_lookahead_tokens=lookahead,
                                  batch_expansion=batch_expansion)
        self.live: set[int] = set()
        self.next_id = 0

    @rule(suffix=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=10), shared=st.integers(0, 12),
          max_tokens=st.integers(1, 8), min_tokens=st.integers(0, 2), ignore_eos=st.booleans())
    def add(self, suffix, shared, max_tokens, min_tokens, ignore_eos):
        prompt = ([1, 2, 3, 4] * 3)[:shared] + suffix  # shared prefixes hit the prefix cache
        prompt = prompt[: self.max_model_len] or [5]
        self.core.add_request(self.next_id, prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                              eos_token_id=EOS, ignore_eos=ignore_eos, stop_token_ids=[VOCAB - 1])
        self.live.add(self.next_id)
        self.next_id += 1

    @rule(data=st.data())
    def set_drafts(self, data):
        ids = sorted(self.live)
        lens = [data.draw(st.integers(0, 4)) for _ in ids]
        drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=sum(lens), max_size=sum(lens)))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        self.core.set_draft_tokens(np.array(ids, dtype=np.uint64), cu, np.array(drafts, dtype=np.int64))

    @rule()
    def propose_ngram(self):
        ids = np.array(sorted(self.live), dtype=np.uint64)
        cu, drafts = self.core.propose_ngram(ids, 3, 1, 3)
        self.core.set_draft_tokens(ids, cu, drafts)

    @rule(data=st.data())
    def step(self, data):
        out = self.core.schedule()
        r = len(out.req_ids)
        assert r <= self.max_num_seqs and out.total_num_scheduled_tokens <= self.budget
        if r == 0:
            assert not self.core.num_running()
            return
        check_batch(out, self.block_size)
        n_logits = np.diff(out.cu_num_logits)
        counts = [0 if n == 0 else data.draw(st.integers(1, int(n))) for n in n_logits]
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=sum(counts), max_size=sum(counts)))
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        up = self.core.update(np.array(tokens, dtype=np.int64), cu)
        assert len(up.finish_reasons) == len(up.finished_req_ids) == len(up.stop_token)
        for rid in up.finished_req_ids.tolist():
            self.live.discard(rid)

    @rule(data=st.data())
    def abort_or_finish(self, data):
        if not self.live:
            assert not self.core.abort_request(10**9)
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        op = data.draw(st.sampled_from([self.core.abort_request, self.core.finish_request]))
        assert op(rid)
        self.live.discard(rid)

    @invariant()
    def bookkeeping_holds(self):
        if hasattr(self, "core"):
            self.core.check_invariants()
            assert self.core.num_waiting() + self.core.num_running() == len(self.live)
            for rid in self.live:
                assert len(self.core.get_token_ids(rid)) <= self.max_model_len

    def teardown(self):
        if not hasattr(self, "core"):
            return
        # drain: everything finishes (max_tokens is small), then every block is free
        for _ in range(2000):
            if not self.core.has_unfinished_requests():
                break
            out = self.core.schedule()
            if len(out.req_ids) == 0:
                continue
            n = np.diff(out.cu_num_logits)
            cu = np.concatenate([[0], np.cumsum(n > 0)]).astype(np.int32)
            self.core.update(np.full(int(cu[-1]), 3, dtype=np.int64), cu)
            self.core.check_invariants()
        assert not self.core.has_unfinished_requests()
        assert self.core.num_free_blocks() == self.core.num_total_blocks()


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
