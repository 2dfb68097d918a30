"""Lossless verification of token trees (SpecInfer, Miao et al. ASPLOS'24, Alg. 2).

Vocabulary (DESIGN.md §4, docs/trees.md): a request proposes a tree of m draft nodes under its
root (the last emitted token); the target scores the root and every node in one forward, so
request r has ``1 + m`` target rows (row 0 = p(. | prefix), row 1 + i = p(. | path to node i)).
The verifier walks the tree from the root and emits the **accepted path** followed by one
**recovered** token (some child of the stop node was rejected) or **bonus** token (the stop
node is a leaf). ``num_accepted`` = path length.

The walk at node u (its children H in candidate order):
- greedy request: descend into the (lowest-index) child whose token == argmax p_u; stop when
  none; emit argmax p_u at the stop node. Identical to greedy decoding; no randomness.
- sampled children (``q`` rows given; node i was an independent draw x_i ~ q_i): multi-step
  speculative sampling. r = p_u (the residual at u); for each child s in order: accept x_s iff
  ``U < r(x_s) / q_s(x_s)``, then descend into s with s's OWN unmodified distribution p_s;
  else ``r := normalize(max(0, r - q_s))`` and try the next sibling. When every child is
  rejected (or u is a leaf), the final token is drawn from r (the residual, or p_u at a leaf).
  Theorem 4.2 of SpecInfer: every emitted token is distributed as under target-only sampling.
- deterministic top-k children (``q`` = None for the request): the same walk with one-hot q_s:
  accept x_s with probability r(x_s), else zero r(x_s), renormalize, next sibling.

Duplicate sibling tokens: the walk descends into the lowest-index child with the emitted token
(the rule the core uses to infer the path). A rejected token keeps no residual mass, so a later
duplicate is never accepted and the final token never equals a tried child's token.

Randomness (counter streams, :mod:`.random_streams`): the draws deciding the children of node u
are at output position ``P + depth(u)``: the j-th sibling's test uses purpose
``sibling_accept_purpose(j)`` (j = 0 is ``ACCEPT``), the final token ``SAMPLE`` by inverse CDF.
A chain verified here therefore meets exactly the draws, the arithmetic and the tokens of
:func:`.rejection_sampler.rejection_sample`.

The per-node distribution, the distribution a sibling is tested against, the residual update and
the final token's weights are small functions so the statistical tests can swap in known-broken
variants and watch the chi-square test fail.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .random_streams import SAMPLE, RandomStreams, sample_from_weights, sibling_accept_purpose
from .tree_layout import TreeLayout


@dataclass(frozen=True)
class TreeVerification:
    token_ids: torch.Tensor  # int64[R, D + 1]: accepted path tokens then the final token; -1 pad
    num_emitted: torch.Tensor  # int32[R]: path length + 1
    accepted_nodes: torch.Tensor  # int64[R, max(D, 1)]: node indices of the accepted path; -1 pad

    @property
    def num_accepted(self) -> torch.Tensor:  # int32[R]
        return self.num_emitted - 1


def _node_distribution(
    p_node: torch.Tensor,  # [R, V] target row of the node the walk stands on
    parent_residual: torch.Tensor | None,  # [R, V] normalized residual at its parent (None at the root)
) -> torch.Tensor:  # [R, V] the distribution the walk starts from at this node
    """The node's own, unmodified target distribution (residuals are per node)."""
    return p_node


def _sibling_target(
    p_node: torch.Tensor,  # [R, V] the node's distribution
    residual: torch.Tensor,  # [R, V] unnormalized residual weights
    total: torch.Tensor,  # [R, 1] their sum (1 before any rejection)
) -> tuple[torch.Tensor, torch.Tensor]:  # weights, total the next sibling is tested against
    return residual, total


def _residual(
    residual: torch.Tensor,  # [R, V] unnormalized weights r
    total: torch.Tensor,  # [R, 1] sum of r
    q: torch.Tensor,  # [R, V] the rejected sibling's draft distribution
    p_node: torch.Tensor,  # [R, V] the node's distribution (fallback)
) -> tuple[torch.Tensor, torch.Tensor]:  # new weights max(0, r / total - q) and their sum
    """After a rejection: max(0, r - q) of the normalized r, or p_node where that is all zero
    (probability 0 in exact arithmetic; never 0/0). With total == 1 this is bit for bit the
    chain's ``max(0, p - q)``."""
    new = (residual / total - q).clamp_(min=0)
    new_total = new.sum(dim=-1, keepdim=True)
    empty = new_total <= 0
    return torch.where(empty, p_node, new), torch.where(empty, torch.ones_like(new_total), new_total)


