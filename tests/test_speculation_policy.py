"""The speculation policy picks the analytically best number of drafts on synthetic inputs."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from specinfer.spec_decode.policy import (AcceptanceEstimates, StepCostModel, choose_num_drafts,
                                          expected_emitted)


def brute_force(accept, max_drafts, base_tokens, cost):
    c0, c_t, c_d = cost
    best, best_d = -1.0, None
    for d in itertools.product(*[range(m + 1) for m in max_drafts]):
        emitted = sum(expected_emitted(accept[i], di) for i, di in enumerate(d))
        g = emitted / (c0 + c_t * (base_tokens + sum(d)) + c_d * sum(d))
        if g > best + 1e-12:
            best, best_d = g, d
    return best, np.array(best_d)


def goodput(accept, d, base_tokens, cost):
    c0, c_t, c_d = cost
    emitted = sum(expected_emitted(accept[i], int(di)) for i, di in enumerate(d))
    return emitted / (c0 + c_t * (base_tokens + d.sum()) + c_d * d.sum())


@pytest.mark.parametrize("seed", range(40))
def test_greedy_choice_equals_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    R, K = int(rng.integers(1, 4)), 4
    accept = rng.uniform(0.0, 1.0, size=(R, K))
    max_drafts = rng.integers(0, K + 1, size=R)
    cost = (float(rng.uniform(0.001, 0.05)), float(rng.uniform(1e-4, 0.01)), float(rng.uniform(0, 0.01)))
    base = int(rng.integers(R, 3 * R + 1))
    best, _ = brute_force(accept, max_drafts, base, cost)
    d = choose_num_drafts(accept, max_drafts, base, cost)
    assert np.all(d <= max_drafts)
    assert goodput(accept, d, base, cost) == pytest.approx(best, rel=1e-9)


def test_speculation_that_does_not_pay_gets_k_zero():
    accept = np.full((3, 4), 0.05)
    # a step's fixed cost is tiny and each token costs as much as a whole step: drafts never pay
    assert choose_num_drafts(accept, np.full(3, 4), 3, (1e-4, 0.01, 0.01)).tolist() == [0, 0, 0]


def test_high_acceptance_with_a_fixed_cost_step_drafts_the_most():
    accept = np.full((2, 5), 0.95)
    assert choose_num_drafts(accept, np.array([5, 3]), 2, (0.05, 1e-5, 1e-5)).tolist() == [5, 3]


def test_requests_with_better_acceptance_draft_more():
    accept = np.array([[0.9] * 4, [0.3] * 4])
    d = choose_num_drafts(accept, np.array([4, 4]), 2, (0.01, 0.002, 0.001))
    assert d[0] > d[1]


def test_cost_model_recovers_the_coefficients():
    rng = np.random.default_rng(1)
    model = StepCostModel(decay=1.0)
    assert model.coefficients() is None
    for _ in range(200):
        t, dr = int(rng.integers(1, 200)), int(rng.integers(0, 40))
        model.record(t, dr, 0.02 + 0.0005 * t + 0.002 * dr + rng.normal(0, 1e-5))
    c0, ct, cd = model.coefficients()
    assert c0 == pytest.approx(0.02, rel=0.02) and ct == pytest.approx(0.0005, rel=0.02)
    assert cd == pytest.approx(0.002, rel=0.02)


def test_acceptance_estimates_follow_what_was_accepted():
    est = AcceptanceEstimates(k=3, prior=0.5, rate=0.5)
    for _ in range(20):
        est.record(7, 3, 3)  # request 7 accepts everything
        est.record(8, 3, 0)  # request 8 rejects its first draft every time
    assert est.of(7).min() > 0.95
    assert est.of(8)[0] < 0.05
    assert est.of(8)[1] == pytest.approx(0.5 + 0.0, abs=0.3)  # never observed past the rejection
    est.forget(7)
    assert np.array_equal(est.of(7), est.engine)
