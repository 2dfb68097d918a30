"""Sampler: one token per logits row, plus optional logprobs.

Greedy rows (temperature 0) take the argmax of the raw logits. Random rows sample from
``probs_from_logits`` (temperature -> min-p -> top-k -> top-p) by inverse CDF with one uniform
from the row's counter-based stream (``SAMPLE`` at the row's output position; see
:mod:`.random_streams`), so a request samples the same tokens alone or in any batch.

Logprobs are "raw logprobs": ``log_softmax`` of the RAW logits, i.e. the model's own
distribution before temperature / top-k / top-p / min-p (vLLM's default ``raw_logprobs``).
They describe what the model believes, not the processed distribution the token was drawn
from; a token masked by top-k still has a finite logprob.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .logits_processor import probs_from_logits
from .metadata import SamplingMetadata
from .random_streams import SAMPLE, sample_from_weights


@dataclass(frozen=True)
class LogprobsTensors:
    """Raw logprobs of the sampled token (column 0) followed by the top-N tokens."""

    token_ids: torch.Tensor  # int64[L, N + 1]; column 0 = sampled token, 1.. = top-N, descending
    logprobs: torch.Tensor  # float32[L, N + 1]; log_softmax(raw logits) at token_ids
    sampled_token_ranks: torch.Tensor  # int64[L]; 1 + number of tokens with a higher logprob


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64[L]
    logprobs: LogprobsTensors | None  # None unless meta.max_num_logprobs is set


def compute_logprobs(
    logits: torch.Tensor,  # float[L, V] raw logits
    token_ids: torch.Tensor,  # int64[L] sampled tokens
    num_logprobs: int,  # N >= 0
) -> LogprobsTensors:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [L, 1]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [L, N]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled, top_logprobs], dim=1),
        sampled_token_ranks=(logprobs > sampled).sum(dim=-1) + 1,
    )


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
        token_ids = logits.argmax(dim=-1)  # greedy rows are done
        if not meta.all_greedy:
            if meta.streams is None:
                raise ValueError("streams: rows with temperature > 0 need random streams")
            probs = probs_from_logits(logits, meta)  # [L, V]
            u = meta.streams.uniform(SAMPLE, device=probs.device)[:, 0]  # [L]
            token_ids = torch.where(meta.is_greedy, token_ids, sample_from_weights(probs, u))
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
