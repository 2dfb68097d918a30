"""Handles on a draft head (Medusa, MLP speculator, EAGLE, EAGLE-3): what a proposer calls.

A proposer never touches a head's weights or KV pool directly; it calls its handle:

    head.stage(i, state, tokens)               # Medusa / MLP speculator stage i: (state, logits)
    head.forward_attn(tokens, feats, pos, attn) # EAGLE: the draft layer over its own paged KV
    head.full_logits(h) / head.draft_tokens(h)  # EAGLE: logits over the target vocabulary / argmax
    head.copy_block(src, dst)                   # EAGLE: one block of its KV pool to another

`LocalHead` runs them on this process's head (the in-process executor, and each rank's shard).
`RanksHead` (tensor parallelism) sends each such call to every rank of the target's group as one
message (executor/messages.HeadCall): each rank runs it on its shard of the head (vocab-parallel
lm_heads and embeddings, the EAGLE layer split by attention heads), the collectives inside keep
the ranks in step, and the driver's own result comes back. Everything else (attributes, the
stage-0 state, the EAGLE features computed from the target's hidden states) is read from the
driver's shard, which holds the replicated parts whole.
"""
from __future__ import annotations

import torch

from specinfer.attention import ForwardContext

# the calls that run on every rank (they compute with sharded weights or change a KV pool)
RANK_CALLS = frozenset({"stage", "forward_attn", "full_logits", "draft_tokens", "copy_block"})


class LocalHead:
    def __init__(self, head):
        self.head = head
        self.kv_caches: list[torch.Tensor] = []
        self.backend = None

    def bind(self, kv_caches, backend) -> None:
        self.kv_caches, self.backend = kv_caches, backend

    def forward_attn(self, tokens, features, positions, attn) -> torch.Tensor:
        ctx = ForwardContext(self.backend, self.backend.prepare(attn), self.kv_caches)
        return self.head.forward(tokens, features, positions, ctx)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        for cache in self.kv_caches:
            cache[:, dst].copy_(cache[:, src])

    def call(self, name: str, args: tuple):
        """One of RANK_CALLS by name (a rank handling the driver's HeadCall)."""
        if name not in RANK_CALLS:
            raise ValueError(f"not a head call: {name!r}")
        return getattr(self, name)(*args)

    def __getattr__(self, name):  # the head's own methods and attributes
        if name == "head":
            raise AttributeError(name)
        return getattr(self.head, name)


class RanksHead:
    def __init__(self, executor, local: LocalHead):
        self._executor = executor
        self._local = local

    def bind(self, kv_caches, backend) -> None:
        pass  # every rank bound its own shard's pool when the executor allocated the KV caches

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in RANK_CALLS:
            return lambda *args: self._executor.head_call(name, args)
        return getattr(self._local, name)
