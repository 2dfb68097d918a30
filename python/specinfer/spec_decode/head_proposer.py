"""Proposers whose head reads the target's final hidden state h_t at the sampled position (the
state whose lm_head output produced the newest token x_{t+1}) and drafts x_{t+2}, x_{t+3}, ...
in one go: MLP speculator and Medusa. No KV, nothing kept per request, no extra target forward.

Drafts are each head's argmax, a deterministic proposal (q = one-hot), so rejection sampling
stays lossless; typical acceptance works as with any proposer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specinfer.spec_decode.proposer import Proposal, ProposalInput


class HiddenStateHeadProposer:
    kv_models: list = []
    aux_layers = ()
    num_lookahead_tokens = 0

    def __init__(self, head, k: int):
        self.head = head  # .draft(hidden [P, H], tokens int64[P], steps) -> int64[P, steps]
        self.k = k

    @classmethod
    def check_k(cls, k: int, most: int, what: str, model: str) -> None:
        if k > most:
            raise ValueError(f"speculative.num_speculative_tokens={k} exceeds what the {what} at {model!r} predicts "
                             f"({most}); use at most {most}")

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        pass

    def forget(self, core_ids) -> None:
        pass

    @torch.inference_mode()
    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        if len(rows) == 0:
            return Proposal.empty()
        limit = inp.max_drafts[rows]
        final = inp.hidden.final
        hidden = final[torch.from_numpy(inp.sampled_rows[rows]).to(final.device)]  # [P, H]
        tokens = torch.from_numpy(inp.last_tokens(rows)).to(final.device)  # int64[P] x_{t+1}
        drafts = self.head.draft(hidden, tokens, int(limit.max())).cpu().numpy()  # int64[P, steps]
        return Proposal.from_drafts(inp.core_ids[rows], drafts, limit)


def checkpoint_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"speculative.model {model!r} is not a directory holding a head checkpoint")
    return path
