"""Static token trees drafted by Medusa and MLP-speculator heads (docs/trees.md, "Proposers").

Node (c1..cd) must be the c_d-th ranked token of stage d-1 under its parent: for Medusa head
d-1's c_d-th top token (independent of the parent), for the MLP speculator stage d-1's c_d-th
top token given the parent's state and token. The reference here walks every path on its own,
with the stage math written out from the raw tensors (no call into the heads' code), and ranks
with a stable descending sort. Also: truncation to the request's draft budget, the tree's
parents in the proposal, no q (deterministic children; one-hot q where a sampling request's
proposal is a chain, which the chain verifier needs), and refusal of trees the head cannot
draft, with errors naming speculative.token_tree.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import head_checkpoints as hc
from specinfer import Generator
from specinfer.engine.request_state import RequestState
from specinfer.sampling_params import SamplingParams
from specinfer.spec_decode.head_proposer import HiddenStateHeadProposer
from specinfer.spec_decode.medusa import MedusaConfig, MedusaHeads
from specinfer.spec_decode.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from specinfer.spec_decode.proposer import ProposalInput, TargetHidden
from specinfer.spec_decode.token_tree import parse_token_tree

H = 16
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 3], [0, 0, 1], [0, 0, 2]]


def mlp_head(vocab=40, n_predict=3, scale_input=True):
    return MLPSpeculator.random(MLPSpeculatorConfig(vocab, H, 24, n_predict, scale_input=scale_input), seed=7)


def medusa_head(vocab=50, kept=30, num_heads=3):
    g = torch.Generator().manual_seed(9)
    w = [[torch.randn(H, H, generator=g) * 0.3 for _ in range(2)] for _ in range(num_heads)]
    b = [[torch.randn(H, generator=g) * 0.3 for _ in range(2)] for _ in range(num_heads)]
    heads = [torch.randn(kept, H, generator=g) for _ in range(num_heads)]
    token_map = torch.randperm(vocab, generator=g)[:kept].sort().values
    return MedusaHeads(MedusaConfig(num_heads, 2, H, vocab, kept, "vllm"), w, b, heads, token_map, None)


def ranked(logits: torch.Tensor) -> list[int]:  # [V] -> token ids, most likely first
    return torch.sort(logits, descending=True, stable=True).indices.tolist()


def medusa_reference(head, h: torch.Tensor, path) -> int:
    """Head d-1 on h_t, written out: x + SiLU(W x + b) per layer, its lm_head, token_map."""
    k, c = len(path) - 1, path[-1]
    x = h
    for j in range(head.cfg.num_layers):
        x = x + F.silu(x @ head.block_w[k][j].T + head.block_b[k][j])
    return int(head.token_map[ranked(x @ head.lm_heads[k].T)[c]])


def mlp_reference(head, h: torch.Tensor, last: int, path) -> int:
    """Walk the path through the stages (fms-extras generate_suffixes math), ranking each stage."""
    n, D = head.cfg.n_predict, head.cfg.inner_dim
    a = 0.5 ** (0.5 / n)
    b = math.sqrt((1 - a * a) * D / 2)
    s = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    y = last
    for i, c in enumerate(path):
        u = s @ head.proj[i].T + head.emb[i][y] * (b / a)
        u = head.ln_w[i] * u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) + head.ln_b[i]
        s = F.gelu(u)
        y = ranked(s @ head.head[i].T)[c]
    return y


HEADS = {"medusa": (medusa_head, lambda head, h, last, path: medusa_reference(head, h, path)),
         "mlp_speculator": (mlp_head, mlp_reference)}


def proposal_input(hidden: torch.Tensor, last: list[int], max_drafts, temperatures=None) -> ProposalInput:
    n = hidden.shape[0]
    temperatures = temperatures or [0.0] * n
    states = [RequestState(f"r{r}", 10 + r, None, [1, 2], SamplingParams(temperature=t, max_tokens=64), None, r,
                           [5, last[r]]) for r, t in enumerate(temperatures)]
    ones, zeros = np.ones(n, np.int64), np.zeros(n, np.int64)
    return ProposalInput(states, zeros + 3, ones, zeros, zeros, ones, np.ones(n, bool),
                         np.asarray(max_drafts, np.int64), np.ones(n, bool), np.zeros((n, 1), np.int32),
                         TargetHidden(hidden))


def requests(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g) * 2, torch.randint(0, 30, (n,), generator=g).tolist()


@pytest.mark.parametrize("method", list(HEADS))
def test_tree_tokens_equal_a_brute_force_reference(method):
    make, ref = HEADS[method]
    head = make()
    tree = parse_token_tree(PATHS)
    hidden, last = requests()
    N = tree.num_nodes
    prop = HiddenStateHeadProposer(head, 3, tree).propose(
        proposal_input(hidden, last, [N] * 4, temperatures=[0.0, 1.0, 0.7, 0.0]))
    assert prop.draft_probs is None  # deterministic top-k children, whatever the temperature
    assert prop.core_ids.tolist() == [10, 11, 12, 13] and prop.cu_num_draft.tolist() == [0, N, 2 * N, 3 * N, 4 * N]
    assert prop.draft_parents.dtype == np.int32
    assert prop.draft_parents.tolist() == tree.parents.tolist() * 4
    for r in range(4):
        want = [ref(head, hidden[r], last[r], list(p)) for p in tree.paths]
        assert prop.draft_token_ids[r * N:(r + 1) * N].tolist() == want, r
        # siblings are distinct top-k tokens, in rank order
        for u in range(-1, N):
            kids = tree.children(u)
            toks = [want[i] for i in kids]
            assert len(set(toks)) == len(toks)
    if method == "mlp_speculator":  # the parent matters: some rank-0 child differs between two parents
        nodes = prop.draft_token_ids.reshape(4, N)
        i00, i10 = tree.paths.index((0, 0)), tree.paths.index((1, 0))
        assert any(nodes[r, i00] != nodes[r, i10] for r in range(4))


@pytest.mark.parametrize("method", list(HEADS))
def test_a_chain_tree_drafts_the_greedy_chain(method):
    head = HEADS[method][0]()
    hidden, last = requests(3, seed=1)
    prop = HiddenStateHeadProposer(head, 3, parse_token_tree([[0], [0, 0], [0, 0, 0]])).propose(
        proposal_input(hidden, last, [3, 3, 3]))
    want = head.draft(hidden, torch.tensor(last), 3)
    assert prop.draft_token_ids.tolist() == want.flatten().tolist()
    assert prop.draft_parents.tolist() == [-1, 0, 1] * 3


def test_trees_are_truncated_to_the_draft_budget():
    head = mlp_head()
    tree = parse_token_tree(PATHS)
    N = tree.num_nodes
    hidden, last = requests(4, seed=2)
    full = HiddenStateHeadProposer(head, 3, tree).propose(proposal_input(hidden, last, [N] * 4))
    assert full.draft_probs is None
    prop = HiddenStateHeadProposer(head, 3, tree).propose(
        proposal_input(hidden, last, [N + 5, 5, 0, 1], temperatures=[0.0, 1.0, 1.0, 1.0]))
    assert prop.core_ids.tolist() == [10, 11, 13]  # a request with no budget gets no proposal
    assert prop.cu_num_draft.tolist() == [0, N, N + 5, N + 6]
    assert prop.draft_parents.tolist() == tree.parents.tolist() + tree.parents[:5].tolist() + [-1]
    f = full.draft_token_ids.reshape(4, N)
    assert prop.draft_token_ids.tolist() == f[0].tolist() + f[1, :5].tolist() + f[3, :1].tolist()
    # a sampling request cut to a chain (one node) is verified as a chain: its draft gets q = one-hot;
    # tree-shaped proposals carry no q (the one-hot variant of tree verification)
    q = prop.draft_probs
    assert q[0] is None and q[1] is None
    assert q[2].shape == (1, head.cfg.vocab_size) and q[2].sum() == 1 and q[2][0, f[3, 0]] == 1


def test_check_tree_refuses_what_a_head_cannot_draft():
    deep = parse_token_tree([[0], [0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"speculative\.token_tree is 3 deep.*n_predict.* 2 tokens"):
        HiddenStateHeadProposer.check_tree(deep, mlp_head(n_predict=2), "MLP speculator (n_predict)", "m")
    wide = parse_token_tree([[0], [1], [2], [3], [4], [5], [6]])
    with pytest.raises(ValueError, match=r"speculative\.token_tree asks for rank 6.* ranks 6 tokens"):
        HiddenStateHeadProposer.check_tree(wide, mlp_head(vocab=6), "MLP speculator (n_predict)", "m")
    HiddenStateHeadProposer.check_tree(wide, mlp_head(vocab=7), "MLP speculator (n_predict)", "m")
    with pytest.raises(ValueError, match=r"speculative\.token_tree asks for rank 6.* ranks 5 tokens"):
        HiddenStateHeadProposer.check_tree(wide, medusa_head(vocab=50, kept=5), "Medusa heads", "m")


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir("llama", False)[0]


@pytest.mark.parametrize("method,make,tree,k,match", [
    ("medusa", lambda p, t: hc.medusa_original(p, t, num_heads=2), [[0], [0, 0], [0, 0, 0]], 3,
     r"token_tree is 3 deep.*number of heads.* predicts 2 tokens"),
    ("mlp_speculator", lambda p, t: hc.mlp_speculator(p, t, n_predict=2), [[0], [1], [1, 0], [1, 0, 0]], 3,
     r"token_tree is 3 deep.*n_predict.* predicts 2 tokens"),
    ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=40), [[0], [1], [50]], 1,
     r"token_tree asks for rank 50.* ranks 40 tokens"),
])
def test_generator_refuses_a_tree_the_head_cannot_draft(target, tmp_path, method, make, tree, k, match):
    path = make(tmp_path / "head", target)
    with pytest.raises(ValueError, match=match):
        Generator(str(target), speculative={"method": method, "model": str(path), "num_speculative_tokens": k,
                                            "token_tree": tree})
