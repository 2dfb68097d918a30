"""Random draws with per-request generators, and the exponential-race sampler.

Determinism contract: a row with its own ``torch.Generator`` draws only from that generator,
and how much it draws depends only on that row (its draw count and the vocabulary size),
never on the batch around it. So a seeded request produces the same tokens alone or in any
batch. Rows without a generator share one batched draw from ``default_generator`` (``None``
= torch's global generator). Generators must live on the device of the drawn tensors.
"""
from __future__ import annotations

from typing import Sequence

import torch


def draw_uniform(
    counts: Sequence[int],  # R; how many U[0, 1) draws row i takes (0 = none)
    generators: Sequence[torch.Generator | None],  # R
    default_generator: torch.Generator | None,
    width: int,  # >= max(counts)
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # dtype[R, width]; row i valid in [:counts[i]], padding 0
    num_rows = len(counts)
    out = torch.zeros(num_rows, width, dtype=dtype, device=device)
    shared = [i for i in range(num_rows) if generators[i] is None and counts[i] > 0]
    if shared:
        rows = torch.as_tensor(shared, device=device)
        cols = torch.arange(width, device=device)
        n = torch.as_tensor([counts[i] for i in shared], device=device)
        mask = cols.unsqueeze(0) < n.unsqueeze(1)  # [len(shared), width], row-major fill
        block = torch.zeros(len(shared), width, dtype=dtype, device=device)
        block[mask] = torch.rand(int(mask.sum()), generator=default_generator,
                                 dtype=dtype, device=device)
        out[rows] = block
    for i, gen in enumerate(generators):
        if gen is not None and counts[i] > 0:
            out[i, : counts[i]] = torch.rand(counts[i], generator=gen, dtype=dtype, device=device)
    return out


def draw_exponential(
    active: Sequence[bool],  # R; rows that sample (greedy rows draw nothing)
    num_cols: int,  # V
    generators: Sequence[torch.Generator | None],  # R
    default_generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # dtype[R, V]; Exp(1) noise on active rows, 1.0 on the others
    out = torch.ones(len(active), num_cols, dtype=dtype, device=device)
    shared = [i for i, a in enumerate(active) if a and generators[i] is None]
    if shared:
        block = torch.empty(len(shared), num_cols, dtype=dtype, device=device)
        out[torch.as_tensor(shared, device=device)] = block.exponential_(
            generator=default_generator)
    for i, gen in enumerate(generators):
        if gen is not None and active[i]:
            out[i].exponential_(generator=gen)
    # Exp(1) can round to 0; a zero would turn weight/noise into inf or NaN (argmax picks NaN).
    return out.clamp_(min=torch.finfo(dtype).tiny)


def exponential_race(
    weights: torch.Tensor,  # float[R, V] >= 0; need not be normalized
    noise: torch.Tensor,  # float[R, V] Exp(1)
) -> torch.Tensor:  # int64[R]
    """argmax_v weights[v] / E_v with E_v ~ Exp(1) i.i.d. is distributed as weights / sum.

    (E_v / weights[v] is exponential with rate weights[v]; the smallest of independent
    exponentials is the one with rate weights[v] with probability weights[v] / sum.)
    """
    return (weights / noise).argmax(dim=-1)
