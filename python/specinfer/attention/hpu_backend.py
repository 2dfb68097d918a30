"""The Gaudi attention backend: flat block-list attention for single-token queries, a bucketed
dense path for multi-token queries. Plain torch, so it also runs (and is tested) on CPU.

Registered as "hpu_flat". Every shape the attention sees is padded to a bucket of its
BucketPlanner: decodes (and batch-expanded verification tokens) to (batch, total blocks), and
multi-token queries (prefill chunks, mqa verification runs) to (batch, query length, blocks per
sequence). The token count T itself and the KV store's shape come from the model's input, which
the packer pads to the platform's buckets (the backend does not change T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.attention.metadata import AttentionMetadata
from specinfer.kernels.hpu import (BucketPlanner, DenseBlockMetadata, FlatBlockMetadata, build_dense_metadata,
                                   build_flat_metadata, dense_paged_attention, flat_paged_attention)


@dataclass(frozen=True)
class _Rows:
    gather: torch.Tensor  # int64[P] batch token row feeding each padded query row (padding: row 0)
    scatter: torch.Tensor  # int64[P] batch token row each padded output row goes to (padding: T, discarded)


@dataclass(frozen=True)
class HpuPrepared:
    slot_mapping: torch.Tensor  # int64[T]
    num_tokens: int  # T
    decode: tuple[FlatBlockMetadata, _Rows] | None  # single-token queries
    multi: tuple[DenseBlockMetadata, _Rows] | None  # multi-token queries


class HpuFlatBackend:
    name = "hpu_flat"

    def __init__(self, planner: BucketPlanner | None = None):
        self.planner = planner if planner is not None else BucketPlanner()

    def prepare(self, meta: AttentionMetadata) -> HpuPrepared:
        T, bs = meta.num_tokens, meta.block_size
        device = meta.slot_mapping.device  # metadata is built on the host, then moved once per forward
        qsl = meta.query_start_loc.to(torch.int64).cpu()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = meta.seq_lens.to(torch.int64).cpu()
        table = meta.block_table.cpu()
        dec = torch.nonzero(q_lens == 1).flatten()
        multi = torch.nonzero(q_lens > 1).flatten()
        decode = None
        if len(dec):
            B = self.planner.pad(len(dec), "batch")
            total_blocks = int(((seq_lens[dec] + bs - 1) // bs).sum())
            flat = build_flat_metadata(seq_lens[dec], table[dec], bs, B, self.planner.pad(total_blocks, "blocks"))
            gather, scatter = torch.zeros(B, dtype=torch.int64), torch.full((B,), T, dtype=torch.int64)
            gather[: len(dec)] = scatter[: len(dec)] = qsl[dec]
            decode = (flat.to(device), _Rows(gather.to(device), scatter.to(device)))
        dense = None
        if len(multi):
            B = self.planner.pad(len(multi), "batch")
            Q = self.planner.pad(int(q_lens[multi].max()), "query")
            N = self.planner.pad(int(((seq_lens[multi] + bs - 1) // bs).max()), "context_blocks")
            dm = build_dense_metadata(q_lens[multi], seq_lens[multi], table[multi], bs, B, Q, N)
            qi = torch.arange(Q)
            valid = torch.zeros(B, Q, dtype=torch.bool)
            valid[: len(multi)] = qi.unsqueeze(0) < q_lens[multi].unsqueeze(1)
            rows = torch.zeros(B, Q, dtype=torch.int64)
            rows[: len(multi)] = qsl[multi].unsqueeze(1) + qi.unsqueeze(0)
            gather = torch.where(valid, rows, torch.zeros_like(rows)).flatten()
            scatter = torch.where(valid, rows, torch.full_like(rows, T)).flatten()
            dense = (dm.to(device), _Rows(gather.to(device), scatter.to(device)))
        return HpuPrepared(meta.slot_mapping.to(torch.int64), T, decode, dense)

    def forward(self, q, k, v, kv_cache, prepared: HpuPrepared, scale: float) -> torch.Tensor:
        # q [T, H, D], k/v [T, Hkv, D] (strided views allowed), kv_cache [2, NB, BS, Hkv, D] -> [T, H, D]
        T, H, D = q.shape
        Hkv = k.shape[1]
        assert kv_cache.is_contiguous(), "kv_cache must be contiguous (flat slot view)"
        kv_flat = kv_cache.view(2, -1, Hkv, D)
        kv_flat[0].index_copy_(0, prepared.slot_mapping, k.to(kv_cache.dtype))
        kv_flat[1].index_copy_(0, prepared.slot_mapping, v.to(kv_cache.dtype))
        out = q.new_zeros(T + 1, H, D)  # row T collects padding rows
        if prepared.decode is not None:
            flat, rows = prepared.decode
            o = flat_paged_attention(q.index_select(0, rows.gather), kv_cache, flat, scale)  # [B, H, D]
            out.index_copy_(0, rows.scatter, o)
        if prepared.multi is not None:
            dm, rows = prepared.multi
            qp = q.index_select(0, rows.gather).view(dm.batch_size, dm.query_len, H, D)
            o = dense_paged_attention(qp, kv_cache, dm, scale)  # [B, Q, H, D]
            out.index_copy_(0, rows.scatter, o.reshape(-1, H, D))
        return out[:T]
