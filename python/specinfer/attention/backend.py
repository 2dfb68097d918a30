"""The attention-backend protocol. A backend stores new K/V into the paged cache and attends.

Per-layer options (every backend implements both; models pass them per layer):

  softcap c   attention-logit soft-capping (Gemma 2): a score s = scale * (q . k) becomes
              c * tanh(s / c) before the mask and the softmax.
  window W    sliding-window attention (Mistral, Qwen2, Gemma 2/3 local layers), HF's rule: a
              query at position p sees keys j with p - W < j <= p. For an ordinary token p is
              its KV position. For a token-tree token (tree_mask != 0, see metadata.py) p is its
              logical position, tree_start + popcount(tree_mask) - 1 (root + depth): cached
              prefix keys j < tree_start are visible iff p - j < W, and its in-tree ancestors
              are always visible (they lie within 64 positions; the engine refuses trees under
              a window shorter than MAX_TREE_SLOTS).
"""
from __future__ import annotations

from typing import Protocol

import torch

from specinfer.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> object:
        """Once per forward: precompute whatever every layer reuses (gather indices, masks)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        prepared: object,  # what prepare() returned
        scale: float,
        *,
        window: int | None = None,  # sliding window W (None: full causal attention)
        softcap: float | None = None,  # attention-logit soft-cap c (None: none)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at the batch's slots, then attend each query token causally."""
