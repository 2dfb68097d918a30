"""The speculation policy picks the analytically best number of drafts on synthetic inputs."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable

import numpy as np
import pytest

from specinfer.spec_decode.policy import (GoodputPolicy, AcceptanceEstimates, StepCostModel, TimeTable,
                                          choose_num_drafts,
                                          drafts_that_shorten_the_run, expected_emitted, expected_emitted_rows,
                                          linear_cost)


def brute_force(accept, max_drafts, seconds):
    best, best_d = -1.0, None
    for d in itertools.product(*[range(m + 1) for m in max_drafts]):
        g = goodput(accept, np.array(d), seconds)
        if g > best + 1e-12:
            best, best_d = g, d
    return best, np.array(best_d)


def goodput(accept, d, seconds):
    emitted = sum(expected_emitted(accept[i], int(di)) for i, di in enumerate(d))
    return emitted / float(seconds(np.array([d.sum()]))[0])


def choose(accept, max_drafts, base, cost):  # the linear cost model (c0, c_t, c_d)
    return choose_num_drafts(accept, max_drafts, linear_cost(*cost, base))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_choice_equals_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    R, K = int(rng.integers(1, 4)), 4
    accept = rng.uniform(0.0, 1.0, size=(R, K))
    max_drafts = rng.integers(0, K + 1, size=R)
    cost = (float(rng.uniform(0.001, 0.05)), float(rng.uniform(1e-4, 0.01)), float(rng.uniform(0, 0.01)))
    base = int(rng.integers(R, 3 * R + 1))
    seconds = linear_cost(*cost, base)
    best, _ = brute_force(accept, max_drafts, seconds)
    d = choose_num_drafts(accept, max_drafts, seconds)
    assert np.all(d <= max_drafts)
    assert goodput(accept, d, seconds) == pytest.approx(best, rel=1e-9)


def choose_num_drafts_by_heap(accept: np.ndarray, max_drafts: np.ndarray,
                              seconds: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """choose_num_drafts as a heap merge, one marginal gain at a time (the reference: one marginal gain at a time)."""
    R = accept.shape[0]
    d = np.zeros(R, dtype=np.int64)
    order, gains = [], []  # request of each successive best marginal gain, gains decreasing
    heap = [(-float(accept[i, 0]), i) for i in range(R) if max_drafts[i] > 0]
    heapq.heapify(heap)
    taken = np.zeros(R, dtype=np.int64)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        order.append(i)
        gains.append(-neg_gain)
        taken[i] += 1
        if taken[i] < max_drafts[i]:
            heapq.heappush(heap, (neg_gain * float(accept[i, taken[i]]), i))
    if not gains:
        return d
    emitted = R + np.concatenate([[0.0], np.cumsum(gains)])
    goodput = emitted / np.maximum(np.asarray(seconds(np.arange(len(gains) + 1)), dtype=np.float64), 1e-12)
    best = int(np.flatnonzero(goodput >= goodput.max() * (1 - 1e-12))[0])
    np.add.at(d, np.asarray(order[:best], dtype=np.int64), 1)
    return d


@pytest.mark.parametrize("seed", range(30))
def test_sorted_choice_equals_the_heap_merge_ties_included(seed):
    """The one-sort choice takes the same drafts as the heap merge, one gain at a time, at batch
    sizes the brute force cannot reach, with ties (acceptance 1, repeated values) and caps."""
    rng = np.random.default_rng(500 + seed)
    R, K = int(rng.integers(1, 65)), int(rng.integers(1, 9))
    accept = rng.choice([0.0, 0.25, 0.5, 0.9, 1.0], size=(R, K)) if seed % 2 else rng.uniform(0, 1, (R, K))
    max_drafts = rng.integers(0, K + 1, size=R)
    seconds = linear_cost(float(rng.uniform(0.001, 0.05)), float(rng.uniform(1e-4, 0.01)),
                          float(rng.uniform(0, 0.01)), int(rng.integers(R, 3 * R + 1)))
    np.testing.assert_array_equal(choose_num_drafts(accept, max_drafts, seconds),
                                  choose_num_drafts_by_heap(accept, max_drafts, seconds))
    d = rng.integers(0, K + 1, size=R)
    np.testing.assert_allclose(expected_emitted_rows(accept, d),
                               [expected_emitted(accept[i], int(d[i])) for i in range(R)], rtol=1e-12)


def test_time_table_slope_is_the_least_squares_line():
    t = TimeTable(1.0)
    pts = {1: 0.010, 5: 0.011, 9: 0.016, 17: 0.030}
    for c, v in pts.items():
        t.record(c, v)
    slope = np.polyfit(list(pts), list(pts.values()), 1)[0]
    assert t.at([20])[0] == pytest.approx(0.030 + 3 * slope, rel=1e-9)
    assert t.at([3])[0] == pytest.approx(0.0105, rel=1e-9)  # interpolated
    t.record(20, 0.040)  # a new count: the table is rebuilt
    assert t.at([20])[0] == pytest.approx(0.040)


def test_time_table_first_time_of_a_count_is_provisional():
    """A first step of a new shape pays one-off costs: its time is replaced by the second one, and
    left out of the table while two counts have been seen twice."""
    t = TimeTable(0.2)
    for c, v in ((1, 0.010), (1, 0.010), (2, 0.011), (2, 0.011)):
        t.record(c, v)
    t.record(5, 0.500)  # a warm-up outlier, seen once: the line through the confirmed counts
    assert t.at([5])[0] == pytest.approx(0.014, rel=1e-9)
    t.record(5, 0.013)  # the second time replaces the first (an average would keep 0.40)
    assert t.at([5])[0] == pytest.approx(0.013, rel=1e-9)
    t.record(5, 0.023)  # from then on averaged at the table's rate
    assert t.at([5])[0] == pytest.approx(0.013 + 0.2 * 0.010, rel=1e-9)


@pytest.mark.parametrize("seed", range(30))
def test_choice_is_optimal_for_a_step_cost_flat_then_rising(seed):
    """A CPU-like step cost: about flat up to some tokens (weight-bandwidth bound), then linear;
    the policy evaluates every total and must still find the brute-force optimum."""
    rng = np.random.default_rng(100 + seed)
    R, K = int(rng.integers(1, 4)), 4
    accept = rng.uniform(0.0, 1.0, size=(R, K))
    max_drafts = rng.integers(0, K + 1, size=R)
    base, knee = R, int(rng.integers(R, R + 8))
    c0, slope, flat = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.001, 0.05)), float(rng.uniform(0, 1e-3))

    def seconds(n):
        t = base + np.asarray(n)
        return c0 + flat * t + slope * np.maximum(t - knee, 0)

    best, _ = brute_force(accept, max_drafts, seconds)
    d = choose_num_drafts(accept, max_drafts, seconds)
    assert np.all(d <= max_drafts)
    assert goodput(accept, d, seconds) == pytest.approx(best, rel=1e-9)


def test_speculation_that_does_not_pay_gets_k_zero():
    accept = np.full((3, 4), 0.05)
    # a step's fixed cost is tiny and each token costs as much as a whole step: drafts never pay
    assert choose(accept, np.full(3, 4), 3, (1e-4, 0.01, 0.01)).tolist() == [0, 0, 0]


def test_high_acceptance_with_a_fixed_cost_step_drafts_the_most():
    accept = np.full((2, 5), 0.95)
    assert choose(accept, np.array([5, 3]), 2, (0.05, 1e-5, 1e-5)).tolist() == [5, 3]


def test_requests_with_better_acceptance_draft_more():
    accept = np.array([[0.9] * 4, [0.3] * 4])
    d = choose(accept, np.array([4, 4]), 2, (0.01, 0.002, 0.001))
    assert d[0] > d[1]


def test_cost_model_interpolates_measured_step_times():
    rng = np.random.default_rng(1)
    model = StepCostModel(rate=0.2, min_steps=8)
    assert not model.ready
    truth = {1: 0.100, 2: 0.104, 5: 0.113, 300: 0.400}
    for _ in range(50):
        for t, sec in truth.items():
            model.record(t, sec + rng.normal(0, 1e-5), draft_tokens=4, draft_seconds=0.008)
    assert model.ready
    got = model.target_seconds(np.array([1, 2, 5, 300]))
    assert got == pytest.approx(list(truth.values()), abs=1e-4)
    assert model.target_seconds(np.array([3]))[0] == pytest.approx((0.104 * 2 + 0.113) / 3, abs=1e-4)
    assert model.draft_seconds(np.array([4, 2])) == pytest.approx([0.008, 0.004])  # one count seen: proportional
    # beyond the largest count seen: extended with a non-negative slope
    assert model.target_seconds(np.array([400]))[0] > 0.400
    assert model.step_seconds(1)(np.array([0, 4]))[1] == pytest.approx(0.113 + 4 * 0.002, abs=1e-4)


def test_a_proposers_fixed_cost_per_step_is_not_charged_to_each_draft():
    """EAGLE runs its head over the step's confirmed tokens before its first draft: proposer time
    F + c n. Dividing it by the drafts made each draft look dearer the fewer were drafted (at
    n = 1: F + c per draft), so the policy drafted less and less; a table of D(n) keeps the
    marginal cost c, and the policy picks the analytically best n."""
    F, c, S = 0.004, 0.001, 0.030  # fixed proposer part, per draft, a flat target step
    model = StepCostModel(rate=0.2, min_steps=1)
    for _ in range(20):
        for n in (0, 1, 4):
            model.record(1 + n, S, draft_tokens=n, draft_seconds=F + c * n)  # 1 decode + n drafts verified
    assert model.draft_seconds(np.array([2, 3])) == pytest.approx([F + 2 * c, F + 3 * c])
    accept = np.array([[0.5, 0.5, 0.5, 0.5]])
    d = choose_num_drafts(accept, np.array([4]), model.step_seconds(1))
    goodput = [(1 + sum(0.5 ** (j + 1) for j in range(n))) / (S + F + c * n) for n in range(5)]
    assert d[0] == int(np.argmax(goodput)) == 4


def test_every_step_drafting_k_still_separates_verification_from_drafting_cost():
    """The first design fitted one line on (1, target tokens, drafted tokens); when every step
    drafts k those columns are collinear and the fit put the step's cost on drafting, so the
    policy stopped drafting where drafts paid. Measured per token count, it keeps drafting."""
    rng = np.random.default_rng(0)
    pol = GoodputPolicy(4)
    pol.observe_step(300, 0.30, 0, 0.0)  # a prompt's prefill
    for _ in range(60):  # then decodes verifying 4 drafts: 100 ms + 3 ms per draft, drafting ~free
        pol.observe_step(5, 0.112 + rng.normal(0, 0.002), 4, 0.0004)
    for _ in range(30):
        pol.observe_verification([7], [4], [2])  # two of four drafts accepted every time
    assert pol.num_drafts([7], np.array([4]), 1)[0] >= 2


def test_acceptance_estimates_follow_what_was_accepted():
    est = AcceptanceEstimates(k=3, prior=0.5, rate=0.5)
    for _ in range(20):
        est.record(7, 3, 3)  # request 7 accepts everything
        est.record(8, 3, 0)  # request 8 rejects its first draft every time
    assert est.of(7).min() > 0.95
    assert est.of(8)[0] < 0.05
    est.forget(7)
    assert np.array_equal(est.of(7), est.of(12345))  # back to the engine-wide estimate


def test_acceptance_estimates_equal_the_array_arithmetic(seed=0):
    """The per-position Python arithmetic equals the array form of the EWMA updates (an
    independent numpy reference, run alongside), bit for bit, over random verifications."""
    rng = np.random.default_rng(seed)
    k, prior, rate, engine_rate = 4, 0.6, 0.2, 0.03
    est = AcceptanceEstimates(k, prior=prior, rate=rate, engine_rate=engine_rate)
    eng, eng_seen, count = np.full(k, prior), np.zeros(k, bool), np.zeros(k)
    own = {}

    def filled(e, s):
        last = np.maximum.accumulate(np.where(s, np.arange(k), -1))
        return np.where(s | (last < 0), e, e[np.maximum(last, 0)])

    for _ in range(300):
        cid, n, a = int(rng.integers(0, 6)), int(rng.integers(0, k + 2)), int(rng.integers(0, k + 1))
        a = min(a, n)
        est.record(cid, n, a)
        n = min(n, k)
        if n <= 0:
            continue
        if cid not in own:
            own[cid] = (filled(eng, eng_seen), eng_seen.copy())
        e, s = own[cid]
        seen = slice(0, min(n, a + 1))
        hit = (np.arange(n) < a).astype(np.float64)[seen]
        e[seen] += rate * (hit - e[seen])
        s[seen] = True
        count[seen] += 1
        eng[seen] += np.maximum(1.0 / (count[seen] + 1), engine_rate) * (hit - eng[seen])
        eng_seen[seen] = True
        for c, (e2, s2) in own.items():
            assert np.array_equal(est.of(c), filled(e2, s2))
        assert np.array_equal(est.of(999), filled(eng, eng_seen)) and np.array_equal(est.engine, eng)


def test_unobserved_positions_follow_the_last_observed_one():
    est = AcceptanceEstimates(k=4, prior=0.6, rate=0.5)
    for _ in range(10):
        est.record(1, 2, 2)  # only positions 0 and 1 drafted, both accepted
    assert est.of(1)[1] > 0.99 and est.of(1)[3] == est.of(1)[1]


# --- through the engine ---------------------------------------------------------------------

def _spec(draft, **kw):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, "policy": "goodput", **kw}


def _prompts(n):
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (int(torch.randint(3, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_goodput_policy_keeps_greedy_output_exact(target_and_draft):
    from specinfer import Generator, SamplingParams

    target, draft = target_and_draft
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = _prompts(8)
    want = [o.token_ids for o in Generator(str(target), block_size=4).generate(prompts, params, use_tqdm=False)]
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=32, speculative=_spec(draft))
    gen.engine.policy.cost.min_steps = 2  # choose from the start of this short run
    assert [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)] == want
    assert gen.engine.policy.cost.num_steps > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_goodput_policy_drafts_little_when_drafts_fail_and_k_when_they_all_pass(tiny_dir, overlap):
    """With costs fixed (a step's fixed cost 10 ms, 1 ms per token), once the engine has learnt
    acceptance on a first batch, an unrelated draft (every draft rejected) gets no drafts while
    the target drafting for itself gets k. In the overlapped loop the choice is made beside the
    forward, from estimates one verification old (StepProposing.plan): a probe that failed is
    followed by one more proposal before the policy knows."""
    from specinfer import Generator, SamplingParams

    target, _ = tiny_dir("llama", False)
    unrelated, _ = tiny_dir("llama", False, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = _prompts(2)
    drafted = {}
    for name, draft in (("unrelated", unrelated), ("self", target)):
        gen = Generator(str(target), block_size=4, speculative=_spec(draft), overlap_steps=overlap)
        assert gen.engine.proposing.plans_beside_forward == overlap
        cost = gen.engine.policy.cost
        cost.min_steps, cost.step_seconds = 0, lambda base: linear_cost(0.01, 0.001, 0.001, base)
        gen.generate(prompts, params, use_tqdm=False)  # learn
        gen.reset_metrics()
        gen.generate(_prompts(4)[2:], params, use_tqdm=False)
        m = gen.spec_metrics()
        drafted[name] = m["num_draft_tokens"] / max(m["num_drafts"], 1), m["num_draft_tokens"]
    assert drafted["self"][0] >= 3.5  # k, but near max_tokens fewer drafts fit
    assert drafted["unrelated"][1] < (0.15 if overlap else 0.1) * drafted["self"][1]


def test_policy_is_validated():
    from specinfer.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculative.policy"):
        SpeculativeConfig(method="ngram", policy="fastest")


def test_a_request_held_at_zero_drafts_is_probed_again():
    """Exploration: after its drafts all failed, a request gets none, but its estimate drifts
    back so that within a bounded number of steps it drafts again; a request whose probes keep
    failing stays mostly at zero."""
    pol = GoodputPolicy(k=4, probe_after=8, max_probe_after=64)
    for _ in range(pol.cost.min_steps):  # c0 = 10 ms, 1 ms per target token, 1 ms per drafted token
        pol.observe_step(1, 0.011, 0, 0.0)
        pol.observe_step(5, 0.015, 4, 0.004)
        pol.observe_step(3, 0.013, 0, 0.0)
    for _ in range(20):  # request 7's drafts always fail
        pol.observe_verification([7], [4], [0])
    assert pol.num_drafts([7], np.array([4]), 1)[0] == 0
    probes = []
    for step in range(200):
        d = int(pol.num_drafts([7], np.array([4]), 1)[0])
        if d:
            probes.append(step)
            pol.observe_verification([7], [d], [0])  # the probe fails again
    assert probes, "never probed again"
    gaps = np.diff([-1] + probes).tolist()
    # the first probe after probe_after held steps (the check above was the first; the 20 failures
    # were ordinary drafts, not probes: they do not back the wait off), then each failed probe
    # doubles the wait up to its cap
    assert gaps[:4] == [7, 16, 32, 64] and all(g == 64 for g in gaps[4:]), gaps
    # an accepted probe resets the wait and lets the estimate recover
    for _ in range(100):
        d = int(pol.num_drafts([7], np.array([4]), 1)[0])
        if d:
            pol.observe_verification([7], [d], [d])
    assert pol.num_drafts([7], np.array([4]), 1)[0] > 0


def test_the_default_policy_is_goodput_for_chains_and_fixed_for_trees():
    """Issue 11: speculation chooses k per request with no flags; a token tree (whose shape is
    the user's choice) keeps it, and "fixed" / an explicit "goodput" still mean what they say."""
    from specinfer.spec_decode.config import SpeculativeConfig

    assert SpeculativeConfig(method="ngram").policy == "auto"
    assert SpeculativeConfig(method="ngram").uses_goodput_policy
    assert SpeculativeConfig(method="ngram", policy="goodput").uses_goodput_policy
    assert not SpeculativeConfig(method="ngram", policy="fixed").uses_goodput_policy
    tree = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                             token_tree=[[0], [1], [0, 0]])
    assert tree.policy == "auto" and not tree.uses_goodput_policy
    with pytest.raises(ValueError, match="goodput"):
        SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2,
                          token_tree=[[0], [1]], policy="goodput")


