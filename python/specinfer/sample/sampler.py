"""Sampler: one token per logits row.

Greedy rows (temperature 0) take the argmax of the raw logits. Random rows sample from
``probs_from_logits`` (temperature -> min-p -> top-k -> top-p) by inverse CDF with one uniform
from the row's counter-based stream (``SAMPLE`` at the row's output position; see
:mod:`.random_streams`), so a request samples the same tokens alone or in any batch.

Logprobs are not the sampler's business: the engine reports raw logprobs of every emitted
token (sampled, accepted, recovered or bonus) through :mod:`.logprobs`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .argmax import argmax_last
from .logits_processor import probs_from_logits
from .metadata import SamplingMetadata
from .random_streams import SAMPLE, sample_from_weights


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64[L]


class Sampler:
    """Samples one token per row from the row's random stream."""

    def __call__(
        self,
        logits: torch.Tensor,  # float[L, V] raw logits
        meta: SamplingMetadata,  # L rows
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}, expected [{meta.num_rows}, vocab]")
        token_ids = argmax_last(logits)  # greedy rows are done
        if not meta.all_greedy:
            if meta.streams is None:
                raise ValueError("streams: rows with temperature > 0 need random streams")
            probs = probs_from_logits(logits, meta)  # [L, V]
            u = meta.streams.uniform(SAMPLE, device=probs.device)[:, 0]  # [L]
            token_ids = torch.where(meta.is_greedy, token_ids, sample_from_weights(probs, u))
        return SamplerOutput(token_ids=token_ids)