def _final_weights(
    p_node: torch.Tensor,  # [R, V] the stop node's distribution
    residual: torch.Tensor,  # [R, V] its unnormalized residual after the rejected children (p_node at a leaf)
) -> torch.Tensor:  # [R, V] weights (unnormalized) of the recovered or bonus token
    return residual


def tree_rejection_sample(
    draft_token_ids: torch.Tensor,  # int64[N]
    draft_parents: torch.Tensor,  # int[N]; -1 = child of the root
    cu_num_draft: torch.Tensor,  # int[R + 1]
    draft_probs: torch.Tensor | None,  # float[N, V]: q_i of node i; None = every request one-hot
    target_probs: torch.Tensor,  # float[N + R, V]; 1 + m_r rows per request (root first)
    is_greedy: torch.Tensor,  # bool[R]
    streams: RandomStreams,  # R rows: seed, output position P of the first emitted token
    one_hot: torch.Tensor | None = None,  # bool[R]: deterministic (top-k) children; None = draft_probs is None
    layout: TreeLayout | None = None,  # prebuilt layout of the same trees
) -> TreeVerification:
    """Verify R token trees by multi-step speculative sampling (see the module docstring)."""
    device = target_probs.device
    if layout is None:
        layout = TreeLayout.build(draft_token_ids, draft_parents, cu_num_draft, device)
    R, V = layout.num_requests, target_probs.shape[1]
    _check(layout, draft_probs, target_probs, is_greedy, streams)
    if one_hot is None:
        one_hot = torch.full((R,), draft_probs is None, dtype=torch.bool)
    one_hot = one_hot.to(device)
    is_greedy = is_greedy.to(device)
    if draft_probs is None:
        if not bool((one_hot | is_greedy).all()):
            raise ValueError("draft_probs is None but one_hot marks sampled children")
        one_hot = torch.ones_like(one_hot)
    all_greedy = bool(is_greedy.all())
    all_one_hot = bool(one_hot.all())
    D, K = layout.max_depth, layout.max_children
    argmax = target_probs.argmax(dim=-1)  # [N + R]
    accept_u = [] if all_greedy else [streams.uniform(sibling_accept_purpose(j), D + 1, device)
                                      for j in range(K)]  # K x [R, D + 1]
    r_idx = torch.arange(R, device=device)
    dtype = target_probs.dtype
    last_node = max(layout.num_rows - R - 1, 0)  # clamp for requests without nodes

    cur = torch.zeros(R, dtype=torch.int64, device=device)  # slot: 0 = root, 1 + i = node i
    active = torch.ones(R, dtype=torch.bool, device=device)
    path = torch.full((R, max(D, 1)), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(R, dtype=torch.int64, device=device)
    final_slot = torch.zeros(R, dtype=torch.int64, device=device)
    final_w = None if all_greedy else torch.zeros(R, V, dtype=dtype, device=device)
    parent_residual = None
    for level in range(D + 1):
        row = layout.first_row + cur  # [R]
        chosen = torch.full((R,), -1, dtype=torch.int64, device=device)
        if not all_greedy:
            p = _node_distribution(target_probs[row], parent_residual)  # [R, V]
            w, total = p, torch.ones(R, 1, dtype=dtype, device=device)
        for j in range(K):
            c = layout.children[r_idx, cur, j]  # [R]
            trying = active & (chosen < 0) & (c >= 0)
            if not bool(trying.any()):
                break
            c = c.clamp(min=0)
            x = layout.tokens[r_idx, c]  # [R]
            accept = x == argmax[row]
            if not all_greedy:
                if all_one_hot:
                    q = torch.nn.functional.one_hot(x, V).to(dtype)
                else:
                    q = torch.where(one_hot.unsqueeze(1), torch.nn.functional.one_hot(x, V).to(dtype),
                                    draft_probs[(layout.first_draft + c).clamp(max=last_node)].to(dtype))
                tw, tt = _sibling_target(p, w, total)
                xi = x.unsqueeze(1)
                ratio = tw.gather(1, xi).squeeze(1) / (tt.squeeze(1) * q.gather(1, xi).squeeze(1))
                accept = torch.where(is_greedy, accept, accept_u[j][:, level] < ratio)
                rejected = (trying & ~accept).unsqueeze(1)
                nw, nt = _residual(w, total, q, p)
                w, total = torch.where(rejected, nw, w), torch.where(rejected, nt, total)
            chosen = torch.where(trying & accept, c, chosen)
        descend = active & (chosen >= 0)
        stop = active & ~descend
        final_slot = torch.where(stop, cur, final_slot)
        if not all_greedy:
            final_w = torch.where(stop.unsqueeze(1), _final_weights(p, w), final_w)
            parent_residual = w / total
        if bool(descend.any()):
            chosen = _lowest_index_sibling(layout, cur, chosen)
            path[:, level] = torch.where(descend, chosen, -1)
            num_accepted += descend.to(torch.int64)
            cur = torch.where(descend, chosen + 1, cur)
        active = descend
        if not bool(active.any()):
            break

    final_token = argmax[layout.first_row + final_slot]
    if not all_greedy:
        u = streams.uniform(SAMPLE, D + 1, device).gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        final_token = torch.where(is_greedy, final_token, sample_from_weights(final_w, u))
    return _emit(layout, path, num_accepted, final_token)


def _lowest_index_sibling(layout: TreeLayout, cur: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The lowest-index child of slot ``cur`` with the token of node ``chosen`` (int64[R])."""
    R = cur.shape[0]
    r_idx = torch.arange(R, device=cur.device)
    kids = layout.children[r_idx, cur]  # [R, K]
    kid_tokens = layout.tokens[r_idx.unsqueeze(1), kids.clamp(min=0)]  # [R, K]
    target = layout.tokens[r_idx, chosen.clamp(min=0)]
    match = (kids >= 0) & (kid_tokens == target.unsqueeze(1))
    first = match.to(torch.int64).argmax(dim=1)
    return torch.where(chosen >= 0, kids[r_idx, first], chosen)


def _emit(layout: TreeLayout, path: torch.Tensor, num_accepted: torch.Tensor,
          final_token: torch.Tensor) -> TreeVerification:
    R, device = layout.num_requests, path.device
    D = layout.max_depth
    r_idx = torch.arange(R, device=device).unsqueeze(1)
    out = torch.full((R, D + 1), -1, dtype=torch.int64, device=device)
    path_tokens = layout.tokens[r_idx, path.clamp(min=0)] if layout.max_nodes else torch.zeros_like(path)
    out[:, :D] = torch.where(path >= 0, path_tokens, -1)[:, :D]
    out.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return TreeVerification(out, (num_accepted + 1).to(torch.int32), path)


def _check(layout, draft_probs, target_probs, is_greedy, streams) -> None:
    R = layout.num_requests
    if target_probs.dim() != 2 or target_probs.shape[0] != layout.num_rows:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected "
                         f"[{layout.num_rows}, vocab] (1 + nodes rows per tree)")
    n = layout.num_rows - R
    if draft_probs is not None and draft_probs.shape != (n, target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected [{n}, {target_probs.shape[1]}]")
    if is_greedy.shape != (R,):
        raise ValueError(f"is_greedy has shape {tuple(is_greedy.shape)}, expected [{R}]")
    if len(streams) != R:
        raise ValueError(f"streams has {len(streams)} rows, expected {R}")


def verify_tree(
    target_probs: torch.Tensor,  # float[1 + m, V]; row 0 root, row 1 + i node i
    draft_token_ids,  # int[m]
    draft_parents,  # int[m]; -1 = root
    draft_probs: torch.Tensor | None,  # float[m, V]; None = deterministic top-k children
    is_greedy: bool,
    seed: int,
    position: int,  # output position P of the first emitted token
) -> tuple[list[int], list[int]]:  # emitted tokens, accepted node indices
    """One request's tree (a convenience over :func:`tree_rejection_sample`)."""
    tokens = torch.as_tensor(np.asarray(draft_token_ids, dtype=np.int64))
    out = tree_rejection_sample(
        tokens, torch.as_tensor(np.asarray(draft_parents, dtype=np.int64)),
        torch.tensor([0, tokens.shape[0]]), draft_probs, target_probs, torch.tensor([bool(is_greedy)]),
        RandomStreams.build([seed], [position]))
    n = int(out.num_emitted[0])
    return out.token_ids[0, :n].tolist(), out.accepted_nodes[0, : n - 1].tolist()
