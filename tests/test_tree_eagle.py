"""Token trees drafted by EAGLE / EAGLE-3 heads: every tree the engine proposes equals the
brute-force reference (the HF-transformers EAGLE references of tests/eagle_reference.py run on
each root-to-node path as a plain sequence of (token, feature) pairs, top-k taken there), for
static and dynamic trees, through chunked prefill, prefix-cache hits and preemption; a chain
written as a tree drafts the chain (tree verification end to end: test_tree_draft_e2e.py)."""
import pytest
import torch

import head_checkpoints as hc
from eagle_reference import Eagle3Reference, EagleReference, PathLogits
from specinfer import Generator, SamplingParams
from spec_cases import prompts
from tree_reference import dynamic_tree, record_tree_proposals, static_tree

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]
PATHS = sorted((tuple(p) for p in TREE), key=lambda p: (len(p), p))
DYN = {"dynamic": True, "num_nodes": 10, "top_k": 2, "depth": 4}


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir("llama", False)[0]


def _gen(target, method, path, tree, k, **kw):
    return Generator(str(target), block_size=4, max_num_batched_tokens=20, num_kv_blocks=40, max_model_len=128,
                     attention_backend="torch_ref", speculative={
                         "method": method, "model": str(path), "quantization": "none", "num_speculative_tokens": k, "token_tree": tree,
                         "policy": "fixed"}, **kw)


def _check(seen, ref, tree, lookahead, every=3):
    n_full = 0
    for tokens, max_drafts, drafts, parents in seen[::every]:
        logits = PathLogits(ref, tokens)
        if isinstance(tree, dict):
            want = dynamic_tree(tree["num_nodes"], tree["top_k"], tree["depth"], logits, node_cap=max_drafts,
                                fed_cap=min(max_drafts, lookahead))
            assert (drafts, parents) == want, len(tokens)
        else:
            n = min(max_drafts, len(PATHS))
            assert parents == [-1 if len(p) == 1 else PATHS.index(p[:-1]) for p in PATHS[:n]]
            assert drafts == static_tree(PATHS, logits, n), len(tokens)
        n_full += len(drafts) == (tree["num_nodes"] if isinstance(tree, dict) else len(PATHS))
    return n_full


@pytest.mark.parametrize("tree", [TREE, DYN], ids=["static", "dynamic"])
def test_eagle_trees_equal_the_brute_force_reference(target, tmp_path, tree):
    path = hc.eagle1(tmp_path / "eagle", target)
    gen = _gen(target, "eagle", path, tree, 10)
    lookahead = gen.engine.proposer.num_lookahead_tokens
    assert lookahead == (len(TREE) if tree is TREE else 10)
    seen = record_tree_proposals(gen)
    ps = prompts(7)
    gen.generate(ps + ps, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    stats = gen.engine.core.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and gen.engine.num_mixed_steps > 0
    assert _check(seen, EagleReference(target, path), tree, lookahead) > 5


@pytest.mark.parametrize("tree", [pytest.param(TREE, marks=pytest.mark.slow), DYN], ids=["static", "dynamic"])
def test_eagle3_trees_equal_the_brute_force_reference(tiny_dir, tmp_path, tree):
    target = tiny_dir("llama", False, layers=4)[0]
    path = hc.eagle3(tmp_path / "e3", target, draft_vocab=96, aux_ids=[0, 1, 3])
    gen = _gen(target, "eagle3", path, tree, 10)
    seen = record_tree_proposals(gen)
    ps = prompts(4)
    gen.generate(ps + ps, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert gen.engine.core.stats()["prefix_cache_hits"] > 0
    ref = Eagle3Reference(target, path)
    allowed = set((torch.arange(96) + ref.d2t).tolist())
    assert all(set(d) <= allowed for _, _, d, _ in seen)
    assert _check(seen, ref, tree, gen.engine.proposer.num_lookahead_tokens) > 3


def test_eagle_chain_tree_drafts_the_chain(target, tmp_path):
    path = hc.eagle1(tmp_path / "eagle", target)
    runs = []
    for tree in (None, [[0] * d for d in range(1, 4)]):
        gen = _gen(target, "eagle", path, tree, 3)
        seen = record_tree_proposals(gen)
        gen.generate(prompts(4), SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
        runs.append([(t, d) for t, _, d, _ in seen])
    assert runs[0] == runs[1] and len(runs[0]) > 10


def test_tree_wider_than_the_draft_vocabulary_is_refused(tiny_dir, tmp_path):
    target = tiny_dir("llama", False, layers=4)[0]
    path = hc.eagle3(tmp_path / "e3", target, draft_vocab=4, aux_ids=[0, 1, 3])
    with pytest.raises(ValueError, match="token_tree"):
        _gen(target, "eagle3", path, [[0], [4]], 2)
