"""Seeded determinism under speculation: a seeded request gives the same tokens alone or in
any batch, under a token budget that splits its proposals, under preemption, with
disable_by_batch_size, for both acceptance methods and both proposers (draws are
counter-based, keyed on (seed, output position, purpose))."""
from __future__ import annotations

import numpy as np
import pytest

from specinfer import Generator, SamplingParams

from seeded_runs import PROMPT, run_seeded


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    from tiny_models import build_tiny_model

    target, _ = tiny_dir("llama", False, scale=2.0)
    draft = tmp_path_factory.mktemp("draft_det")
    build_tiny_model(draft, "llama", base=target, perturb=0.01)
    return target, draft


@pytest.mark.parametrize("acceptance", ["rejection_sampler", "typical_acceptance_sampler"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seeded_request_is_the_same_in_any_batch_budget_and_pool(models, method, acceptance):
    target, draft = models
    alone, _, _, m = run_seeded(target, draft, method, acceptance, 0)
    assert m["num_draft_tokens"] > 0
    batched, _, _, _ = run_seeded(target, draft, method, acceptance, 7)
    split, splits, _, _ = run_seeded(target, draft, method, acceptance, 0, max_num_batched_tokens=3)
    tight, _, _, _ = run_seeded(target, draft, method, acceptance, 7, max_num_batched_tokens=6)
    preempted, _, preemptions, _ = run_seeded(target, draft, method, acceptance, 7, num_kv_blocks=20)
    disabled, _, _, _ = run_seeded(target, draft, method, acceptance, 7, spec={"disable_by_batch_size": 2})
    assert splits > 0, "the budget never split a proposal"
    assert preemptions > 0, "nothing was preempted"
    assert batched == alone
    assert split == alone
    assert tight == alone
    assert preempted == alone
    assert disabled == alone


def test_seeds_matter(models):
    """Guards the test above: another seed gives other tokens."""
    target, draft = models
    gen = Generator(str(target), block_size=4, speculative={"method": "draft_model", "model": str(draft),
                                                             "num_speculative_tokens": 4})
    outs = gen.generate([PROMPT] * 4, [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=s)
                                       for s in (1234, 1, 2, 3)], use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) == 4


def test_unseeded_requests_are_reproducible_from_the_engine_seed(models):
    target, _ = models
    params = SamplingParams(max_tokens=10, temperature=1.0)
    runs = [[o.token_ids for o in Generator(str(target), seed=s).generate([PROMPT] * 3, params, use_tqdm=False)]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    assert len({tuple(t) for t in runs[0]}) > 1  # each request has its own stream


def test_streams_cover_the_full_seed_range(models):
    target, _ = models
    gen = Generator(str(target))
    a = gen.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1), use_tqdm=False)
    b = gen.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1), use_tqdm=False)
    assert a[0].token_ids == b[0].token_ids
    assert np.all(np.asarray(a[0].token_ids) >= 0)
