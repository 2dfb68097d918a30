"""Tests of Medusa-style typical acceptance (not distribution-preserving; exact checks only)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specinfer.sample import RandomStreams, typical_acceptance_sample
from specinfer.sample.typical_acceptance import entropy


def streams(n: int, seed: int = 0) -> RandomStreams:
    return RandomStreams.build(np.arange(n, dtype=np.uint64) + np.uint64(seed * 1000), np.zeros(n, np.int64))


def _batch(num_requests, k, target_row, drafts):
    cu = torch.arange(num_requests + 1) * k
    target = target_row.expand(num_requests * (k + 1), -1).clone()
    return drafts, cu, target


def test_uniform_target_accepts_every_draft():
    """H = log V so the threshold is min(0.09, 0.3 / V) = 0.06 < 1/V = 0.2."""
    vocab, k, num = 5, 3, 200
    drafts = torch.randint(0, vocab, (num * k,), generator=torch.Generator().manual_seed(0))
    drafts, cu, target = _batch(num, k, torch.full((vocab,), 1 / vocab, dtype=torch.float64), drafts)
    out, num_emitted = typical_acceptance_sample(drafts, cu, None, target,
                                                 torch.zeros(num, dtype=torch.bool), streams(num, 1))
    assert bool((num_emitted == k + 1).all())
    assert torch.equal(out[:, :k], drafts.reshape(num, k))
    assert len(set(out[:, k].tolist())) == vocab  # the bonus is sampled, not argmax


def test_one_hot_target_rejects_other_drafts_and_emits_argmax():
    vocab, k = 6, 3
    target_row = torch.nn.functional.one_hot(torch.tensor(4), vocab).double()
    drafts = torch.tensor([4, 4, 4, 4, 1, 4, 0, 4, 4, 4, 4, 2])  # 4 requests
    drafts, cu, target = _batch(4, k, target_row, drafts)
    out, num_emitted = typical_acceptance_sample(drafts, cu, None, target,
                                                 torch.tensor([False, False, True, False]),
                                                 streams(4))
    assert num_emitted.tolist() == [4, 2, 1, 3]
    assert out.tolist() == [[4, 4, 4, 4], [4, 4, -1, -1], [4, -1, -1, -1], [4, 4, 4, -1]]


P_HAND = [0.7, 0.2, 0.08, 0.02]
H_HAND = -sum(p * math.log(p) for p in P_HAND)  # 0.851859...


@pytest.mark.parametrize("threshold,alpha,effective,accepted_tokens", [
    # e^-H = 0.42662. min(0.09, 0.3 * e^-H = 0.12799) = 0.09: 0.7 and 0.2 pass, 0.08 fails
    (0.09, 0.3, 0.09, {0, 1}),
    # min(0.3, 0.12799) = 0.12799: 0.2 passes, 0.08 fails
    (0.3, 0.3, 0.12799, {0, 1}),
    # min(0.09, 0.15 * e^-H = 0.06400): now 0.08 passes, 0.02 fails
    (0.09, 0.15, 0.06400, {0, 1, 2}),
    # min(0.5, 0.9 * e^-H = 0.38396): only 0.7 passes
    (0.5, 0.9, 0.38396, {0}),
])
def test_threshold_math_hand_computed(threshold, alpha, effective, accepted_tokens):
    assert abs(H_HAND - 0.851859) < 1e-6
    assert abs(min(threshold, alpha * math.exp(-H_HAND)) - effective) < 1e-5
    target_row = torch.tensor(P_HAND, dtype=torch.float64)
    torch.testing.assert_close(entropy(target_row.unsqueeze(0)),
                               torch.tensor([H_HAND], dtype=torch.float64))
    drafts, cu, target = _batch(4, 1, target_row, torch.tensor([0, 1, 2, 3]))
    out, num_emitted = typical_acceptance_sample(
        drafts, cu, None, target, torch.zeros(4, dtype=torch.bool), streams(4),
        posterior_threshold=threshold, posterior_alpha=alpha)
    accepted = {t for t in range(4) if num_emitted[t] == 2}
    assert accepted == accepted_tokens
    for t in set(range(4)) - accepted_tokens:  # greedy fallback on rejection
        assert out[t].tolist() == [0, -1]


def test_greedy_requests_use_exact_match_and_argmax_bonus():
    target_row = torch.tensor([0.1, 0.45, 0.45], dtype=torch.float64)  # argmax = 1 (first max)
    drafts, cu, target = _batch(2, 2, target_row, torch.tensor([1, 2, 1, 1]))
    out, num_emitted = typical_acceptance_sample(drafts, cu, None, target,
                                                 torch.tensor([True, True]), streams(2))
    assert out.tolist() == [[1, 1, -1], [1, 1, 1]]  # 2 is typical but not the argmax
    assert num_emitted.tolist() == [2, 3]


def test_seeded_bonus_same_alone_and_in_batch():
    vocab = 50
    row = torch.softmax(torch.zeros(vocab, dtype=torch.float64), 0)
    def run(batch_size, position):
        drafts, cu, target = _batch(batch_size, 1, row, torch.zeros(batch_size, dtype=torch.int64))
        seeds = list(range(1000, 1000 + batch_size))
        seeds[position] = 99
        st = RandomStreams.build(seeds, [5] * batch_size)
        out, _ = typical_acceptance_sample(drafts, cu, None, target,
                                           torch.zeros(batch_size, dtype=torch.bool), st)
        return out[position].tolist()
    alone = run(1, 0)
    assert run(7, 3) == alone and run(4, 0) == alone
    drafts, cu, target = _batch(1, 1, row, torch.tensor([0]))
    others = {tuple(typical_acceptance_sample(drafts, cu, None, target, torch.tensor([False]),
                                              RandomStreams.build([s], [5]))[0][0].tolist())
              for s in range(10)}
    assert len(others) > 1  # the seed matters, so the equality above is not trivial
