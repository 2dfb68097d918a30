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

ALPHA = 1e-3
VOCAB = 8
PROMPT = [3, 4, 5, 3, 4]  # the n-gram proposer finds "3 4" earlier and proposes "5 3"
NUM = 24_000
N_CHECK = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import build_tiny_model

    target_dir = tmp_path_factory.mktemp("v8_target")
    target = build_tiny_model(target_dir, "llama", vocab=VOCAB, scale=2.0, seed=3)
    draft_dir = tmp_path_factory.mktemp("v8_draft")
    build_tiny_model(draft_dir, "llama", vocab=VOCAB, base=target_dir, perturb=0.15)
    return target_dir, draft_dir, target


@pytest.fixture(scope="module")
def exact_law(models):
    """P(t0, t1, t2 | PROMPT) at temperature 1 from the transformers model, float64."""
    _, _, model = models
    model = model.double()
    with torch.no_grad():
        def next_probs(prefix):  # [B, len] -> [B, V]
            return torch.softmax(model(torch.tensor(prefix)).logits[:, -1], -1)

        p0 = next_probs([PROMPT])[0]
        p1 = next_probs([PROMPT + [a] for a in range(VOCAB)])  # [V, V]
        p2 = next_probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return (p0[:, None, None] * p1[:, :, None] * p2).reshape(-1)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(obs.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _counts(target, spec) -> tuple[torch.Tensor, dict]:
    gen = Generator(str(target), block_size=4, max_num_seqs=1024, max_num_batched_tokens=8192,
                    max_model_len=32, speculative=spec, seed=7)
    params = SamplingParams(max_tokens=N_CHECK + 1, temperature=1.0, ignore_eos=True)
    outs = gen.generate([PROMPT] * NUM, params, use_tqdm=False)
    codes = torch.tensor([(o.token_ids[0] * VOCAB + o.token_ids[1]) * VOCAB + o.token_ids[2] for o in outs])
    return torch.bincount(codes, minlength=VOCAB ** N_CHECK), gen.spec_metrics()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_engine_keeps_the_target_distribution(models, exact_law, method):
    target, draft, _ = models
    # policy fixed: the draft count below must not depend on which requests can shorten the batch
    spec = {"method": method, "num_speculative_tokens": 2, "policy": "fixed"}
    if method == "draft_model":
        spec["model"] = str(draft)
    counts, m = _counts(target, spec)
    assert m["num_draft_tokens"] > NUM // 4 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA


def test_engine_test_rejects_a_broken_verifier(models, exact_law, monkeypatch):
    target, draft, _ = models
    monkeypatch.setattr(rs, "_accept", lambda u, tp, dp: torch.ones_like(u, dtype=torch.bool))
    counts, _ = _counts(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert chi_square_pvalue(counts, exact_law) < ALPHA
