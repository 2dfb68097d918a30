"""Chi-square tests of the joint law of tokens emitted by tree verification (issue 9).

Harness: tests/tree_harness.py (Markov target and draft, branching trees with 1..3 siblings and
depth 1..3, independently sampled or deterministic top-k children, 1e5 requests decoded at once,
each with its own counter stream). Pearson chi-square of the first three emitted tokens against
the exact target law at alpha = 1e-3, fixed seeds. The same harness must reject the three
classic tree-verification bugs, made by monkeypatching the module's small functions:
- the residual not updated across siblings (every sibling tested against the unmodified p);
- descending into an accepted child with the parent's residual instead of the child's own p;
- the recovered/bonus token drawn from the unmodified p instead of the residual;
and, beyond the issue's three, one uniform shared by all siblings of a node.
"""
from __future__ import annotations

import pytest
import torch

from specinfer.sample import tree_verify as tv
from specinfer.sample.random_streams import ACCEPT
from stats import chi_square_pvalue
from tree_harness import decode_with_trees, markov_chains, markov_law

ALPHA = 1e-3
NUM_SAMPLES = 100_000
N_CHECK = 3
VOCAB = 5
# parents per node (-1 = root); sibling counts 1..3, depths 1..3
SHAPES = [
    [-1, -1, -1, 0, 0, 1, 3],  # root: 3 children; node 0: 2; node 1: 1; node 3: 1 (depth 3)
    [-1, -1, 0, 0, 1, 1],  # binary, depth 2
    [-1, 0, 0, 1, 1, 2],  # a chain of one, then a binary split, depth 3
    [-1, -1, -1],  # three siblings only
]


def _law_counts(children, seed=1, dtype=torch.float64, shapes=SHAPES):
    P, Q = markov_chains(VOCAB, N_CHECK + 4, seed=0)
    counts = decode_with_trees(P.to(dtype), Q.to(dtype), shapes, children, N_CHECK, seed, NUM_SAMPLES)
    return counts, markov_law(P, N_CHECK)


@pytest.mark.parametrize("children", ["sampled", "top_k"])
def test_joint_law_matches_target(children):
    counts, law = _law_counts(children)
    assert chi_square_pvalue(counts, law) > ALPHA


def test_joint_law_mixed_children_float32():
    """Sampled and top-k trees in one batch, float32 probabilities as in production."""
    counts, law = _law_counts("mixed", seed=2, dtype=torch.float32)
    assert chi_square_pvalue(counts, law) > ALPHA


BROKEN = {
    "residual_not_updated_across_siblings":
        ("_sibling_target", lambda p, residual, total: (p, torch.ones_like(total))),
    "child_descends_with_parent_residual":
        ("_node_distribution", lambda p, parent_residual: p if parent_residual is None else parent_residual),
    "final_token_from_unmodified_p": ("_final_weights", lambda p, residual: p),
    # one uniform for every sibling of a node (the draws of later siblings are then conditioned
    # on the earlier rejections); caught through the top-k trees of the mixed batch
    "one_uniform_for_all_siblings": ("sibling_accept_purpose", lambda j: ACCEPT),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_harness_rejects_broken_verifier(broken, monkeypatch):
    name, fake = BROKEN[broken]
    monkeypatch.setattr(tv, name, fake)
    counts, law = _law_counts("mixed")
    assert chi_square_pvalue(counts, law) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("children", ["sampled", "top_k"])
@pytest.mark.parametrize("broken", sorted(set(BROKEN) - {"one_uniform_for_all_siblings"}))
def test_harness_rejects_broken_verifier_per_children_kind(broken, children, monkeypatch):
    name, fake = BROKEN[broken]
    monkeypatch.setattr(tv, name, fake)
    counts, law = _law_counts(children)
    assert chi_square_pvalue(counts, law) < ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 4, 5])
def test_joint_law_more_seeds_deep_chain_like_trees(seed):
    shapes = [[-1, 0, 1, 2], [-1, -1, 0, 1, 2, 3], [-1, 0, 0, 0, 1]]
    counts, law = _law_counts("mixed", seed=seed, shapes=shapes)
    assert chi_square_pvalue(counts, law) > ALPHA