def test_an_engine_with_no_policy_flag_chooses_drafts_for_goodput(target_and_draft):
    """No flags: the engine holds the goodput policy and it chooses the drafts (a spy on its
    choice), and greedy output equals the target alone; policy "fixed" holds none."""
    from specinfer import Generator, SamplingParams

    target, draft = target_and_draft
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = _prompts(4)
    want = [o.token_ids for o in Generator(str(target), block_size=4).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    gen = Generator(str(target), block_size=4, speculative=spec)
    pol = gen.engine.policy
    assert pol is not None
    pol.cost.min_steps = 2
    chosen = []
    choose = pol.num_drafts
    pol.num_drafts = lambda *a: chosen.append(choose(*a)) or chosen[-1]
    assert [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)] == want
    assert chosen and pol.cost.num_steps > 0
    fixed = Generator(str(target), block_size=4, speculative={**spec, "policy": "fixed"})
    assert fixed.engine.policy is None


def test_probes_go_where_a_draft_is_cheap_and_wait_where_it_costs_a_token():
    """A compute-bound large batch (a draft costs what a decode token costs: 5 ms + 1 ms per
    token) gets no probes for its held requests, since even a draft accepted at the prior 0.6
    would lower goodput; the same held request alone in a step is probed. Probing every held
    request every few steps cost 5 % of throughput at batch 64 (docs/lab/2026-12-notebook.md)."""
    def policy():
        pol = GoodputPolicy(k=4, probe_after=2, max_probe_after=2)
        for t in (1, 2, 5, 64, 65, 68, 128, 300):  # S(T) = 5 ms + 1 ms per token, no drafting cost
            pol.observe_step(t, 0.005 + 0.001 * t, 0, 0.0)
        return pol

    big, R = policy(), 64
    for c in range(R):
        for _ in range(10):
            big.observe_verification([c], [4], [0])
    probes = sum(int(big.num_drafts(list(range(R)), np.full(R, 4), R).sum()) for _ in range(10))
    assert probes == 0
    one = policy()
    for _ in range(10):
        one.observe_verification([0], [4], [0])
    probes = sum(int(one.num_drafts([0], np.array([4]), 1).sum()) for _ in range(10))
    assert probes >= 3  # probed every other step, the failures not reported here
    # the marginal rule: with 64 requests, (E + 0.6) / S(T + 1) < E / S(T) since 0.6 / 64 < 1 / 69


