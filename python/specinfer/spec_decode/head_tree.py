"""Static token trees drafted by hidden-state heads (docs/trees.md, "Proposers").

Node (c1, ..., cd) of a `StaticTree` is the c_d-th ranked token (0 = the most likely, by the
stage's raw logits) of stage d - 1 under its parent:
- Medusa (`reads_parent` False): head d-1's c_d-th top token, the same under every parent, so each
  head runs once per request;
- MLP speculator: stage d-1 run on the parent's state and token, so every depth runs once over its
  frontier (all requests x the nodes of depth d-1 that have children), batched.
Children are deterministic (top-k): the proposal carries no q (`draft_probs` None) and is verified
with the one-hot variant, which is lossless.
"""
from __future__ import annotations

import numpy as np
import torch

from specinfer.spec_decode.token_tree import StaticTree


def check_tree(tree, num_stages: int, vocab: int, what: str, model: str) -> None:
    """Refuse a tree the head cannot draft (ValueError naming speculative.token_tree)."""
    if not isinstance(tree, StaticTree):
        raise ValueError(f"speculative.token_tree: the {what} at {model!r} drafts static trees (a list of "
                         "paths) only")
    if tree.max_depth > num_stages:
        raise ValueError(f"speculative.token_tree is {tree.max_depth} deep, but the {what} at {model!r} predicts "
                         f"{num_stages} tokens; use paths of at most {num_stages} ranks")
    if tree.max_rank >= vocab:
        raise ValueError(f"speculative.token_tree asks for rank {tree.max_rank}, but the {what} at {model!r} "
                         f"ranks {vocab} tokens; use ranks below {vocab}")


def _top(logits: torch.Tensor, k: int) -> torch.Tensor:  # [M, V] -> int64[M, k] best first
    return logits.topk(k, dim=-1).indices


def draft_tree(head, hidden: torch.Tensor, tokens: torch.Tensor, tree: StaticTree) -> torch.Tensor:
    """hidden [P, H] (h_t), tokens int64[P] (x_{t+1}) -> int64[P, N]: every request's tree nodes."""
    P, N = hidden.shape[0], tree.num_nodes
    out = torch.empty(P, N, dtype=torch.int64, device=hidden.device)
    state = head.start(hidden, tokens)  # [P, S]
    if not head.reads_parent:
        for d in range(1, tree.max_depth + 1):
            nodes = np.flatnonzero(tree.depths == d)
            ranks = torch.from_numpy(tree.ranks[nodes].astype(np.int64)).to(hidden.device)
            _, logits = head.stage(d - 1, state, tokens)  # [P, V]
            out[:, torch.from_numpy(nodes).to(hidden.device)] = _top(logits, int(ranks.max()) + 1)[:, ranks]
        return out
    # frontier of depth d - 1: its nodes (-1 = the root), their states [P, nf, S] and tokens [P, nf]
    level_nodes = np.array([-1])
    level_state, level_tok = state.unsqueeze(1), tokens.unsqueeze(1)
    for d in range(1, tree.max_depth + 1):
        nodes = np.flatnonzero(tree.depths == d)
        parents = tree.parents[nodes]
        expand = np.unique(parents)  # frontier nodes with children (sorted, like level_nodes)
        at = np.searchsorted(level_nodes, expand)  # their index in the frontier
        at_t = torch.from_numpy(at).to(hidden.device)
        nf = len(expand)
        s_in = level_state[:, at_t].reshape(P * nf, -1)
        y_in = level_tok[:, at_t].reshape(P * nf)
        s_out, logits = head.stage(d - 1, s_in, y_in)  # [P * nf, S], [P * nf, V]
        ranks = tree.ranks[nodes].astype(np.int64)
        top = _top(logits, int(ranks.max()) + 1).reshape(P, nf, -1)  # [P, nf, K]
        which = torch.from_numpy(np.searchsorted(expand, parents)).to(hidden.device)  # each node's parent among them
        child_tok = top[:, which, torch.from_numpy(ranks).to(hidden.device)]  # [P, n_d]
        out[:, torch.from_numpy(nodes).to(hidden.device)] = child_tok
        level_nodes = nodes
        level_state = s_out.reshape(P, nf, -1)[:, which]  # a child enters the next stage with its parent's output
        level_tok = child_tok
    return out
