"""Logits processing: temperature, min-p, top-k, top-p on a [L, V] tensor, vectorized.

Order (vLLM V1's): temperature -> min-p -> top-k -> top-p. min-p depends only on the ratio
p_i / p_max, which top-k and top-p (they keep the max) do not change, so min-p commutes with
top-k; top-p is applied last, to the renormalized survivors of min-p and top-k.

Ties: top-k keeps every token whose logit equals the k-th largest (so it may keep more than
k); top-p sorts with a stable sort, so among tied tokens the lower token id comes first.

The target and draft distributions of a verification must go through the *same* functions
(:func:`probs_from_logits`), or rejection sampling stops being lossless.

Masked tokens get logit ``-inf``. Half-precision logits are upcast to float32; float32 and
float64 are kept (tests run in float64 for exact arithmetic).
"""
from __future__ import annotations

import torch

from .argmax import argmax_last
from .metadata import SamplingMetadata


def _working_dtype(logits: torch.Tensor) -> torch.dtype:
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def apply_temperature(
    logits: torch.Tensor,  # float[L, V]
    temperature: torch.Tensor,  # float[L]
    is_greedy: torch.Tensor,  # bool[L]; greedy rows are left unscaled (divide by 1)
) -> torch.Tensor:  # float[L, V]
    t = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    return logits / t.to(logits.dtype).unsqueeze(1)


def apply_min_p(
    logits: torch.Tensor,  # float[L, V]
    min_p: torch.Tensor,  # float[L]; 0 = off
) -> torch.Tensor:  # float[L, V]
    """Mask tokens whose probability is below ``min_p * max probability`` of their row."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # float[L, V]
    top_k: torch.Tensor | None,  # int64[L]; 0 or -1 = off; None = no row uses top-k
    top_p: torch.Tensor | None,  # float[L]; 1 = off; None = no row uses top-p
) -> torch.Tensor:  # float[L, V]
    """One descending sort serves both filters.

    top-k: keep tokens with logit >= the k-th largest logit.
    top-p: keep the smallest prefix of the sorted tokens whose mass reaches ``top_p``, i.e.
    a token is kept iff the mass of the tokens sorted before it is < ``top_p`` (the most
    probable token is always kept).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
        kth_logit = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [L, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        # exclusive prefix sum: the mass of the tokens sorted before each token
        mass_before = torch.nn.functional.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
        drop = mass_before >= top_p.to(sorted_probs.dtype).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def process_logits(
    logits: torch.Tensor,  # float[L, V] raw model logits; not modified
    meta: SamplingMetadata,
) -> torch.Tensor:  # float32/float64[L, V]
    """Temperature, min-p, top-k, top-p; each step skipped when no row uses it.

    Greedy rows come out unscaled; they are only meaningful through their argmax.
    """
    logits = logits.to(_working_dtype(logits))
    if meta.all_greedy:
        return logits
    logits = apply_temperature(logits, meta.temperature, meta.is_greedy)
    if not meta.no_min_p:
        logits = apply_min_p(logits, meta.min_p)
    return apply_top_k_top_p(
        logits,
        None if meta.no_top_k else meta.top_k,
        None if meta.no_top_p else meta.top_p,
    )


def probs_from_logits(
    logits: torch.Tensor,  # float[L, V] raw model logits
    meta: SamplingMetadata,
) -> torch.Tensor:  # float32/float64[L, V]; greedy rows one-hot at the raw-logits argmax
    """The distribution each row samples from (target and draft alike)."""
    argmax = argmax_last(logits)  # [L]
    dtype = _working_dtype(logits)
    if meta.all_greedy:
        return torch.nn.functional.one_hot(argmax, logits.shape[-1]).to(dtype)
    probs = process_logits(logits, meta).softmax(dim=-1)
    if not meta.all_random:
        one_hot = torch.nn.functional.one_hot(argmax, logits.shape[-1]).to(dtype)
        probs = torch.where(meta.is_greedy.unsqueeze(1), one_hot, probs)
    return probs
