"""Medusa-style typical acceptance of draft tokens. NOT distribution-preserving.

Vocabulary as in :mod:`.rejection_sampler`. Draft x_j is accepted while
``p_j(x_j) > min(posterior_threshold, posterior_alpha * exp(-H(p_j)))`` where H is the
entropy (nats) of the target row p_j (Cai et al. 2024, "Medusa", §2.3.1). At the first
rejection the emitted token is argmax p_j (a greedy fallback, not a residual sample); when
all drafts are accepted, the bonus token is sampled from the bonus row (argmax for greedy
requests). Greedy requests accept by exact match with argmax p_j.

This sampler does NOT preserve the target distribution: it accepts any token the target
finds "typical enough" and replaces rejected ones by the mode. Its output is not distributed
as target-only sampling; use it when the proposer has no useful draft probabilities (Medusa
heads) and speed matters more than exactness. ``draft_probs`` is accepted for interface
parity with ``rejection_sample`` and ignored.

Randomness: only the bonus token of a non-greedy request, drawn by inverse CDF with
``U(seed, P + k, SAMPLE)`` (counter-based, :mod:`.random_streams`); rows that take no bonus
token draw nothing.
"""
from __future__ import annotations

import torch

from .argmax import argmax_last
from .draft_layout import DraftLayout
from .random_streams import SAMPLE, RandomStreams, sample_from_weights


def entropy(probs: torch.Tensor) -> torch.Tensor:  # float[M, V] -> float[M], nats, 0 log 0 = 0
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def typical_acceptance_sample(
    draft_token_ids: torch.Tensor,  # int64[N]
    cu_num_draft: torch.Tensor,  # int32/int64[R + 1]
    draft_probs: torch.Tensor | None,  # float[N, V]; ignored
    target_probs: torch.Tensor,  # float[N + B, V]; k_i draft rows (+ 1 bonus row) per request
    is_greedy: torch.Tensor,  # bool[R]
    streams: RandomStreams,  # R rows
    has_bonus: torch.Tensor | None = None,  # bool[R]; None = every request has a bonus row
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> tuple[torch.Tensor, torch.Tensor]:  # int64[R, max_k + 1] padded -1, int32[R]
    """Verify drafts by typical acceptance; returns (output_token_ids, num_emitted)."""
    layout = DraftLayout.build(draft_token_ids, cu_num_draft, draft_probs, target_probs,
                               is_greedy, len(streams), has_bonus)
    device = target_probs.device
    is_greedy = is_greedy.to(device)
    target_argmax = argmax_last(target_probs)  # [N + R]

    rows = target_probs[layout.target_index]  # [R, max_k, V]
    threshold = torch.clamp(
        posterior_alpha * torch.exp(-entropy(rows)), max=posterior_threshold)  # [R, max_k]
    typical = rows.gather(2, layout.draft_tokens.unsqueeze(2)).squeeze(2) > threshold
    exact = layout.draft_tokens == target_argmax[layout.target_index]
    num_accepted = layout.count_accepted(torch.where(is_greedy.unsqueeze(1), exact, typical))

    final_row = layout.final_row(num_accepted)  # [R]
    final_token = target_argmax[final_row]  # rejected: greedy fallback
    bonus = (num_accepted == layout.num_draft_t) & layout.has_bonus & ~is_greedy  # [R]
    rows = bonus.nonzero().squeeze(1)
    if rows.numel():
        sub = streams.take(rows.cpu().numpy())
        u = sub.uniform(SAMPLE, layout.max_k + 1, device).gather(
            1, num_accepted[rows].unsqueeze(1)).squeeze(1)
        final_token[rows] = sample_from_weights(target_probs[final_row[rows]], u)
    return layout.emit(num_accepted, final_token)
