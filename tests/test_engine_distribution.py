"""Speculative sampling through the WHOLE engine keeps the target's distribution.

A tiny-vocabulary target (V = 8) samples the first three output tokens of a fixed prompt in
tens of thousands of requests (each with its own stream); the joint law of those 512
outcomes is computed exactly with transformers (the independent reference) and compared by a
Pearson chi-square test (cells with expected count < 5 pooled, alpha = 1e-3). Speculation runs
for real: the first token comes from the prefill, positions 1 and 2 are verified drafts with a
bonus or recovered token. A deliberately broken verifier (every draft accepted) must fail the
same test, so the test is not blind.
"""
from __future__ import annotations

import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.sample import rejection_sampler as rs
from stats import ALPHA, chi_square_pvalue  # noqa: E402

from engine_law import N_CHECK, NUM, PROMPT, VOCAB, sample_counts as _counts  # noqa: E402,F401


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_engine_keeps_the_target_distribution(law_models, exact_law, method):
    target, draft, _ = law_models
    # policy fixed: the draft count below must not depend on which requests can shorten the batch
    spec = {"method": method, "num_speculative_tokens": 2, "policy": "fixed"}
    if method == "draft_model":
        spec["model"] = str(draft)
    counts, m = _counts(target, spec)
    assert m["num_draft_tokens"] > NUM // 4 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA


def test_engine_test_rejects_a_broken_verifier(law_models, exact_law, monkeypatch):
    target, draft, _ = law_models
    monkeypatch.setattr(rs, "_accept", lambda u, tp, dp: torch.ones_like(u, dtype=torch.bool))
    counts, _ = _counts(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert chi_square_pvalue(counts, exact_law) < ALPHA
