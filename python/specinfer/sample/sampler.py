"""Sampler: one token per logits row.

Greedy rows (temperature 0) take the argmax of the raw logits. Random rows sample from
``probs_from_logits`` (temperature -> min-p -> top-k -> top-p) by the exponential race
``argmax(probs / E)``, ``E ~ Exp(1)``; a seeded row's noise comes from its own generator alone
(see :mod:`.noise`), so a seeded request samples the same tokens alone or in any batch.

Logprobs are not the sampler's business: the engine reports raw logprobs of every emitted
token (sampled, accepted, recovered or bonus) through :mod:`.logprobs`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .logits_processor import probs_from_logits
from .metadata import SamplingMetadata
from .noise import draw_exponential, exponential_race


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64[L]


class Sampler:
    """Samples one token per row; unseeded rows draw from ``default_generator``."""

    def __init__(self, default_generator: torch.Generator | None = None):
        self.default_generator = default_generator  # None = torch's global generator

    def __call__(
        self,
        logits: torch.Tensor,  # float[L, V] raw logits
        meta: SamplingMetadata,  # L rows
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}, expected [{meta.num_rows}, vocab]")
        token_ids = logits.argmax(dim=-1)  # greedy rows are done
        if not meta.all_greedy:
            probs = probs_from_logits(logits, meta)  # [L, V]
            random_rows = (~meta.is_greedy).tolist()
            noise = draw_exponential(random_rows, probs.shape[1], meta.generators,
                                     self.default_generator, probs.dtype, probs.device)
            token_ids = torch.where(meta.is_greedy, token_ids, exponential_race(probs, noise))
        return SamplerOutput(token_ids=token_ids)
