"""Lossless verification of draft tokens by modified rejection sampling.

Vocabulary (DESIGN.md §4):
- target: the model whose output distribution must be preserved; p = its probabilities.
- draft: the proposer's guesses; q = the proposer's probabilities (one-hot for a model-free
  proposer such as n-gram, passed as ``draft_probs=None``).
- proposal -> verification: request i proposes k_i draft tokens x_0..x_{k_i-1}; the target
  scores all of them plus one more position in one forward pass.
- accepted tokens: the drafts kept. x_j is accepted iff u_j < min(1, p_j(x_j) / q_j(x_j))
  with u_j ~ U[0, 1) (strict <: a token with p_j(x_j) = 0 is never accepted).
- recovered token: at the first rejection j, one token sampled from the residual
  normalize(max(0, p_j - q_j)).
- bonus token: when all k_i drafts are accepted, one token sampled from the bonus row p_{k_i}.
- emitted tokens = accepted + (recovered or bonus): 1 .. k_i + 1 per request.

Every emitted token is then distributed exactly as under target-only sampling
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

p and q must come from the same processing (``probs_from_logits``: temperature, min-p,
top-k, top-p) with the request's parameters. Greedy requests take the exact-match path:
accept while x_j == argmax p_j, then emit argmax of the next target row; they draw no
randomness. If the residual is all zero (p == q on the rejected row, probability 0 in exact
arithmetic, reachable only through rounding) the recovered token is sampled from p instead.

Randomness: counter-based (see :mod:`.random_streams`). Request i's draft at output position
``P_i + j`` is tested against ``U(seed_i, P_i + j, ACCEPT)``; its recovered or bonus token at
``P_i + m`` is drawn by inverse CDF with ``U(seed_i, P_i + m, SAMPLE)``. No state is consumed,
so a request's outcome does not depend on the batch, and a cancelled step replays exactly.
Greedy requests use no randomness.

A request whose proposal was split by the token budget has no bonus row (``has_bonus``
False): when all its verified drafts are accepted it emits just those, and the rest of its
proposal is verified next step with the same draws it would have met now.

The accept test, the uniform draw and the residual are separate small functions so the
statistical tests can replace each with a known-broken variant and watch the test fail.
"""
from __future__ import annotations

import torch

from .argmax import argmax_last
from .draft_layout import DraftLayout
from .random_streams import ACCEPT, SAMPLE, RandomStreams, sample_from_weights


def _draw_uniform(
    streams: RandomStreams,  # R rows
    width: int,  # max_k
    device: torch.device,
) -> torch.Tensor:  # float64[R, width], U(seed_i, P_i + j, ACCEPT)
    return streams.uniform(ACCEPT, width, device)


def _accept(
    uniform: torch.Tensor,  # [R, max_k] U[0, 1)
    target_prob: torch.Tensor,  # [R, max_k] p_j(x_j)
    draft_prob: torch.Tensor,  # [R, max_k] q_j(x_j) (> 0: x_j was drawn from q_j)
) -> torch.Tensor:  # bool[R, max_k]
    """u < min(1, p/q); the min is implicit since u < 1."""
    return uniform < target_prob / draft_prob


def _residual(
    target_probs: torch.Tensor,  # [R, V] p on the rejected row
    draft_probs: torch.Tensor,  # [R, V] q on the rejected row
) -> torch.Tensor:  # [R, V] unnormalized weights of the recovered token
    """max(0, p - q), or p where that is all zero (never 0/0, never NaN).

    Left unnormalized: the exponential race only needs weights.
    """
    residual = (target_probs - draft_probs).clamp_(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # int64[N]
    cu_num_draft: torch.Tensor,  # int32/int64[R + 1]
    draft_probs: torch.Tensor | None,  # float[N, V]; None = model-free proposer (one-hot q)
    target_probs: torch.Tensor,  # float[N + B, V]; k_i draft rows (+ 1 bonus row) per request
    is_greedy: torch.Tensor,  # bool[R]
    streams: RandomStreams,  # R rows: seed and output position of the first draft
    has_bonus: torch.Tensor | None = None,  # bool[R]; None = every request has a bonus row
) -> tuple[torch.Tensor, torch.Tensor]:  # int64[R, max_k + 1] padded -1, int32[R]
    """Verify the drafts of R requests; returns (output_token_ids, num_emitted).

    ``output_token_ids[i, :num_emitted[i]]`` are request i's emitted tokens: its accepted
    drafts followed by one recovered or bonus token (none when a request without a bonus row
    accepted all its drafts); the rest is -1.
    """
    layout = DraftLayout.build(draft_token_ids, cu_num_draft, draft_probs, target_probs,
                               is_greedy, len(streams), has_bonus)
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    is_greedy = is_greedy.to(device)
    all_greedy = bool(is_greedy.all())
    target_argmax = argmax_last(target_probs)  # [N + B]

    # Acceptance, greedy requests: exact match with the target argmax.
    accept = layout.draft_tokens == target_argmax[layout.target_index]  # [R, max_k]
    if not all_greedy:
        target_prob = target_probs[layout.target_index, layout.draft_tokens]  # [R, max_k]
        if draft_probs is None:
            draft_prob = torch.ones_like(target_prob)
        else:
            draft_prob = draft_probs[layout.draft_index, layout.draft_tokens]
        draft_prob = torch.where(layout.valid, draft_prob, 1.0)
        uniform = _draw_uniform(streams, layout.max_k, device)
        accept = torch.where(is_greedy.unsqueeze(1), accept,
                             _accept(uniform, target_prob, draft_prob))
    num_accepted = layout.count_accepted(accept)  # [R]

    # The recovered or bonus token comes from target row first_target + num_accepted.
    final_row = layout.final_row(num_accepted)  # [R]
    final_token = target_argmax[final_row]
    if not all_greedy:
        p = target_probs[final_row]  # [R, V]
        rejected = num_accepted < layout.num_draft_t  # [R]; False = bonus
        rejected_draft = (layout.first_draft + num_accepted).clamp(
            max=max(draft_token_ids.shape[0] - 1, 0))
        if draft_probs is not None:
            q = draft_probs[rejected_draft]
        elif draft_token_ids.shape[0] > 0:
            q = torch.nn.functional.one_hot(
                draft_token_ids.to(device)[rejected_draft], vocab_size).to(p.dtype)
        else:
            q = torch.zeros_like(p)
        weights = torch.where(rejected.unsqueeze(1), _residual(p, q), p)
        u = streams.uniform(SAMPLE, layout.max_k + 1, device).gather(
            1, num_accepted.unsqueeze(1)).squeeze(1)  # [R], at output position P_i + m
        final_token = torch.where(is_greedy, final_token, sample_from_weights(weights, u))
    return layout.emit(num_accepted, final_token)
