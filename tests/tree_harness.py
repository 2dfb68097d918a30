"""Monte Carlo harness for tree verification: many independent requests decoded at once.

The target is a position-dependent Markov chain: the token at output position t has law
``P[t, x_{t-1}]`` (``x_{-1}`` = START = 0), so tree nodes at the same depth with different
tokens DO see different target rows, and the exact law of the first ``n_check`` tokens is the
product of transitions. The draft is another Markov chain Q. Each step every unfinished request
proposes one tree (a shape from ``shapes``, chosen per request and step) under its last token:
- ``children="sampled"``: node i's token is an independent draw from ``Q[t_i, token(parent)]``
  and its q row is that distribution;
- ``children="top_k"``: the j-th child of a node is the j-th most likely token under Q there
  (deterministic; q = None, the one-hot variant);
- ``children="mixed"``: each request picks one of the two.
Then one batched ``verify`` call verifies all trees; emitted tokens are appended and decoding
continues from the first unemitted position until every request has ``n_check`` tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from specinfer.sample import RandomStreams
from specinfer.sample.tree_verify import tree_rejection_sample

START = 0


def markov_chains(vocab: int, num_pos: int, seed: int, spread: float = 1.5, gap: float = 1.5):
    """Target P and draft Q, float64[num_pos, vocab (previous token), vocab]."""
    g = torch.Generator().manual_seed(seed)
    target_logits = spread * torch.randn(num_pos, vocab, vocab, generator=g, dtype=torch.float64)
    draft_logits = target_logits + gap * torch.randn(num_pos, vocab, vocab, generator=g, dtype=torch.float64)
    return target_logits.softmax(-1), draft_logits.softmax(-1)


def markov_law(P: torch.Tensor, n_check: int) -> torch.Tensor:  # -> [V ** n_check], token 0 first
    law = P[0, START]  # [V]
    for t in range(1, n_check):
        prev = torch.arange(law.numel()) % P.shape[-1]  # the last token of each prefix code
        law = (law.unsqueeze(1) * P[t, prev]).reshape(-1)
    return law


def _depths(parents: list[int]) -> list[int]:
    depth = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return depth


def decode_with_trees(P, Q, shapes, children, n_check, seed, num_samples, verify=tree_rejection_sample):
    """Counts [V ** n_check] of the first n_check emitted tokens over num_samples requests."""
    vocab = P.shape[-1]
    g = torch.Generator().manual_seed(seed)
    seeds = np.arange(num_samples, dtype=np.uint64) + np.uint64(seed) * np.uint64(1_000_003)
    max_depth = max(max(_depths(s)) for s in shapes)
    seq = torch.full((num_samples, n_check + max_depth + 1), -1, dtype=torch.int64)
    length = torch.zeros(num_samples, dtype=torch.int64)
    last = torch.full((num_samples,), START, dtype=torch.int64)
    while True:
        active = (length < n_check).nonzero().squeeze(1)
        if active.numel() == 0:
            break
        shape_of = torch.randint(0, len(shapes), (active.numel(),), generator=g)
        if children == "mixed":
            top_k_of = torch.rand(active.numel(), generator=g) < 0.5
        else:
            top_k_of = torch.full((active.numel(),), children == "top_k")
        order = torch.argsort(shape_of, stable=True)  # group requests by shape
        active, shape_of, top_k_of = active[order], shape_of[order], top_k_of[order]
        toks, pars, qs, rows, counts = [], [], [], [], []
        for s, parents in enumerate(shapes):
            sel = (shape_of == s).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            req = active[sel]
            n, m = req.numel(), len(parents)
            L, depth = length[req], _depths(parents)
            node_tok = torch.zeros(n, m, dtype=torch.int64)
            node_q = torch.zeros(n, m, vocab, dtype=torch.float64)
            rank = [sum(1 for j in range(i) if parents[j] == parents[i]) for i in range(m)]
            for i, par in enumerate(parents):
                prev = last[req] if par < 0 else node_tok[:, par]
                q_row = Q[L + depth[i] - 1, prev]  # [n, V]
                sampled = torch.multinomial(q_row, 1, generator=g).squeeze(1)
                ranked = torch.argsort(q_row, dim=1, descending=True, stable=True)[:, rank[i]]
                node_tok[:, i] = torch.where(top_k_of[sel], ranked, sampled)
                node_q[:, i] = q_row
            root_row = P[L, last[req]].unsqueeze(1)  # [n, 1, V]
            node_rows = P[L.unsqueeze(1) + torch.tensor(depth), node_tok]  # [n, m, V]
            rows.append(torch.cat([root_row, node_rows], 1).reshape(-1, vocab))
            toks.append(node_tok.reshape(-1))
            pars.append(torch.tensor(parents).repeat(n))
            qs.append(node_q.reshape(-1, vocab))
            counts.append(torch.full((n,), m))
        counts = torch.cat(counts)
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
        st = RandomStreams.build(seeds[active.numpy()], length[active].numpy())
        out = verify(torch.cat(toks), torch.cat(pars), cu, torch.cat(qs), torch.cat(rows),
                     torch.zeros(active.numel(), dtype=torch.bool), st, one_hot=top_k_of)
        n_emit = out.num_emitted.long()
        start = length[active]
        for j in range(out.token_ids.shape[1]):
            m = j < n_emit
            seq[active[m], start[m] + j] = out.token_ids[m, j]
        last[active] = out.token_ids[torch.arange(active.numel()), n_emit - 1]
        length[active] = start + n_emit
    code = torch.zeros(num_samples, dtype=torch.int64)
    for t in range(n_check):
        code = code * vocab + seq[:, t]
    return torch.bincount(code, minlength=vocab ** n_check)
