"""Raw logprobs of emitted tokens: the one implementation the engine reports from.

"Raw" = ``log_softmax`` of the model's RAW logits, before temperature / top-k / top-p / min-p
(vLLM's default ``raw_logprobs``). They describe what the model believes, not the processed
distribution a token was drawn from: a token masked by top-k still has a finite logprob.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogprobsTensors:
    """Raw logprobs of the emitted token (column 0) followed by the top-N tokens."""

    token_ids: torch.Tensor  # int64[L, N + 1]; column 0 = emitted token, 1.. = top-N, descending
    logprobs: torch.Tensor  # float32[L, N + 1]; log_softmax(raw logits) at token_ids
    sampled_token_ranks: torch.Tensor  # int64[L]; 1 + number of tokens with a higher logprob

    def entries(self, top_n: int) -> list[dict[int, float]]:
        """Per row {token_id: logprob}: the emitted token and the first `top_n` top tokens."""
        ids = self.token_ids[:, : top_n + 1].tolist()
        vals = self.logprobs[:, : top_n + 1].tolist()
        # the emitted token last, so its entry wins when it is also among the top-N
        return [{**dict(zip(i[1:], v[1:])), i[0]: v[0]} for i, v in zip(ids, vals)]


def compute_logprobs(
    logits: torch.Tensor,  # float[L, V] raw logits
    token_ids: torch.Tensor,  # int64[L] emitted tokens
    num_logprobs: int,  # N >= 0
) -> LogprobsTensors:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [L, V]
    token_ids = token_ids.to(logprobs.device)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))  # [L, 1]
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [L, N]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled, top_logprobs], dim=1),
        sampled_token_ranks=(logprobs > sampled).sum(dim=-1) + 1,
    )