# --- a whole batch: drafts only where they can shorten the run ------------------------------

def test_in_a_whole_batch_only_requests_that_would_finish_last_keep_drafts():
    """Projected end M = max(horizon, max tokens_left / E(d)): a request that finishes within M
    at one token per step loses its drafts; the one that sets M keeps them."""
    accept = np.full((3, 4), 0.9)
    chosen = np.array([4, 4, 0])
    # request 2 drafts nothing and has 40 tokens left: the run takes >= 40 steps, so request 0
    # (20 left) and request 1 (40 left) finish in time at one token per step
    assert drafts_that_shorten_the_run(accept, chosen, np.array([20, 40, 40])).tolist() == [0, 0, 0]
    # request 1 has 100 left: it sets the end (100 / E(4) < 100) and keeps its drafts
    assert drafts_that_shorten_the_run(accept, chosen, np.array([20, 100, 40])).tolist() == [0, 4, 0]
    # a lone request keeps its drafts; a request not chosen for (horizon) sets the end as well
    assert drafts_that_shorten_the_run(accept[:1], np.array([4]), np.array([30])).tolist() == [4]
    assert drafts_that_shorten_the_run(accept[:1], np.array([4]), np.array([30]), horizon=30).tolist() == [0]
    # every request drafting at the same rate from the same start: all keep their drafts
    assert drafts_that_shorten_the_run(accept, np.array([4, 4, 4]), np.array([48, 48, 48])).tolist() == [4, 4, 4]


