"""Medusa-style typical acceptance over token trees. NOT distribution-preserving.

Vocabulary and layout as in :mod:`.tree_verify` / :mod:`.tree_layout`. Node i (token x_i,
parent u) is **typical** iff ``p_u(x_i) > min(posterior_threshold, posterior_alpha * exp(-H(p_u)))``
(Cai et al. 2024, "Medusa", §2.3.1; greedy requests: iff x_i == argmax p_u). The accepted path is
the deepest node whose whole path is typical; ties go to the larger summed log p along the path
(Medusa's ``evaluate_posterior``), then to the lower node index. Only **canonical** nodes count
(no lower-index sibling carries the same token) so the path is the one the core reads off the
emitted tokens with its lowest-index rule.

The final token: the argmax of p at the stop node when the stop node has children (some child
was rejected: Medusa's greedy fallback), otherwise (a leaf) a bonus token sampled from p at the
stop node with ``U(seed, P + path length, SAMPLE)``; greedy requests always take the argmax.
On chains this is exactly :func:`.typical_acceptance.typical_acceptance_sample`.

This sampler does NOT preserve the target distribution (it accepts whatever the target finds
"typical enough" and replaces rejections by the mode); use it only where the proposer has no
useful draft probabilities and speed matters more than exactness. ``draft_probs`` and
``one_hot`` are accepted for interface parity and ignored.
"""
from __future__ import annotations

import torch

from .random_streams import SAMPLE, RandomStreams, sample_from_weights
from .tree_layout import TreeLayout
from .tree_verify import TreeVerification, _check, _emit
from .typical_acceptance import entropy


def tree_typical_acceptance_sample(
    draft_token_ids: torch.Tensor,  # int64[N]
    draft_parents: torch.Tensor,  # int[N]; -1 = child of the root
    cu_num_draft: torch.Tensor,  # int[R + 1]
    draft_probs: torch.Tensor | None,  # ignored
    target_probs: torch.Tensor,  # float[N + R, V]; 1 + m_r rows per request (root first)
    is_greedy: torch.Tensor,  # bool[R]
    streams: RandomStreams,  # R rows
    one_hot: torch.Tensor | None = None,  # ignored
    layout: TreeLayout | None = None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> TreeVerification:
    device = target_probs.device
    if layout is None:
        layout = TreeLayout.build(draft_token_ids, draft_parents, cu_num_draft, device)
    _check(layout, None, target_probs, is_greedy, streams)
    R, M, D = layout.num_requests, layout.max_nodes, layout.max_depth
    is_greedy = is_greedy.to(device)
    r_idx = torch.arange(R, device=device)
    argmax = target_probs.argmax(dim=-1)  # [N + R]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy(target_probs)), max=posterior_threshold)

    parent_row = layout.first_row.unsqueeze(1) + layout.parents.clamp(min=-1) + 1  # [R, M]
    p_x = target_probs[parent_row, layout.tokens]  # [R, M] p_parent(x_i)
    typical = torch.where(is_greedy.unsqueeze(1), layout.tokens == argmax[parent_row],
                          p_x > threshold[parent_row])
    ok = typical & layout.valid & _canonical(layout)
    score = torch.log(p_x)
    for i in range(M):  # parents come before children: fold the path into ok and score
        par = layout.parents[:, i]
        has_par = par >= 0
        par_c = par.clamp(min=0)
        ok[:, i] &= ~has_par | ok[r_idx, par_c]
        score[:, i] += torch.where(has_par, score[r_idx, par_c], 0.0)

    depth = torch.where(ok, layout.depth, 0)  # [R, M]
    num_accepted = depth.max(dim=1).values if M else torch.zeros(R, dtype=torch.int64, device=device)
    best_score = torch.where(ok & (depth == num_accepted.unsqueeze(1)), score, float("-inf"))
    best = torch.where(num_accepted > 0, best_score.argmax(dim=1) if M else num_accepted, -1)  # [R]

    path = torch.full((R, max(D, 1)), -1, dtype=torch.int64, device=device)
    node = best
    for _ in range(D):  # climb from the best node to the root
        live = node >= 0
        if not bool(live.any()):
            break
        nc = node.clamp(min=0)
        slot = (layout.depth[r_idx, nc] - 1).clamp(min=0)
        path[r_idx[live], slot[live]] = node[live]
        node = torch.where(live, layout.parents[r_idx, nc], -1)

    stop_slot = best + 1  # [R]; 0 = root
    final_row = layout.first_row + stop_slot
    final_token = argmax[final_row]
    leaf = layout.children[r_idx, stop_slot, 0] < 0
    bonus = leaf & ~is_greedy
    rows = bonus.nonzero().squeeze(1)
    if rows.numel():
        sub = streams.take(rows.cpu().numpy())
        u = sub.uniform(SAMPLE, D + 1, device).gather(1, num_accepted[rows].unsqueeze(1)).squeeze(1)
        final_token[rows] = sample_from_weights(target_probs[final_row[rows]], u)
    return _emit(layout, path, num_accepted, final_token)


def _canonical(layout: TreeLayout) -> torch.Tensor:  # bool[R, M]: no lower-index sibling has my token
    M = layout.max_nodes
    same = ((layout.parents.unsqueeze(2) == layout.parents.unsqueeze(1))
            & (layout.tokens.unsqueeze(2) == layout.tokens.unsqueeze(1))
            & layout.valid.unsqueeze(1))  # [R, i, j]
    earlier = torch.ones(M, M, dtype=torch.bool, device=same.device).tril(-1)
    return ~(same & earlier).any(dim=2)
