"""DraftLayout: the flat verification batch viewed as a padded [R, max_k] grid.

Flat inputs (as packed by the scheduler):
- ``draft_token_ids`` int64[N]: the drafts of all R requests, request after request;
  request i owns ``cu_num_draft[i] .. cu_num_draft[i+1] - 1``.
- ``target_probs`` float[N + B, V]: request i owns ``k_i + has_bonus[i]`` rows starting at
  ``first_target[i] = cu_num_draft[i] + (bonus rows before i)``: one row per draft position,
  then its bonus row when it has one (B = number of requests with a bonus row). Row
  ``first_target[i] + j`` is the target distribution for the token at draft position j, so
  the row of the recovered token after j accepted drafts and the bonus row (j = k_i) are
  both ``first_target[i] + j``. A request without a bonus row (a proposal split by the token
  budget) emits only accepted drafts when all k_i are accepted.

The grid has one row per request and one column per draft position; padded cells are
invalid (``valid`` False) and point at a clamped, harmless index.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch


@dataclass(frozen=True)
class DraftLayout:
    num_draft: list[int]  # R, host copy of the draft counts k_i
    num_draft_t: torch.Tensor  # int64[R] on device
    max_k: int  # max_i k_i (0 when no request has drafts)
    first_draft: torch.Tensor  # int64[R]; cu_num_draft[:-1]
    first_target: torch.Tensor  # int64[R]; cu_num_draft[:-1] + i
    valid: torch.Tensor  # bool[R, max_k]; j < k_i
    draft_index: torch.Tensor  # int64[R, max_k]; into draft_token_ids / draft_probs
    target_index: torch.Tensor  # int64[R, max_k]; into target_probs
    draft_tokens: torch.Tensor  # int64[R, max_k]; draft token at (i, j); 0 where invalid
    has_bonus: torch.Tensor  # bool[R]; the request's last row is a bonus row
    num_rows: int  # N + B, rows of target_probs

    @classmethod
    def build(
        cls,
        draft_token_ids: torch.Tensor,  # int64[N]
        cu_num_draft: torch.Tensor,  # int32/int64[R + 1], cu_num_draft[0] == 0
        draft_probs: torch.Tensor | None,  # float[N, V] or None
        target_probs: torch.Tensor,  # float[N + R, V]
        is_greedy: torch.Tensor,  # bool[R]
        num_requests_rows: int | None = None,  # R for a check against the random streams
        has_bonus: torch.Tensor | None = None,  # bool[R]; None = every request has a bonus row
    ) -> "DraftLayout":
        cu = cu_num_draft.to(torch.int64).cpu()
        if cu.dim() != 1 or cu.shape[0] < 1 or cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_num_draft must be non-decreasing from 0, got {cu.tolist()}")
        num_requests, num_tokens = cu.shape[0] - 1, int(cu[-1])
        if has_bonus is None:
            has_bonus = torch.ones(num_requests, dtype=torch.bool)
        if has_bonus.shape != (num_requests,):
            raise ValueError(f"has_bonus has shape {tuple(has_bonus.shape)}, expected [{num_requests}]")
        bonus_host = has_bonus.to(torch.int64).cpu()
        num_rows = num_tokens + int(bonus_host.sum())
        if draft_token_ids.shape != (num_tokens,):
            raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, "
                             f"cu_num_draft says [{num_tokens}]")
        if target_probs.dim() != 2 or target_probs.shape[0] != num_rows:
            raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected "
                             f"[{num_rows}, vocab] (drafts + the bonus rows)")
        if draft_probs is not None and draft_probs.shape != (num_tokens, target_probs.shape[1]):
            raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                             f"[{num_tokens}, {target_probs.shape[1]}]")
        if is_greedy.shape != (num_requests,):
            raise ValueError(f"is_greedy has shape {tuple(is_greedy.shape)}, expected [{num_requests}]")
        if num_requests_rows is not None and num_requests_rows != num_requests:
            raise ValueError(f"streams has {num_requests_rows} rows, expected {num_requests}")
        if bool(((cu[1:] - cu[:-1]) == 0).logical_and(bonus_host == 0).any()):
            raise ValueError("has_bonus: a request without drafts needs its bonus row")

        device = target_probs.device
        num_draft = (cu[1:] - cu[:-1]).tolist()
        max_k = max(num_draft, default=0)
        cu = cu.to(device)
        num_draft_t = cu[1:] - cu[:-1]
        first_draft = cu[:-1]
        bonus_before = torch.cumsum(bonus_host, 0) - bonus_host
        first_target = first_draft + bonus_before.to(device)
        cols = torch.arange(max_k, device=device)
        valid = cols.unsqueeze(0) < num_draft_t.unsqueeze(1)
        draft_index = (first_draft.unsqueeze(1) + cols).clamp(max=max(num_tokens - 1, 0))
        target_index = (first_target.unsqueeze(1) + cols).clamp(max=num_rows - 1)
        if num_tokens > 0:
            draft_tokens = torch.where(valid, draft_token_ids.to(device)[draft_index], 0)
        else:
            draft_tokens = torch.zeros_like(draft_index)
        return cls(num_draft, num_draft_t, max_k, first_draft, first_target, valid,
                   draft_index, target_index, draft_tokens, has_bonus.to(device), num_rows)

    def final_row(self, num_accepted: torch.Tensor) -> torch.Tensor:  # int64[R] -> int64[R]
        """Row of the recovered or bonus token (clamped where there is none: see emits_final)."""
        return (self.first_target + num_accepted).clamp(max=self.num_rows - 1)

    def emits_final(self, num_accepted: torch.Tensor) -> torch.Tensor:  # int64[R] -> bool[R]
        """False only where every draft of a request without a bonus row was accepted."""
        return self.has_bonus | (num_accepted < self.num_draft_t)

    def count_accepted(self, accept: torch.Tensor) -> torch.Tensor:  # bool[R, max_k] -> int64[R]
        """Length of the run of accepted drafts from position 0 (stops at the first reject)."""
        return (accept & self.valid).to(torch.int64).cumprod(dim=1).sum(dim=1)

    def emit(
        self,
        num_accepted: torch.Tensor,  # int64[R]
        final_token: torch.Tensor,  # int64[R]; recovered (if a draft was rejected) or bonus
    ) -> tuple[torch.Tensor, torch.Tensor]:  # int64[R, max_k + 1] padded -1, int32[R]
        cols = torch.arange(self.max_k + 1, device=num_accepted.device)
        out = torch.full((len(self.num_draft), self.max_k + 1), -1, dtype=torch.int64,
                         device=num_accepted.device)
        out[:, : self.max_k] = torch.where(
            cols[: self.max_k].unsqueeze(0) < num_accepted.unsqueeze(1), self.draft_tokens, -1)
        final = self.emits_final(num_accepted)
        out.scatter_(1, num_accepted.unsqueeze(1), torch.where(final, final_token, -1).unsqueeze(1))
        return out, (num_accepted + final.to(torch.int64)).to(torch.int32)