def test_generate_tells_the_policy_tokens_left_and_stream_and_waiting_requests_do_not(target_and_draft):
    """Generator.generate marks its requests as a whole batch: while all of them run and none
    waits, the policy is given each request's tokens left; stream() and a queue of waiting
    requests (max_num_seqs below the batch) give it none. Greedy output stays exact."""
    from specinfer import Generator, SamplingParams

    target, draft = target_and_draft
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (6, 30, 12)]
    prompts = _prompts(3)
    want = [o.token_ids for o in Generator(str(target), block_size=4).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    seen = {}
    for name, kw in (("whole", {}), ("queued", {"max_num_seqs": 2})):
        gen = Generator(str(target), block_size=4, speculative=spec, **kw)
        pol = gen.engine.policy
        pol.cost.min_steps = 2
        calls = []
        choose = pol.num_drafts
        pol.num_drafts = lambda *a: calls.append(a) or choose(*a)
        assert [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)] == want
        seen[name] = [a[3] for a in calls]
        n = len(calls)
        got = [o.token_ids for o in gen.stream(prompts, params) if o.finished]
        assert sorted(got) == sorted(want)
        assert all(a[3] is None for a in calls[n:])  # streamed: every request's progress counts
    assert seen["whole"] and all(left is not None for left in seen["whole"])
    lefts = [left for left in seen["whole"] if len(left)]
    assert lefts and max(int(left.max()) for left in lefts) <= 30
    assert any(left is None for left in seen["queued"])  # while the third prompt waited


