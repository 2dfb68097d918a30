"""Sampling with token trees through the whole engine keeps the target's law: draft_model and
EAGLE trees (deterministic top-k children, q = one-hot) at temperature 1, chi-square on the joint
law of the first three output tokens (the harness of test_engine_distribution): the tree walk's
one-hot variant (accept x w.p. p(x), else zero p(x), renormalise, next sibling) under test."""
import pytest

import head_checkpoints as hc
from engine_law import NUM, sample_counts as _counts  # noqa: E402
from stats import ALPHA, chi_square_pvalue  # noqa: E402


@pytest.mark.slow  # ~30 s each (24k requests)
@pytest.mark.parametrize("method,tree", [
    ("draft_model", [[0], [1], [0, 0]]),
    ("eagle", {"dynamic": True, "num_nodes": 4, "top_k": 2, "depth": 2}),
])
def test_tree_sampling_keeps_the_target_distribution(law_models, exact_law, tmp_path, method, tree):  # noqa: F811
    target, draft, _ = law_models
    path = draft if method == "draft_model" else hc.eagle1(tmp_path / "eagle", target)
    counts, m = _counts(target, {"method": method, "model": str(path), "num_speculative_tokens": 2,
                                 "token_tree": tree})
    assert m["num_draft_tokens"] > NUM // 4 and m["num_accepted_tokens"] > 0, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA
