"""Speculation metrics, per engine (requests keep their own counts in RequestOutput)."""
from __future__ import annotations

import numpy as np


class SpecMetrics:
    def __init__(self, k: int):
        self.k = k
        self.num_drafts = 0  # verifications that carried >= 1 draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0  # in verifications, bonus/recovered included
        self.max_emittable_tokens = 0  # sum over verifications of (drafts + 1)
        self.drafts_at = np.zeros(k, dtype=np.int64)  # verifications with a draft at position j
        self.accepted_at = np.zeros(k, dtype=np.int64)
        self.propose_s = self.score_s = self.verify_s = self.total_s = 0.0
        # the step's timeline (engine/llm_engine.py): the target forward where it ran (the device,
        # or the thread standing in for it), the engine blocked on its result, and the previous
        # step's output work done beside it. Device idle time (the bubble) = total_s - device_s.
        self.device_s = self.wait_s = self.tail_s = 0.0
        self.num_steps = 0

    def record(self, num_draft: np.ndarray, num_accepted: np.ndarray,
               num_emitted: np.ndarray | None = None, num_rows: np.ndarray | None = None) -> None:
        """int[R] for the requests of one step: drafts verified, accepted, tokens emitted and
        logits rows (a proposal split by the token budget has no bonus row: rows == drafts)."""
        # (every verification step runs this: bincounts instead of masks and [R, k] grids, ~4x cheaper)
        has = num_draft > 0
        n = int(np.count_nonzero(has))
        if not n:
            return
        d = num_draft.astype(np.int64, copy=False)
        a = num_accepted.astype(np.int64) * has
        e = a + has if num_emitted is None else num_emitted * has
        rows = d + has if num_rows is None else np.maximum(num_rows, d) * has
        self.num_drafts += n
        self.num_draft_tokens += int(d.sum())
        self.num_accepted_tokens += int(a.sum())
        self.num_emitted_tokens += int(e.sum())
        self.max_emittable_tokens += int(rows.sum())
        # position j counts the requests with more than j drafts (accepted): len - #(x <= j)
        k, R = self.k, len(d)
        self.drafts_at += R - np.cumsum(np.bincount(d, minlength=k))[:k]
        self.accepted_at += R - np.cumsum(np.bincount(a, minlength=k))[:k]

    def as_dict(self) -> dict:
        nd, ndt = self.num_drafts, self.num_draft_tokens
        return {
            "num_speculative_tokens": self.k,
            "num_drafts": nd,
            "num_draft_tokens": ndt,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / ndt if ndt else 0.0,
            "mean_acceptance_length": self.num_emitted_tokens / nd if nd else 0.0,
            "accepted_per_position": [float(a / d) if d else 0.0 for a, d in zip(self.accepted_at, self.drafts_at)],
            "system_efficiency": self.num_emitted_tokens / self.max_emittable_tokens if self.max_emittable_tokens else 0.0,
            "propose_s": self.propose_s,
            "score_s": self.score_s,
            "verify_s": self.verify_s,
            "overhead_s": max(0.0, self.total_s - self.propose_s - self.score_s - self.verify_s),
            "device_s": self.device_s,
            "wait_s": self.wait_s,
            "tail_s": self.tail_s,
            "bubble_s": max(0.0, self.total_s - self.device_s),
            "num_steps": self.num_steps,
        }
