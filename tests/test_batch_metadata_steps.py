"""The one-pass builders of a draft model's step metadata equal their per-run originals: the
decode steps' attention metadata (attention_metadata_for_decode_steps vs one
attention_metadata_for_runs per step) and the KV records' batched calls (will_write_runs,
wrote_confirmed_runs vs a call per run)."""
import numpy as np
import torch

from specinfer.attention.batch_metadata import attention_metadata_for_decode_steps, attention_metadata_for_runs
from specinfer.spec_decode.draft_kv_records import DraftKvRecords


def test_decode_steps_metadata_equals_one_build_per_step():
    rng = np.random.default_rng(1)
    cpu = torch.device("cpu")
    for _ in range(60):
        S, bs, W = int(rng.integers(1, 9)), int(rng.integers(1, 17)), 10
        table = rng.integers(0, 99, (S, W)).astype(np.int32)
        first = rng.integers(0, bs * W - 6, S).astype(np.int64)
        steps = int(rng.integers(1, 5))
        got = attention_metadata_for_decode_steps(table, first, steps, bs, cpu)
        assert len(got) == steps
        for i, (attn, pos) in enumerate(got):
            ref, ref_pos = attention_metadata_for_runs(table, first + i, np.ones(S, np.int64), bs, cpu)
            assert torch.equal(pos, torch.from_numpy(ref_pos))
            for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
                a, b = getattr(attn, f), getattr(ref, f)
                assert a.dtype == b.dtype and torch.equal(a, b), f
            assert (attn.max_query_len, attn.max_seq_len) == (ref.max_query_len, ref.max_seq_len)


class _State:
    def __init__(self, core_id, tokens):
        self.core_id, self.tokens = core_id, tokens

    def tokens_slice(self, a, b):
        return self.tokens[a:b]


def test_batched_record_calls_equal_a_call_per_run():
    rng = np.random.default_rng(2)
    for trial in range(200):
        bs, S, W = int(rng.integers(1, 6)), int(rng.integers(1, 8)), 12
        rows = rng.integers(0, 40, (S, W)).astype(np.int32)
        starts = rng.integers(0, bs * 6, S).astype(np.int64)
        ends = starts + rng.integers(0, bs * 4, S)
        states = [_State(j, rng.integers(0, 9, bs * W).tolist()) for j in range(S)]
        one, many = DraftKvRecords(bs), DraftKvRecords(bs)
        seed = {int(k): 1 for k in rng.integers(0, 40, 20)} if trial % 3 else {}
        one._key_of_block, many._key_of_block = dict(seed), dict(seed)
        for j in range(S):
            one.will_write(rows[j], int(starts[j]), int(ends[j]))
        many.will_write_runs(rows, starts, ends)
        assert one._key_of_block == many._key_of_block
        for j in range(S):
            one.wrote_confirmed(states[j], rows[j], int(starts[j]), int(ends[j]))
        many.wrote_confirmed_runs(states, rows, starts, ends)
        assert one._key_of_block == many._key_of_block
