"""The attention-backend protocol. A backend stores new K/V into the paged cache and attends."""
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
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at the batch's slots, then attend each query token causally."""
