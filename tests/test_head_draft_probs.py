"""Heads' probabilities are the q of lossless rejection sampling (issue 8).

For requests with temperature > 0, Medusa and MLP-speculator proposers draw each draft from the
head's distribution after the request's temperature / top-k processing and report that
distribution as `Proposal.draft_probs`; greedy requests keep the argmax (q = one-hot, None).

Checked here on tiny random heads (small vocabulary) through `propose()` itself:
- the reported q equals an independent reference (softmax of the top-k-masked logits / T);
- the drafts are draws from it: the joint law of the two drafts of ~20k requests (each with its
  own seed and output position) passes a Pearson chi-square test (alpha = 1e-3) against the exact
  law, which for the MLP speculator chains through the sampled first draft;
- a harness check: drafting both positions with the same uniform (a stream not advanced) fails;
- greedy rows in the same batch draft the argmax chain.
Lossless acceptance of such (draft, q) pairs is the rejection sampler's own statistical test
(test_rejection_sampler.py); test_engine_distribution covers heads through the whole engine.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specinfer.engine.request_state import RequestState
from specinfer.sample.random_streams import RandomStreams
from specinfer.sampling_params import SamplingParams
from specinfer.spec_decode.head_proposer import HiddenStateHeadProposer
from specinfer.spec_decode.medusa import MedusaConfig, MedusaHeads
from specinfer.spec_decode.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from specinfer.spec_decode.proposer import ProposalInput, TargetHidden
from stats import chi_square_pvalue

ALPHA = 1e-3
NUM = 20_000
H = 16
TEMPERATURE, TOP_K = 0.8, 5


def mlp_head(vocab=6):
    return MLPSpeculator.random(MLPSpeculatorConfig(vocab, H, H, 2), seed=3)


def medusa_head(vocab=8, kept=(0, 2, 3, 4, 6, 7)):
    """Two heads over a truncated vocabulary (token_map: draft row -> target id)."""
    g = torch.Generator().manual_seed(5)
    K, Vt = 2, len(kept)
    w = [[torch.randn(H, H, generator=g) * 0.3] for _ in range(K)]
    b = [[torch.randn(H, generator=g) * 0.3] for _ in range(K)]
    heads = [torch.randn(Vt, H, generator=g) * 0.15 for _ in range(K)]
    cfg = MedusaConfig(K, 1, H, vocab, Vt, "vllm")
    return MedusaHeads(cfg, w, b, heads, torch.tensor(kept, dtype=torch.int64), None)


HEADS = {"mlp_speculator": mlp_head, "medusa": medusa_head}


def reference_q(logits: torch.Tensor) -> torch.Tensor:
    """[.., V] raw logits -> the processed distribution: top-k mask, then softmax(l / T)."""
    logits = logits.double()
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    return torch.where(logits >= kth, logits / TEMPERATURE, -torch.inf).softmax(-1)


def proposal_input(hidden: torch.Tensor, last: int, temperatures, max_drafts: int, seed: int = 0):
    """One decode step for len(temperatures) requests with the same h_t and newest token; each
    has its own seed and output length (so its own draft streams)."""
    n = len(temperatures)
    rng = np.random.default_rng(seed)
    states = []
    for r, t in enumerate(temperatures):
        out = [int(x) for x in rng.integers(0, 4, size=int(rng.integers(1, 6)))] + [last]
        params = SamplingParams(temperature=t, top_k=TOP_K if t > 0 else 0, max_tokens=64)
        states.append(RequestState(f"r{r}", r, None, [1, 2, 3], params, None, seed * 1_000_003 + r, out))
    ones, zeros = np.ones(n, np.int64), np.zeros(n, np.int64)
    return ProposalInput(states, zeros + 8, ones, zeros, zeros, ones, np.ones(n, bool), ones * max_drafts,
                         np.ones(n, bool), np.zeros((n, 1), np.int32), TargetHidden(hidden.expand(n, -1)))


def drafts_and_q(head, inp):
    prop = HiddenStateHeadProposer(head, 2).propose(inp)
    assert np.array_equal(prop.cu_num_draft, np.arange(inp.num_requests + 1) * 2)
    return prop.draft_token_ids.reshape(-1, 2), prop.draft_probs


def exact_joint_law(head, h, last) -> torch.Tensor:
    """P(d0, d1) [V * V]: d0 ~ q0, d1 ~ q1(. | d0) (Medusa's heads ignore d0)."""
    V = head.cfg.vocab_size
    s = head.start(h, torch.tensor([last]))
    s1, l0 = head.stage(0, s, torch.tensor([last]))
    q0 = reference_q(l0)[0]  # [V]
    _, l1 = head.stage(1, s1.expand(V, -1), torch.arange(V))
    return (q0[:, None] * reference_q(l1)).reshape(-1)


@pytest.mark.parametrize("method", list(HEADS))
def test_sampled_drafts_follow_the_reported_q(method):
    head = HEADS[method]()
    V = head.cfg.vocab_size
    h = torch.randn(1, H, generator=torch.Generator().manual_seed(11)) * 2
    last = 3
    drafts, q = drafts_and_q(head, proposal_input(h, last, [TEMPERATURE] * NUM, 2))
    # q as the target's processing would give it: q[0] from stage 0, q[1] given the sampled d0
    s = head.start(h, torch.tensor([last]))
    s1, l0 = head.stage(0, s, torch.tensor([last]))
    for r in (0, 1, NUM - 1):
        assert q[r].shape == (2, V)
        torch.testing.assert_close(q[r][0].double(), reference_q(l0)[0], rtol=1e-5, atol=1e-6)
        _, l1 = head.stage(1, s1, torch.tensor([int(drafts[r, 0])]))
        torch.testing.assert_close(q[r][1].double(), reference_q(l1)[0], rtol=1e-5, atol=1e-6)
        assert float(q[r][0][drafts[r, 0]]) > 0 and float(q[r][1][drafts[r, 1]]) > 0
    if method == "medusa":  # never a token outside the truncated vocabulary
        assert set(drafts.flatten().tolist()) <= set(head.token_map.tolist())
    counts = torch.bincount(torch.from_numpy(drafts[:, 0] * V + drafts[:, 1]), minlength=V * V)
    law = exact_joint_law(head, h, last)
    assert (law > 1e-3).sum() >= 6  # a law with many outcomes: the test can see a bias
    assert chi_square_pvalue(counts, law) > ALPHA


def test_harness_rejects_a_stream_that_does_not_advance(monkeypatch):
    """The same uniform for both draft positions (a position not advanced) must fail."""
    head = mlp_head()
    V = head.cfg.vocab_size
    h = torch.randn(1, H, generator=torch.Generator().manual_seed(11)) * 2
    real = RandomStreams.uniform
    monkeypatch.setattr(RandomStreams, "uniform",
                        lambda self, purpose, width=1, device=None: real(self, purpose, 1, device).expand(-1, width))
    drafts, _ = drafts_and_q(head, proposal_input(h, 3, [TEMPERATURE] * NUM, 2))
    counts = torch.bincount(torch.from_numpy(drafts[:, 0] * V + drafts[:, 1]), minlength=V * V)
    assert chi_square_pvalue(counts, exact_joint_law(head, h, 3)) < ALPHA


@pytest.mark.parametrize("method", list(HEADS))
def test_greedy_rows_draft_the_argmax_without_q(method):
    head = HEADS[method]()
    h = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    want = head.draft(h, torch.tensor([3]), 2)[0].tolist()
    temps = [0.0, TEMPERATURE, 0.0, TEMPERATURE]
    drafts, q = drafts_and_q(head, proposal_input(h, 3, temps, 2))
    for r, t in enumerate(temps):
        if t == 0.0:
            assert drafts[r].tolist() == want and q[r] is None
        else:
            assert q[r].shape == (2, head.cfg.vocab_size)
    all_greedy = HiddenStateHeadProposer(head, 2).propose(proposal_input(h, 3, [0.0] * 3, 2))
    assert all_greedy.draft_probs is None and all_greedy.draft_token_ids.tolist() == want * 3


def test_draft_counts_follow_max_drafts():
    head = mlp_head()
    h = torch.randn(1, H)
    inp = proposal_input(h, 3, [TEMPERATURE, 0.0, TEMPERATURE], 2)
    inp = dataclasses.replace(inp, max_drafts=np.array([1, 2, 0]))
    prop = HiddenStateHeadProposer(head, 2).propose(inp)
    assert prop.core_ids.tolist() == [0, 1] and prop.cu_num_draft.tolist() == [0, 1, 3]
    assert prop.draft_probs[0].shape == (1, head.cfg.vocab_size) and prop.draft_probs[1] is None



def test_seeded_sampled_head_drafts_are_the_same_in_any_batch_budget_and_pool(tiny_dir, tmp_path):
    """Sampled head drafts depend only on (seed, output position): a seeded request gives the same
    tokens alone, in a batch, with split proposals and under preemption (test_seeded_determinism's
    harness, with an MLP speculator whose chained stages feed on the sampled drafts)."""
    import head_checkpoints as hc
    from seeded_runs import run_seeded

    target, _ = tiny_dir("llama", False, scale=2.0)
    spec = {"model": str(hc.mlp_speculator(tmp_path / "mlp", target))}
    alone, _, _, m = run_seeded(target, None, "mlp_speculator", "rejection_sampler", 0, spec=spec)
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m
    batched, _, _, _ = run_seeded(target, None, "mlp_speculator", "rejection_sampler", 7, spec=spec)
    split, splits, _, _ = run_seeded(target, None, "mlp_speculator", "rejection_sampler", 0, spec=spec,
                               max_num_batched_tokens=3)
    preempted, _, preemptions, _ = run_seeded(target, None, "mlp_speculator", "rejection_sampler", 7, spec=spec,
                                        num_kv_blocks=20)
    assert splits > 0 and preemptions > 0
    assert batched == alone and split == alone and preempted == alone