def test_prepared_cost_curve_reads_the_same_values():
    """The curve C(0 .. max) built beside the forward (StepCostModel.prepare) gives the very
    values of the direct computation; another base, a range past it, or a new record computes
    directly."""
    cm = StepCostModel(min_steps=0)
    for t, secs, d, dsecs in [(8, 0.010, 0, 0.0), (12, 0.012, 4, 0.001), (40, 0.020, 32, 0.004),
                              (12, 0.013, 4, 0.002)]:
        cm.record(t, secs, d, dsecs)
    direct = cm.step_seconds(10)(np.arange(41))
    cm.prepare(10, 40)
    assert cm._curve[0] == 10
    prepared = cm.step_seconds(10)
    assert np.array_equal(prepared(np.arange(41)), direct)
    assert np.array_equal(prepared(np.arange(5, 12)), direct[5:12])
    past = np.arange(30, 50)  # beyond the curve: computed directly
    assert np.array_equal(prepared(past), cm.target_seconds(10 + past) + cm.draft_seconds(past))
    assert np.array_equal(cm.step_seconds(11)(np.arange(4)), cm.target_seconds(11 + np.arange(4))
                          + cm.draft_seconds(np.arange(4)))
    cm.record(10, 0.5, 0, 0.0)  # a new measurement: the curve is stale
    assert cm._curve[0] is None
    assert not np.array_equal(cm.step_seconds(10)(np.arange(41)), direct)
