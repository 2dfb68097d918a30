"""Speculative sampling with Medusa and MLP-speculator heads through the WHOLE engine keeps the
target's distribution: the heads draw their drafts from their own (processed) distributions and
hand them over as q (test_engine_distribution.py has the harness: V = 8 target, the exact joint
law of three output tokens from transformers, Pearson chi-square at alpha = 1e-3). Verifying
the drafts against the q of the wrong position must fail the same test (slow;
test_head_draft_probs.py checks in the default suite that the drafts follow the reported q).
(Claiming q = one-hot for sampled drafts would NOT be caught: the one-hot variant is lossless for
any draft chosen independently of the target's randomness, only with lower acceptance.)
"""
from __future__ import annotations

import dataclasses

import pytest

import head_checkpoints as hc
from specinfer.spec_decode import head_proposer
from engine_law import NUM, sample_counts as _counts  # noqa: E402
from stats import ALPHA, chi_square_pvalue  # noqa: E402

HEADS = {"medusa": lambda p, t: hc.medusa_original(p, t, num_heads=2, scale=0.3),
         "mlp_speculator": lambda p, t: hc.mlp_speculator(p, t, n_predict=2)}


@pytest.fixture(scope="module")
def head_dirs(law_models, tmp_path_factory):
    target = law_models[0]
    root = tmp_path_factory.mktemp("v8_heads")
    return {m: make(root / m, target) for m, make in HEADS.items()}


@pytest.mark.parametrize("method", ["mlp_speculator", pytest.param("medusa", marks=pytest.mark.slow)])
def test_engine_keeps_the_target_distribution_with_heads(law_models, exact_law, head_dirs, method):
    spec = {"method": method, "model": str(head_dirs[method]), "num_speculative_tokens": 2}
    counts, m = _counts(law_models[0], spec)
    assert m["num_draft_tokens"] > NUM // 4 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA


@pytest.mark.parametrize("method", ["medusa"])  # the negative control runs in the default suite
def test_engine_test_rejects_a_misaligned_q(law_models, exact_law, head_dirs, monkeypatch, method):
    """Each draft verified against the q of the other draft position must fail."""
    propose = head_proposer.HiddenStateHeadProposer.propose

    def shifted_q(self, inp):
        prop = propose(self, inp)
        if prop.draft_probs is None:
            return prop
        q = [None if p is None else p.roll(1, dims=0) for p in prop.draft_probs]
        return dataclasses.replace(prop, draft_probs=q)

    monkeypatch.setattr(head_proposer.HiddenStateHeadProposer, "propose", shifted_q)
    spec = {"method": method, "model": str(head_dirs[method]), "num_speculative_tokens": 2}
    counts, m = _counts(law_models[0], spec)
    assert m["num_draft_tokens"] > 0
    assert chi_square_pvalue(counts, exact_law) < ALPHA
