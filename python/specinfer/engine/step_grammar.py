"""The token masks of one step's logits rows for the requests with structured outputs.

A constrained request's row j decides the token after its committed tokens plus the drafts
before row j (a tree node: the drafts on its path), so its mask is the grammar's mask in that
state: llguidance advances a copy of the request's matcher over the drafts and rolls back, for
every constrained request at once on its thread pool (chains), or node by node (trees). Rows no
emitted token can come from (past a draft the grammar refuses, whose own row rejects it) and
requests whose matcher failed allow every token; the engine computes the masks while the step's
forward runs (they depend only on the schedule and the committed tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import llguidance
import llguidance.torch as ll_torch
import numpy as np
import torch


@dataclass
class StepMasks:
    rows: np.ndarray  # int64[K] logits rows with a mask
    bitmask: torch.Tensor  # int32[K, ceil(V / 32)]: bit t of row k = token t allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [L, V] with the masked rows' refused tokens at -inf: in place for float32/64
        logits (the step's own tensor), else in a float32 copy. The bits are unpacked by numpy on
        the host (4x torch's shifts there) or by torch on the logits' device."""
        out = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        V, K = out.shape[1], len(self.rows)
        if out.device.type == "cpu":  # int32 words little-endian: bit t of word w is token 32 w + t
            allowed = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
            refused = torch.from_numpy(~allowed.view(bool))
        else:
            bits = self.bitmask.to(out.device, non_blocking=True)
            shifts = torch.arange(32, device=out.device, dtype=torch.int32)
            refused = (((bits.unsqueeze(-1) >> shifts) & 1) == 0).reshape(K, -1)[:, :V]
        with torch.inference_mode():  # the forward's logits are inference tensors
            if K == out.shape[0] and bool((self.rows == np.arange(K)).all()):
                return out.masked_fill_(refused, float("-inf"))
            rows = torch.from_numpy(self.rows).to(out.device)
            sub = out.index_select(0, rows).masked_fill_(refused, float("-inf"))
            return out.index_copy_(0, rows, sub)


class StepGrammar:
    """Builds a step's masks; one per engine (it owns llguidance's thread pool)."""

    def __init__(self, vocab_size: int):
        self.words = (vocab_size + 31) // 32
        self._executor = None

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def masks(self, sched, states, trees: dict) -> StepMasks | None:
        """`trees`: scheduled index -> draft parents of the requests whose proposal is a tree."""
        if not any(st.grammar is not None for st in states):
            return None
        cu_logits = np.asarray(sched.cu_num_logits)
        num_draft = np.asarray(sched.num_draft_tokens, dtype=np.int64)
        cu_d = np.concatenate([[0], np.cumsum(num_draft)])
        drafts = np.asarray(sched.draft_token_ids, dtype=np.int64)
        rows, chains, tree_jobs = [], [], []
        for i, st in enumerate(states):
            n = int(cu_logits[i + 1] - cu_logits[i])
            g = st.grammar
            if n == 0 or g is None or g.error is not None or st.finished:
                continue
            local = len(rows)
            rows.extend(range(int(cu_logits[i]), int(cu_logits[i]) + n))
            d = drafts[cu_d[i]:cu_d[i + 1]]
            if i in trees:
                tree_jobs.append((g, local, d, trees[i]))
            else:
                chains.append((g.matcher, local, d[:n - 1].tolist()))
        if not rows:
            return None
        bitmask = torch.zeros((len(rows), self.words), dtype=torch.int32)
        with_drafts = [c for c in chains if c[2]]
        if with_drafts:
            ll_torch.fill_next_token_bitmask_par_with_draft_tokens(self.executor, with_drafts, bitmask)
        if len(with_drafts) < len(chains):
            ll_torch.fill_next_token_bitmask_par(self.executor, [c[:2] for c in chains if not c[2]], bitmask)
        view = bitmask.numpy()
        for g, local, d, parents in tree_jobs:
            g.fill_tree(view, local, d, parents)
        empty = ~view.any(axis=1)
        if empty.any():  # unreachable rows (past a refused draft): any token, never used
            view[empty] = -1
        return StepMasks(np.asarray(rows, dtype=np.int64), bitmask)
