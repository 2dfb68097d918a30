"""The CUDA attention backend: Triton KV store + one paged varlen attention launch per layer.

Registered as "triton" (lazy: importing specinfer.attention does not import triton). On a CPU
machine it runs under TRITON_INTERPRET=1, which is how the tests check it against torch_ref.
Token-tree masks (AttentionMetadata.tree_mask / tree_start) go to the attention kernel as they are,
and so do a layer's sliding window and logit soft-cap (constexpr flags: a layer without them runs the
plain kernel).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from specinfer.attention.metadata import AttentionMetadata
from specinfer.kernels.triton import paged_attention, reshape_and_cache


@dataclass(frozen=True)
class TritonPrepared:
    slot_mapping: torch.Tensor  # int64[T] contiguous
    query_start_loc: torch.Tensor  # int32[S + 1] contiguous
    seq_lens: torch.Tensor  # int32[S] contiguous
    block_table: torch.Tensor  # int32[S, W], unit column stride
    max_query_len: int
    tree_mask: torch.Tensor | None = None  # int64[T] contiguous; None: no tree token
    tree_start: torch.Tensor | None = None  # int32[S] contiguous


class TritonBackend:
    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> TritonPrepared:
        """Once per forward: the metadata in the dtypes and layout the kernels' contracts name."""
        return TritonPrepared(
            slot_mapping=meta.slot_mapping.to(torch.int64).contiguous(),
            query_start_loc=meta.query_start_loc.to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            block_table=meta.block_table.to(torch.int32).contiguous(),
            max_query_len=int(meta.max_query_len),
            tree_mask=meta.tree_mask.to(torch.int64).contiguous() if meta.has_tree else None,
            tree_start=meta.tree_start.to(torch.int32).contiguous() if meta.has_tree else None,
        )

    def forward(self, q, k, v, kv_cache, prepared: TritonPrepared, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        # q [T, H, D], k/v [T, Hkv, D] (strided views allowed), kv_cache [2, NB, BS, Hkv, D] -> [T, H, D]
        # window: sliding window W (None: full causal); softcap: c in c * tanh(s / c) (None: none)
        if window is not None and (not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1):
            raise ValueError(f"triton: window must be an integer >= 1 or None (got {window!r})")
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"triton: softcap must be a finite number > 0 or None (got {softcap!r})")
        if k.dtype != kv_cache.dtype:
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        reshape_and_cache(k, v, kv_cache, prepared.slot_mapping)
        masks = dict(tree_mask=prepared.tree_mask, tree_start=prepared.tree_start,
                     window=None if window is None else int(window), softcap=None if softcap is None else float(softcap))
        if q.dtype != kv_cache.dtype:
            out = paged_attention(q.to(kv_cache.dtype), kv_cache, prepared.block_table, prepared.query_start_loc,
                                  prepared.seq_lens, prepared.max_query_len, scale, **masks)
            return out.to(q.dtype)
        return paged_attention(q, kv_cache, prepared.block_table, prepared.query_start_loc,
                               prepared.seq_lens, prepared.max_query_len, scale, **masks)
