"""Suffix decoding (method "suffix"): speculation trees from the Rust core's suffix tries, a trie
per request (prompt + output) and a global one over ended requests' outputs. Greedy output equals
the target's through chunked prefill, preemption, prefix-cache hits and both scorers; a repeated
round drafts from the global trie and accepts long runs; trees branch where the history does;
eviction keeps the global trie bounded (memory in the core's stats); abort and finish drop a
request's trie (core invariant); sampling keeps the target's law (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest

from specinfer import Generator, SamplingParams
from core_spy import BranchSpy
from spec_cases import GREEDY, check_greedy_exact, check_prefix_hits
from stats import ALPHA, chi_square_pvalue

from engine_law import NUM, sample_counts

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 0.0}


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
def test_greedy_suffix_equals_target(target, ref, scorer):
    tot = check_greedy_exact(target, {**SUFFIX, "scorer": scorer}, ref)
    assert tot["num_accepted_tokens"] > 0


def test_prefix_cache_hits_and_a_repeated_round(target, ref):
    """Round 2 of the same prompts: prefix-cache hits, and the global trie drafts the answers
    round 1 gave (long accepted runs)."""
    gen = check_prefix_hits(target, {**SUFFIX, "policy": "fixed"}, ref)
    prop = gen.engine.proposer
    assert prop.num_global_proposals > 0
    ps, want = ref
    gen.reset_metrics()
    outs = gen.generate(ps[:8], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want[:8]
    m = gen.spec_metrics()
    assert m["mean_acceptance_length"] >= 4.0, m  # the answers repeat: whole trees accepted
    stats = gen.engine.core.stats()
    assert stats["suffix_cached_requests"] == 24 and stats["suffix_bytes"] > 0, stats


def test_trees_branch_where_the_history_does(target):
    """"a b" followed by c and by d earlier: the tree holds both continuations; output exact."""
    g = np.random.default_rng(3)
    prompts = []
    for _ in range(6):
        a, b = g.integers(3, 250, 2).tolist()
        tails = [g.integers(3, 250, 3).tolist() for _ in range(3)]
        prompts.append(sum(([a, b] + t for t in tails), []) + [a, b])
    want = Generator(str(target), max_model_len=128).generate(prompts, GREEDY, use_tqdm=False)
    gen = Generator(str(target), max_model_len=128, block_size=4, speculative={**SUFFIX, "policy": "fixed"})
    spy = gen.engine.core = BranchSpy(gen.engine.core)
    gen.engine.proposer.core = spy
    outs = gen.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert spy.branching > 0


def test_eviction_bounds_the_global_trie(target, ref):
    ps, want = ref
    gen = Generator(str(target), max_model_len=128,
                    speculative={**SUFFIX, "suffix_decoding_max_cached_requests": 3})
    sizes = []
    for i in range(0, 12, 4):
        assert [o.token_ids for o in gen.generate(ps[i:i + 4], GREEDY, use_tqdm=False)] == want[i:i + 4]
        s = gen.engine.core.stats()
        sizes.append(s["suffix_nodes"])
        assert s["suffix_cached_requests"] == 3, s
    assert max(sizes) < 3 * 3 * 24 * (24 + 40)  # 3 outputs of <= 24 tokens, depth 24 (and no live tries)
    gen.engine.core.check_invariants()
    only_own = Generator(str(target), max_model_len=128,
                         speculative={**SUFFIX, "suffix_decoding_max_cached_requests": 0, "policy": "fixed"})
    for _ in range(2):
        assert [o.token_ids for o in only_own.generate(ps[:4], GREEDY, use_tqdm=False)] == want[:4]
    assert only_own.engine.proposer.num_global_proposals == 0
    assert only_own.engine.core.stats()["suffix_cached_requests"] == 0


def test_abort_mid_request_drops_its_trie(target, ref):
    ps, _ = ref
    gen = Generator(str(target), max_model_len=128, speculative={**SUFFIX, "policy": "fixed"})
    eng = gen.engine
    for i, p in enumerate(ps[:6]):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
        eng.core.check_invariants()  # every live request's trie holds exactly its tokens
    for i in range(3):
        eng.abort(f"r{i}")
    eng.core.check_invariants()  # no trie kept for an aborted request
    while eng.has_unfinished_requests():
        eng.step()
    eng.core.check_invariants()
    assert eng.core.stats()["suffix_cached_requests"] == 6  # aborted outputs count as history too


def test_suffix_sampling_keeps_the_target_law(law_models, exact_law):
    target, _, _ = law_models
    counts, m = sample_counts(target, {**SUFFIX, "num_speculative_tokens": 2, "policy": "fixed"})
    assert m["num_draft_tokens"] > NUM // 8 and m["num_accepted_tokens"] > 0, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA


@pytest.mark.parametrize("bad,match", [
    ({"suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
    ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
    ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
    ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
    ({"num_speculative_tokens": 64}, "num_speculative_tokens"),
])
def test_bad_suffix_config(target, bad, match):
    with pytest.raises(ValueError, match=match):
        Generator(str(target), speculative={"method": "suffix", **bad})
