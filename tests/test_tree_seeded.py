"""Sampling requests with token trees through the whole engine: seeded requests give the same
tokens alone and in a batch (the verified trees are the same whatever else runs) and after
failed steps (a step with trees is a transaction too); preemption and budget cuts re-draft or
cut a tree, so there the seeded tokens may differ (still lossless; see docs/trees.md), and a
budget that cuts a sampling request's tree down to a chain-shaped prefix is verified as
deterministic (one-hot) drafts instead of failing."""
import random

import pytest

from specinfer import Generator, SamplingParams
from spec_cases import prompts

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def pair(target_and_draft):
    return target_and_draft


def _gen(pair, **kw):
    target, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "token_tree": TREE}
    return Generator(str(target), max_model_len=128, speculative=spec, **kw)


def test_seeded_tree_requests_are_the_same_alone_and_batched_and_survive_preemption(pair):
    ps = prompts(8)
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(8)]
    alone = [_gen(pair).generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(ps[:3], params)]
    batched = _gen(pair).generate(ps, params, use_tqdm=False)
    assert [o.token_ids for o in batched[:3]] == alone
    small = _gen(pair, block_size=4, num_kv_blocks=40)  # room for the trees of a few requests: preempts
    outs = small.generate(ps, params, use_tqdm=False)
    assert small.engine.core.stats()["num_preemptions"] > 0
    assert all(len(o.token_ids) == 20 for o in outs)
    assert small.engine.core.num_free_blocks() == small.engine.core.num_total_blocks()
    assert small.spec_metrics()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("where", ["forward", "sampler", "proposer"])
def test_failed_steps_with_trees_replay_exactly(pair, where):
    from fault_injection import Injector, run_engine

    ps = prompts(8)
    # a failed forward or sampler replays the same step (seeded sampling stays exact); a failed
    # proposer leaves its requests without a proposal for one step, which changes which random
    # draws decide their next tokens, so that case is checked with greedy requests
    params = SamplingParams(max_tokens=16, temperature=0.0 if where == "proposer" else 0.9, seed=5)
    want, faults = run_engine(_gen(pair, block_size=4, max_num_batched_tokens=24), ps, params)
    assert faults == 0
    gen = _gen(pair, block_size=4, max_num_batched_tokens=24)
    eng = gen.engine
    fail_at = set(random.Random(where).sample(range(1, 30), 6))
    kinds = [RuntimeError, KeyboardInterrupt, MemoryError]
    if where == "forward":
        eng.runner.forward = inj = Injector(eng.runner.forward, fail_at, kinds)
    elif where == "sampler":
        eng.step_sampler = inj = Injector(eng.step_sampler.__call__, fail_at, kinds)
    else:
        eng.proposer.propose = inj = Injector(eng.proposer.propose, fail_at, kinds)
    got, faults = run_engine(gen, ps, params)
    assert inj.raised >= 3 and faults == inj.raised
    assert got == want
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()


def test_a_budget_cut_sampling_tree_is_verified_as_deterministic_drafts(pair):
    gen = _gen(pair, block_size=4, max_num_batched_tokens=10)  # trees of 7 rows are cut in busy steps
    outs = gen.generate(prompts(6), SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs)
    core = gen.engine.core
    assert core.num_free_blocks() == core.num_total_blocks()
    core.check_invariants()
