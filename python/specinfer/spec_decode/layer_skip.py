"""Layer-skip self-speculation (LayerSkip, arXiv 2404.16710): the draft is the target itself cut
after its first E layers, followed by the target's final norm and lm_head. No extra weights.

KV: the draft shares the target's paged KV for layers < E. Drafting request r (N confirmed
tokens, target KV valid for positions < N - 1) runs the first E layers over its newest token at
position N - 1, then over each draft at N, N + 1, ...: those writes land in the lookahead slots
the core reserved, and next step's verification rewrites the same positions through every layer,
with the same values for layers < E (their KV depends only on the tokens up to the position).
So nothing is kept per request and nothing needs catching up after chunked prefill, prefix hits,
preemption or pauses. (The reference reuses the draft's layer-E states in verification; we
recompute them: simpler, and the target forward over k + 1 tokens costs little more than 1.)

Drafts are the argmax of the early-exit logits (deterministic: q = one-hot, lossless).
With E = L the draft is the target: every draft is accepted under greedy decoding.
"""
from __future__ import annotations

import numpy as np
import torch

from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.models.model_runner import ModelRunner
from specinfer.spec_decode.proposer import Proposal, ProposalInput, Proposer


class LayerSkipProposer(Proposer):
    kv_models: list = []  # shares the target's cache: no KV of its own
    aux_layers = ()

    def __init__(self, spec, ctx):
        num_layers = ctx.target.config.num_layers
        if not 1 <= spec.exit_layer <= num_layers:
            raise ValueError(f"speculative.exit_layer must be in 1..{num_layers} (the target's layers), "
                             f"got {spec.exit_layer}")
        self.exit_layer = spec.exit_layer
        self.model = ctx.target.model
        self.num_lookahead_tokens = spec.num_speculative_tokens
        self.block_size = ctx.block_size
        self.device = ctx.device
        self.runner: ModelRunner | None = None
        self.make_runner = getattr(ctx, "make_eager_runner", None) or ModelRunner  # sharded under TP

    def bind_kv_caches(self, kv_caches_per_model, backend) -> None:
        self.backend = backend

    def bind_target_kv_caches(self, target_kv_caches: list) -> None:
        self.runner = self.make_runner(self.model, target_kv_caches, self.backend)

    def forget(self, core_ids) -> None:
        pass

    def propose(self, inp: ProposalInput) -> Proposal:
        rows = np.flatnonzero(inp.max_drafts > 0)
        if len(rows) == 0:
            return Proposal.empty()
        limit = inp.max_drafts[rows]
        steps = int(limit.max())
        drafted = np.zeros((len(rows), steps), dtype=np.int64)
        tokens = inp.last_tokens(rows)  # int64[P] newest token, at position N - 1
        positions = np.fromiter((inp.requests[r].num_tokens - 1 for r in rows), np.int64, len(rows))
        active = np.arange(len(rows))
        for i in range(steps):
            attn, _ = attention_metadata_for_runs(inp.block_rows[rows[active]], positions[active],
                                                  np.ones(len(active), np.int64), self.block_size, self.device)
            hidden, _ = self.runner.forward(torch.from_numpy(tokens[active]).to(self.device),
                                            torch.from_numpy(positions[active]).to(self.device), attn,
                                            exit_layer=self.exit_layer)  # [A, hidden]
            drafted[active, i] = self.runner.logits(hidden).argmax(-1).cpu().numpy()
            tokens[active] = drafted[active, i]
            positions[active] += 1
            active = active[limit[active] > i + 1]
            if len(active) == 0:
                break
        return Proposal.from_drafts(inp.core_ids[rows], drafted, limit)
