"""Statistical and exact tests of specinfer.sample.rejection_sampler.

The goodness-of-fit harness decodes fixed-length sequences by repeated speculative steps
(propose from q, verify against p, continue from the first unemitted position) and compares
the joint law of the first ``n_check`` emitted tokens with the exact target law. Target and
draft distributions are fixed per absolute position, i.e. NOT conditioned on the prefix, so
the exact law of the target-only sequence is the product of the per-position target
distributions. Pearson chi-square, cells with expected count < 5 pooled, alpha = 1e-3, fixed
seeds; a token emitted where the target has probability 0 fails outright.

The same harness must reject deliberately broken samplers (residual drawn from p, from q,
always accept, uniform fixed at 0, `<=` instead of `<`); they are made by monkeypatching the
module's small internal functions, never by flags in product code.

Randomness is counter-based: each simulated request has its own seed and every draw is keyed
on (seed, output position, purpose), so the harness passes each request's current output
position as its stream position.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specinfer.sample import RandomStreams, SamplingMetadata, probs_from_logits, rejection_sample
from specinfer.sample import rejection_sampler as rs
from specinfer.sample.random_streams import ACCEPT
from stats import ALPHA, chi_square_pvalue  # noqa: E402

NUM_SAMPLES = 120_000


def product_law(p: torch.Tensor, n_check: int) -> torch.Tensor:  # [T, V] -> [V ** n_check]
    law = p[0]
    for t in range(1, n_check):
        law = (law.unsqueeze(1) * p[t].unsqueeze(0)).reshape(-1)
    return law


def streams(num: int, seed: int, positions=None) -> RandomStreams:
    """num requests with distinct seeds derived from ``seed``, at the given output positions."""
    seeds = np.arange(num, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    pos = np.zeros(num, np.int64) if positions is None else np.asarray(positions, np.int64)
    return RandomStreams.build(seeds, pos)


def generate_prefixes(p, q, k, n_check, seed, fixed_drafts=None, vary_k=False,
                      num_samples=NUM_SAMPLES, vary_split=False):
    """Counts of the first ``n_check`` tokens over ``num_samples`` speculative decodes.

    p, q: float[T, V] per absolute position (T >= n_check + k). Drafts are sampled from
    q, or are ``fixed_drafts[t]`` with ``draft_probs=None`` (model-free proposer). With
    ``vary_k`` each request proposes a random number of drafts in 0..k at every step. With
    ``vary_split`` a random half of the requests has no bonus row (a proposal split by the
    token budget: when all drafts are accepted nothing else is emitted).
    """
    vocab = p.shape[1]
    g_draft = torch.Generator().manual_seed(seed)
    all_seeds = np.arange(num_samples, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    seq = torch.full((num_samples, n_check), -1, dtype=torch.int64)
    length = torch.zeros(num_samples, dtype=torch.int64)
    cols = torch.arange(k + 1)
    while True:
        active = (length < n_check).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        num = active.numel()
        start = length[active]
        if vary_k:
            num_draft = torch.randint(0, k + 1, (num,), generator=g_draft)
        else:
            num_draft = torch.full((num,), k)
        pos = start.unsqueeze(1) + cols  # [A, k + 1]
        draft_mask = cols[:k].unsqueeze(0) < num_draft.unsqueeze(1)  # [A, k]
        if fixed_drafts is None:
            qrows = q[pos[:, :k]]  # [A, k, V]
            drafts = torch.multinomial(qrows.reshape(-1, vocab), 1, generator=g_draft)
            drafts = drafts.reshape(num, k)[draft_mask]
            draft_probs = qrows[draft_mask]
        else:
            drafts, draft_probs = fixed_drafts[pos[:, :k]][draft_mask], None
        has_bonus = torch.ones(num, dtype=torch.bool)
        if vary_split:
            has_bonus = (torch.rand(num, generator=g_draft) < 0.5) | (num_draft == 0)
        rows = cols.unsqueeze(0) < (num_draft + has_bonus).unsqueeze(1)
        target_probs = p[pos][rows]
        cu = torch.nn.functional.pad(num_draft.cumsum(0), (1, 0))
        st = RandomStreams.build(all_seeds[active.numpy()], start.numpy())
        out, num_emitted = rejection_sample(
            drafts, cu, draft_probs, target_probs, torch.zeros(num, dtype=torch.bool), st, has_bonus)
        assert bool((num_emitted >= 1).all()) and bool((num_emitted <= num_draft + 1).all())
        for j in range(k + 1):
            m = (j < num_emitted) & (start + j < n_check)
            seq[active[m], start[m] + j] = out[m, j]
        length[active] = torch.clamp(start + num_emitted, max=n_check)
    code = torch.zeros(num_samples, dtype=torch.int64)
    for t in range(n_check):
        code = code * vocab + seq[:, t]
    return torch.bincount(code, minlength=vocab ** n_check)


def make_distributions(case: str, k: int, n_check: int, vocab: int = 5, seed: int = 0):
    """Target p and draft q, float64[T, V], processed by the SAME logits processor."""
    g = torch.Generator().manual_seed(seed)
    num_pos = n_check + k
    target_logits = 1.5 * torch.randn(num_pos, vocab, generator=g, dtype=torch.float64)
    draft_logits = target_logits + 1.5 * torch.randn(num_pos, vocab, generator=g,
                                                     dtype=torch.float64)
    if case == "plain":
        meta = SamplingMetadata.build([1.0] * num_pos)
    elif case == "top_k_top_p":
        meta = SamplingMetadata.build([1.0] * num_pos, top_k=[3] * num_pos, top_p=[0.8] * num_pos)
    elif case == "temp_min_p":
        meta = SamplingMetadata.build([0.7] * num_pos, min_p=[0.05] * num_pos)
    else:
        raise AssertionError(case)
    return probs_from_logits(target_logits, meta), probs_from_logits(draft_logits, meta)


def n_check_for(k: int) -> int:
    return 2 if k == 1 else 3


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", ["plain", "top_k_top_p", "temp_min_p"])
def test_joint_law_matches_target(case, k):
    n_check = n_check_for(k)
    p, q = make_distributions(case, k, n_check)
    if case == "top_k_top_p":  # the filters really cut something from both p and q
        assert bool(((p == 0).sum(1) >= 2).all()) and bool(((q == 0).sum(1) >= 2).all())
    counts = generate_prefixes(p, q, k, n_check, seed=10 + k)
    assert chi_square_pvalue(counts, product_law(p, n_check)) > ALPHA


def test_joint_law_float32():
    """Production runs float32: the same law with float32 target and draft probabilities."""
    p, q = make_distributions("top_k_top_p", 3, 3, seed=4)
    counts = generate_prefixes(p.float(), q.float(), 3, 3, seed=31)
    assert chi_square_pvalue(counts, product_law(p, 3)) > ALPHA


def test_joint_law_with_split_proposals():
    """Requests without a bonus row (proposals split by the token budget) keep the law."""
    p, q = make_distributions("plain", 3, 3, seed=5)
    counts = generate_prefixes(p, q, 3, 3, seed=17, vary_k=True, vary_split=True)
    assert chi_square_pvalue(counts, product_law(p, 3)) > ALPHA


def test_joint_law_variable_proposal_lengths():
    p, q = make_distributions("plain", 3, 3, seed=1)
    counts = generate_prefixes(p, q, 3, 3, seed=7, vary_k=True)
    assert chi_square_pvalue(counts, product_law(p, 3)) > ALPHA


@pytest.mark.parametrize("k", [1, 3])
def test_joint_law_model_free_proposer(k):
    """One-hot q (draft_probs=None): fixed draft token per position, like an n-gram hit."""
    n_check = n_check_for(k)
    p, _ = make_distributions("plain", k, n_check, seed=2)
    fixed = torch.tensor([1, 3, 0, 2, 4, 1, 2])[: n_check + k]
    counts = generate_prefixes(p, None, k, n_check, seed=20 + k, fixed_drafts=fixed)
    assert chi_square_pvalue(counts, product_law(p, n_check)) > ALPHA


BROKEN = {
    "residual_from_p": ("_residual", lambda target, draft: target),
    "residual_from_q": ("_residual", lambda target, draft: draft),
    "always_accept": ("_accept", lambda u, tp, dp: torch.ones_like(u, dtype=torch.bool)),
    "uniform_fixed_at_0": ("_draw_uniform",
                           lambda st, width, device:
                           torch.zeros(len(st), width, dtype=torch.float64, device=device)),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_harness_rejects_broken_sampler(broken, k, monkeypatch):
    n_check = n_check_for(k)
    p, q = make_distributions("plain", k, n_check)
    name, fake = BROKEN[broken]
    monkeypatch.setattr(rs, name, fake)
    counts = generate_prefixes(p, q, k, n_check, seed=10 + k)
    assert chi_square_pvalue(counts, product_law(p, n_check)) < ALPHA


# --- `<` versus `<=`: a discrete uniform on the grid {0, 1/4, 2/4, 3/4} ----------------------
# With every ratio p/q in {0, 1/4, 1/2, 3/4} or >= 1 (dyadic, exact in float64), the grid draw
# gives P(u < p/q) = min(1, p/q) exactly, so the correct sampler stays lossless, while `<=`
# accepts with probability p/q + 1/4, including tokens with p = 0.
GRID = 4
DYADIC_Q = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
DYADIC_P = torch.tensor([0.25, 0.25, 0.0, 0.5], dtype=torch.float64)  # p/q = 1/2, 1, 0, 4


def _grid_uniform(st, width, device):
    return torch.floor(st.uniform(ACCEPT, width, device) * GRID) / GRID


@pytest.mark.parametrize("comparison,should_pass", [
    (lambda u, tp, dp: u < tp / dp, True),
    (lambda u, tp, dp: u <= tp / dp, False),
], ids=["strict_lt", "broken_le"])
def test_grid_uniform_separates_lt_from_le(comparison, should_pass, monkeypatch):
    k, n_check = 3, 3
    p = DYADIC_P.expand(n_check + k, -1).clone()
    q = DYADIC_Q.expand(n_check + k, -1).clone()
    monkeypatch.setattr(rs, "_draw_uniform", _grid_uniform)
    monkeypatch.setattr(rs, "_accept", comparison)
    counts = generate_prefixes(p, q, k, n_check, seed=5)
    assert (chi_square_pvalue(counts, product_law(p, n_check)) > ALPHA) == should_pass


def test_strict_comparison_rejects_zero_target_prob_at_u_zero(monkeypatch):
    """u == 0 and p(x) == 0: 0 < 0 is false, so the draft is rejected; p(x) > 0 accepts."""
    monkeypatch.setattr(rs, "_draw_uniform", BROKEN["uniform_fixed_at_0"][1])
    target = torch.stack([DYADIC_P, DYADIC_P, DYADIC_P, DYADIC_P])  # 2 requests x (1 + 1)
    draft = torch.stack([DYADIC_Q, DYADIC_Q])
    out, num_emitted = rejection_sample(
        torch.tensor([2, 0]), torch.tensor([0, 1, 2]), draft, target,
        torch.tensor([False, False]), streams(2, 0))
    assert num_emitted.tolist() == [1, 2]
    assert out[0, 0].item() != 2 and out[1, 0].item() == 0


# --- exact edge cases, float64 ----------------------------------------------------------------

def _flat_batch(num_requests, k, p_row, q_row, seed):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q_row.expand(num_requests * k, -1), 1, replacement=True,
                               generator=g).squeeze(1)
    target = p_row.expand(num_requests * (k + 1), -1).clone()
    draft = q_row.expand(num_requests * k, -1).clone()
    cu = torch.arange(num_requests + 1) * k
    return drafts, cu, draft, target


def test_p_equal_q_accepts_everything_and_bonus_is_p():
    p = torch.softmax(torch.tensor([0.3, -1.0, 2.0, 0.0, 1.1], dtype=torch.float64), 0)
    num, k = 50_000, 3
    drafts, cu, draft, target = _flat_batch(num, k, p, p, seed=0)
    out, num_emitted = rejection_sample(drafts, cu, draft, target, torch.zeros(num, dtype=torch.bool),
                                        streams(num, 1))
    assert bool((num_emitted == k + 1).all())
    assert torch.equal(out[:, :k], drafts.reshape(num, k))
    assert chi_square_pvalue(torch.bincount(out[:, k], minlength=5), p) > ALPHA


def test_draft_mass_where_target_has_none_is_always_rejected():
    p = torch.tensor([0.4, 0.0, 0.3, 0.3, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.2], dtype=torch.float64)
    num = 20_000
    drafts, cu, draft, target = _flat_batch(num, 1, p, q, seed=3)
    out, num_emitted = rejection_sample(drafts, cu, draft, target, torch.zeros(num, dtype=torch.bool),
                                        streams(num, 4))
    bad = (drafts == 1) | (drafts == 4)
    assert bad.sum() > 10_000
    assert bool((num_emitted[bad] == 1).all())
    emitted = out[out >= 0]
    assert bool((p[emitted] > 0).all())


def test_one_hot_target_emits_only_its_argmax():
    p = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.full((5,), 0.2, dtype=torch.float64)
    num, k = 20_000, 3
    drafts, cu, draft, target = _flat_batch(num, k, p, q, seed=5)
    out, num_emitted = rejection_sample(drafts, cu, draft, target, torch.zeros(num, dtype=torch.bool),
                                        streams(num, 6))
    leading = (drafts.reshape(num, k) == 2).long().cumprod(1).sum(1)
    assert torch.equal(num_emitted.long(), leading + 1)
    cols = torch.arange(k + 1)
    assert bool((out[cols < num_emitted.unsqueeze(1)] == 2).all())
    assert bool((out[cols >= num_emitted.unsqueeze(1)] == -1).all())


def test_zero_residual_falls_back_to_p_without_nan(monkeypatch):
    p = torch.tensor([0.5, 0.0, 0.25, 0.25], dtype=torch.float64)
    residual = rs._residual(p.expand(3, -1), p.expand(3, -1))
    assert torch.equal(residual, p.expand(3, -1))
    monkeypatch.setattr(rs, "_accept", lambda u, tp, dp: torch.zeros_like(u, dtype=torch.bool))
    num = 40_000
    drafts, cu, draft, target = _flat_batch(num, 2, p, p, seed=7)
    out, num_emitted = rejection_sample(drafts, cu, draft, target, torch.zeros(num, dtype=torch.bool),
                                        streams(num, 8))
    assert bool((num_emitted == 1).all())
    assert chi_square_pvalue(torch.bincount(out[:, 0], minlength=4), p) > ALPHA


def test_zero_drafts_sample_the_bonus_row():
    p = torch.softmax(torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5], dtype=torch.float64), 0)
    num = NUM_SAMPLES
    out, num_emitted = rejection_sample(
        torch.zeros(0, dtype=torch.int64), torch.zeros(num + 1, dtype=torch.int64), None,
        p.expand(num, -1), torch.zeros(num, dtype=torch.bool), streams(num, 9))
    assert out.shape == (num, 1) and bool((num_emitted == 1).all())
    assert chi_square_pvalue(torch.bincount(out[:, 0], minlength=5), p) > ALPHA


def test_greedy_exact_match_path():
    """Requests: 3 drafts all matching; mismatch at position 1; 0 drafts; mismatch at 0."""
    argmax_rows = [1, 2, 3, 4, 4, 1, 0, 3, 2, 0]
    target = torch.nn.functional.one_hot(torch.tensor(argmax_rows), 5).double() * 0.5 + 0.1
    drafts = torch.tensor([1, 2, 3, 4, 2, 4])
    cu = torch.tensor([0, 3, 5, 5, 6])
    out, num_emitted = rejection_sample(drafts, cu, None, target, torch.ones(4, dtype=torch.bool),
                                        streams(4, 0))
    assert num_emitted.tolist() == [4, 2, 1, 1]
    assert out.tolist() == [[1, 2, 3, 4], [4, 1, -1, -1], [3, -1, -1, -1], [2, -1, -1, -1]]


def test_greedy_requests_ignore_their_streams():
    target = torch.softmax(torch.randn(6, 5, dtype=torch.float64), -1)
    outs = {tuple(rejection_sample(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2, 4]), None, target,
                                   torch.ones(2, dtype=torch.bool), streams(2, s, [s, 3 * s]))[0].flatten().tolist())
            for s in range(10)}
    assert len(outs) == 1


def _one(drafts, draft, target, seed, position, has_bonus=True):
    k = len(drafts)
    return rejection_sample(drafts, torch.tensor([0, k]), draft, target, torch.tensor([False]),
                            RandomStreams.build([seed], [position]), torch.tensor([has_bonus]))


def test_seeded_request_same_alone_and_in_batch():
    vocab, k = 7, 3
    g = torch.Generator().manual_seed(42)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), -1)
    draft = torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64), -1)
    drafts = torch.tensor([1, 4, 6])
    alone = [_one(drafts, draft, target, 1234, 7) for _ in range(2)]
    assert torch.equal(alone[0][0], alone[1][0])
    # Batch: another random request (2 drafts), a greedy one (1), ours, another seeded one (0).
    others_t = torch.softmax(torch.randn(6, vocab, generator=g, dtype=torch.float64), -1)
    others_q = torch.softmax(torch.randn(3, vocab, generator=g, dtype=torch.float64), -1)
    batch_target = torch.cat([others_t[:3], others_t[3:5], target, others_t[5:]])
    batch_draft = torch.cat([others_q, draft])
    batch_drafts = torch.cat([torch.tensor([0, 2, 5]), drafts])
    cu = torch.tensor([0, 2, 3, 6, 6])
    for seed in range(5):
        st = RandomStreams.build([seed, seed + 1, 1234, seed + 2], [seed, 0, 7, 3])
        out, num_emitted = rejection_sample(
            batch_drafts, cu, batch_draft, batch_target,
            torch.tensor([False, True, False, False]), st)
        assert torch.equal(out[2], alone[0][0][0]) and num_emitted[2] == alone[0][1][0]


def test_seeded_requests_differ_across_seeds_and_positions():
    """Guards the test above: with other seeds or output positions the output does vary."""
    target = torch.full((4, 6), 1 / 6, dtype=torch.float64)
    draft = torch.softmax(torch.arange(18, dtype=torch.float64).reshape(3, 6), -1)
    by_seed = {tuple(_one(torch.tensor([5, 5, 5]), draft, target, s, 0)[0][0].tolist()) for s in range(20)}
    by_pos = {tuple(_one(torch.tensor([5, 5, 5]), draft, target, 3, t)[0][0].tolist()) for t in range(20)}
    assert len(by_seed) > 3 and len(by_pos) > 3


def test_split_verification_emits_what_one_verification_would():
    """The core splits a proposal when the budget cuts it: verifying drafts 0..1 without a
    bonus row, then (if both were accepted) drafts 2..3 at output position P + 2, emits exactly
    what verifying all four at once emits, for every seed."""
    vocab, k, P = 6, 4, 11
    g = torch.Generator().manual_seed(3)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 2.0, -1)
    draft = torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64) * 2.0, -1)
    splits_completed = 0
    for seed in range(300):
        drafts = torch.multinomial(draft, 1, generator=g).squeeze(1)  # [k], each from its q
        out, n = _one(drafts, draft, target, seed, P)
        whole = out[0, :n[0]].tolist()
        o1, n1 = _one(drafts[:2], draft[:2], target[:2], seed, P, has_bonus=False)
        first = o1[0, :n1[0]].tolist()
        if first == drafts[:2].tolist():  # both accepted: the rest is verified next step
            splits_completed += 1
            o2, n2 = _one(drafts[2:], draft[2:], target[2:], seed, P + 2)
            first += o2[0, :n2[0]].tolist()
        assert first == whole, seed
    assert 20 < splits_completed < 280  # both branches were exercised


@pytest.mark.parametrize("bad,field", [
    (dict(draft_token_ids=torch.tensor([1, 2, 3])), "draft_token_ids"),
    (dict(target_probs=torch.full((3, 5), 0.2)), "target_probs"),
    (dict(draft_probs=torch.full((2, 4), 0.25)), "draft_probs"),
    (dict(is_greedy=torch.tensor([False])), "is_greedy"),
    (dict(streams=streams(1, 0)), "streams"),
    (dict(cu_num_draft=torch.tensor([0, 2, 1])), "cu_num_draft"),
])
def test_bad_input_names_the_field(bad, field):
    args = dict(draft_token_ids=torch.tensor([1, 2]), cu_num_draft=torch.tensor([0, 1, 2]),
                draft_probs=torch.full((2, 5), 0.2), target_probs=torch.full((4, 5), 0.2),
                is_greedy=torch.tensor([False, False]), streams=streams(2, 0))
    args.update(bad)
    if field == "cu_num_draft":
        args["target_probs"] = torch.full((3, 5), 0.2)
    with pytest.raises(ValueError, match=field):
        rejection_sample(**args)


@pytest.mark.parametrize("method", ["rejection", "typical"])
def test_greedy_chain_fast_path_equals_the_samplers(method):
    """The step sampler verifies all-greedy chains from the argmax alone (greedy_chains): the same
    tokens and counts as rejection sampling / typical acceptance over one-hot target probabilities,
    for mixed draft lengths, plain decodes (no drafts), split proposals (no bonus row) and ties."""
    from specinfer.engine.step_sampler import greedy_chains
    from specinfer.sample.typical_acceptance import typical_acceptance_sample

    gen = np.random.default_rng(0)
    V = 7
    for _ in range(200):
        R = int(gen.integers(1, 6))
        d = gen.integers(0, 5, size=R)
        bonus = gen.random(R) < 0.7
        bonus[d == 0] = True  # a request without drafts always samples its one row
        rows = d + bonus
        logits = torch.from_numpy(gen.integers(0, 3, size=(int(rows.sum()), V)).astype(np.float32))  # ties
        top = logits.max(-1).indices.numpy()
        # drafts: mostly the argmax (accepted), sometimes not
        drafts, r0 = [], 0
        for i in range(R):
            for j in range(int(d[i])):
                drafts.append(int(top[r0 + j]) if gen.random() < 0.7 else int(gen.integers(0, V)))
            r0 += int(rows[i])
        drafts = np.array(drafts, dtype=np.int64)
        flat, n_emit, acc = greedy_chains(top, drafts, rows, d)
        probs = torch.nn.functional.one_hot(logits.max(-1).indices, V).float()
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(d)]).astype(np.int64))
        streams = RandomStreams.build([0] * R, [0] * R)
        args = (torch.from_numpy(drafts), cu, None, probs, torch.ones(R, dtype=torch.bool), streams,
                torch.from_numpy(bonus))
        out, n = (rejection_sample(*args) if method == "rejection" else typical_acceptance_sample(*args))
        out, n = out.numpy(), n.numpy()
        assert n_emit.tolist() == n.tolist()
        assert flat.tolist() == [t for i in range(R) for t in out[i, :n[i]].tolist()]
        assert (acc <= d).all() and (n_emit == acc + (acc < rows)).all()
