"""The draft model's KV stays valid under prefix caching, and its catch-up after a pause
respects the token budget."""
from __future__ import annotations

import numpy as np
import torch

from specinfer import Generator, SamplingParams
from specinfer.spec_decode.draft_kv_records import DraftKvRecords

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


class Counter:
    """Wraps a runner's forward and records the number of tokens of each call."""

    def __init__(self, fn):
        self.fn, self.sizes = fn, []

    def __call__(self, input_ids, positions, attn):
        self.sizes.append(int(input_ids.shape[0]))
        return self.fn(input_ids, positions, attn)


def _prompt(n, seed=4):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _self_draft(target, **kw):
    return Generator(str(target), block_size=4, max_model_len=128,
                     speculative={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}, **kw)


def test_cached_blocks_without_draft_kv_are_recomputed_by_the_draft(tiny_dir):
    """A request that never speculated leaves cached blocks whose draft KV was never written;
    a later request hitting them must not draft from that garbage (draft = target: any stale
    KV shows as acceptance < 1)."""
    target, _ = tiny_dir("llama", False)
    gen = _self_draft(target)
    prefix = _prompt(40)
    gen.generate([prefix], SamplingParams(max_tokens=4, temperature=0.0, speculate=False), use_tqdm=False)
    out = gen.generate([prefix + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 36  # the prefix cache was hit
    m = gen.spec_metrics()
    assert m["num_draft_tokens"] > 0 and m["acceptance_rate"] == 1.0, m


def test_cached_blocks_with_valid_draft_kv_are_reused(tiny_dir):
    target, _ = tiny_dir("llama", False)
    gen = _self_draft(target)
    prefix = _prompt(40, seed=5)
    gen.generate([prefix], GREEDY, use_tqdm=False)  # speculating: the draft wrote the blocks
    counter = Counter(gen.engine.proposer.runner.forward)
    gen.engine.proposer.runner.forward = counter
    out = gen.generate([prefix + [7, 8, 9]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 36
    # the first draft forward catches up only the uncached tail (+ the sampled token)
    assert counter.sizes[0] <= len(prefix) + 4 - out.num_cached_tokens
    assert gen.spec_metrics()["acceptance_rate"] == 1.0


def test_catch_up_after_a_pause_respects_the_budget(tiny_dir):
    """disable_by_batch_size pauses speculation while 3 requests run; when one finishes the
    other two resume with long histories the draft has not seen: it catches them up over
    several steps, never more than the budget (+ one token per sampled request) at once, and
    greedy output stays exact."""
    target, _ = tiny_dir("llama", False)
    prompts = [_prompt(30, seed=s) for s in range(3)]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (25, 60, 60)]
    want = [o.token_ids for o in Generator(str(target), block_size=4, max_model_len=160)
            .generate(prompts, params, use_tqdm=False)]
    budget = 12
    gen = Generator(str(target), block_size=4, max_model_len=160, max_num_batched_tokens=budget,
                    speculative={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                                 "disable_by_batch_size": 3})
    counter = Counter(gen.engine.proposer.runner.forward)
    gen.engine.proposer.runner.forward = counter
    outs = gen.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert max(counter.sizes) <= budget + 3
    assert gen.spec_metrics()["num_draft_tokens"] > 0


def test_records_follow_writes():
    class State:
        core_id = 1
        tokens = list(range(100, 112))

        def tokens_slice(self, a, b):
            return self.tokens[a:b]

    rec = DraftKvRecords(block_size=4)
    row = np.array([7, 3, 9])
    st = State()
    assert rec.reusable_tokens(st, row, 12) == 0
    rec.will_write(row, 0, 10)
    rec.wrote_confirmed(st, row, 0, 10)  # blocks 7 and 3 are full, 9 is not
    assert rec.reusable_tokens(st, row, 12) == 8
    assert rec.reusable_tokens(st, row, 7) == 4  # never past the limit
    rec.will_write(np.array([3]), 2, 3)  # another request writes into block 3
    assert rec.reusable_tokens(st, row, 12) == 4
    other = State()
    other.core_id, other.tokens = 2, [1] * 12
    assert rec.reusable_tokens(other, row, 12) == 0  # same block ids, other tokens
