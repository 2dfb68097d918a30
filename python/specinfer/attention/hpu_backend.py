"""The Gaudi attention backend: flat block-list attention for single-token queries, and for
multi-token queries either a bucketed dense path or the flat path again. Plain torch, so it also
runs (and is tested) on CPU.

Registered as "hpu_flat". Every shape the attention sees is padded to a bucket of its
BucketPlanner. Two layouts for multi-token queries (prefill chunks, mqa verification runs):

- "dense": padded to (batch, query length, blocks per sequence); decodes (and batch-expanded
  verification tokens) go to the flat path padded to (batch, total blocks). A forward's shape is
  then (tokens, flat bucket or none, dense bucket or none): a large product to warm up.
- "flat" (the default of the HPU platforms): every query token is a single-token row of the flat
  path (seq_len = its position + 1, its sequence's block-table row), as the batch_expansion scorer
  does for verification. A forward's shape is (tokens, total blocks): |tokens| x |blocks| graphs,
  which a warm-up can cover completely. The price: a prefill chunk of q tokens lists its context
  blocks q times (cheap for short chunks and verification runs, costly for long prefills).

Token trees (AttentionMetadata.tree_mask / tree_start) enter both paths as part of their masks
(the flat path's block_bias, the dense path's attn_bias): no shape changes, so no new buckets.

The token count T itself and the KV store's shape come from the model's input, which the packer
pads to the platform's token buckets (the backend does not change T; padded rows have no
sequence and get zeros).
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


MULTI_TOKEN_PATHS = ("dense", "flat")


class HpuFlatBackend:
    name = "hpu_flat"

    def __init__(self, planner: BucketPlanner | None = None, multi_token_path: str = "dense"):
        if multi_token_path not in MULTI_TOKEN_PATHS:
            raise ValueError(f"multi_token_path={multi_token_path!r}; use one of {MULTI_TOKEN_PATHS}")
        self.planner = planner if planner is not None else BucketPlanner()
        self.multi_token_path = multi_token_path

    def prepare(self, meta: AttentionMetadata) -> HpuPrepared:
        T, bs = meta.num_tokens, meta.block_size
        device = meta.slot_mapping.device  # metadata is built on the host, then moved once per forward
        qsl = meta.query_start_loc.to(torch.int64).cpu()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = meta.seq_lens.to(torch.int64).cpu()
        table = meta.block_table.cpu()
        tree = None  # (tree_mask int64[T], tree_start int64[S]) on the host
        if meta.has_tree:
            tree = (meta.tree_mask.to(torch.int64).cpu(), meta.tree_start.to(torch.int64).cpu())
        if self.multi_token_path == "flat":
            return HpuPrepared(meta.slot_mapping.to(torch.int64), T,
                               self._all_flat(T, bs, qsl, q_lens, seq_lens, table, device, tree), None)
        dec = torch.nonzero(q_lens == 1).flatten()
        multi = torch.nonzero(q_lens > 1).flatten()
        decode = None
        if len(dec):
            B = self.planner.pad(len(dec), "batch")
            total_blocks = int(((seq_lens[dec] + bs - 1) // bs).sum())
            tm, ts = (tree[0][qsl[dec]], tree[1][dec]) if tree else (None, None)
            flat = build_flat_metadata(seq_lens[dec], table[dec], bs, B, self.planner.pad(total_blocks, "blocks"),
                                       tm, ts)
            gather, scatter = torch.zeros(B, dtype=torch.int64), torch.full((B,), T, dtype=torch.int64)
            gather[: len(dec)] = scatter[: len(dec)] = qsl[dec]
            decode = (flat.to(device), _Rows(gather.to(device), scatter.to(device)))
        dense = None
        if len(multi):
            B = self.planner.pad(len(multi), "batch")
            Q = self.planner.pad(int(q_lens[multi].max()), "query")
            N = self.planner.pad(int(((seq_lens[multi] + bs - 1) // bs).max()), "context_blocks")
            qi = torch.arange(Q)
            valid = torch.zeros(B, Q, dtype=torch.bool)
            valid[: len(multi)] = qi.unsqueeze(0) < q_lens[multi].unsqueeze(1)
            rows = torch.zeros(B, Q, dtype=torch.int64)
            rows[: len(multi)] = qsl[multi].unsqueeze(1) + qi.unsqueeze(0)
            tm = ts = None
            if tree:
                real = valid[: len(multi)]
                tm = torch.where(real, tree[0][rows[: len(multi)].clamp(max=T - 1)], 0)  # [b, Q]
                ts = tree[1][multi]
            dm = build_dense_metadata(q_lens[multi], seq_lens[multi], table[multi], bs, B, Q, N, tm, ts)
            gather = torch.where(valid, rows, torch.zeros_like(rows)).flatten()
            scatter = torch.where(valid, rows, torch.full_like(rows, T)).flatten()
            dense = (dm.to(device), _Rows(gather.to(device), scatter.to(device)))
        return HpuPrepared(meta.slot_mapping.to(torch.int64), T, decode, dense)

    def _all_flat(self, T, bs, qsl, q_lens, seq_lens, table, device, tree=None):
        """Every query token as a single-token row of the flat path, padded to (tokens, blocks).
        A tree token's row keeps its sequence's tree_start and its own mask."""
        n = int(qsl[-1])  # real tokens; rows n..T-1 are the packer's padding (no sequence)
        if n == 0:
            return None
        seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [n]
        lens = seq_lens[seq_of] - q_lens[seq_of] + (torch.arange(n) - qsl[seq_of]) + 1  # [n] causal context
        if tree:  # a tree token's query need not sit at the context's end: its mask bounds it, not lens
            lens = torch.where(tree[0][:n] != 0, seq_lens[seq_of], lens)
        B = self.planner.pad(max(T, n), "tokens")
        total_blocks = int(((lens + bs - 1) // bs).sum())
        tm, ts = (tree[0][:n], tree[1][seq_of]) if tree else (None, None)
        flat = build_flat_metadata(lens, table[seq_of], bs, B, self.planner.pad(total_blocks, "blocks"), tm, ts)
        gather, scatter = torch.zeros(B, dtype=torch.int64), torch.full((B,), T, dtype=torch.int64)
        gather[:n] = scatter[:n] = torch.arange(n)
        return flat.to(device), _Rows(gather.to(device), scatter.to(device))

    # ------------------------------------------------------------------ static shapes
    @staticmethod
    def signature(prepared: HpuPrepared) -> tuple:
        """The shapes a compiled graph of this forward depends on."""
        sig = [prepared.num_tokens]
        if prepared.decode is not None:
            flat = prepared.decode[0]
            sig.append(("flat", flat.batch_size, int(flat.block_list.shape[0])))
        if prepared.multi is not None:
            dm = prepared.multi[0]
            sig.append(("dense", dm.batch_size, dm.query_len, int(dm.block_table.shape[1])))
        return tuple(sig)

    def shape_plan(self) -> list[tuple]:
        """Every (tokens, flat shape | None, dense shape | None) a forward can take: the warm-up plan."""
        planner, c = self.planner, self.planner.config
        if self.multi_token_path == "flat":
            plan = []
            for t in c.token_buckets:
                most = t * c.context_block_buckets[-1]  # every row at the longest context
                reach = next((nb for nb in c.block_buckets if nb >= most), c.block_buckets[-1])
                plan += [(t, (t, nb), None) for nb in c.block_buckets if nb <= reach]
            return plan
        flats = [None] + planner.decode_shapes()
        denses = [None] + planner.multi_token_shapes()
        return [(t, f, d) for t in c.token_buckets for f in flats for d in denses if f or d]

    def dummy_prepared(self, num_tokens: int, flat_shape, dense_shape, null_slots: torch.Tensor,
                       block_size: int, device) -> HpuPrepared:
        """All-padding metadata of one planned shape (warm-up): no real row, every K/V write into
        null_slots (int64[num_tokens], the null block's slots), every read of block 0 discarded."""
        empty_lens, empty_table = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64)
        decode = dense = None
        if flat_shape is not None:
            B, NB = flat_shape
            flat = build_flat_metadata(empty_lens, empty_table, block_size, B, NB)
            rows = _Rows(torch.zeros(B, dtype=torch.int64), torch.full((B,), num_tokens, dtype=torch.int64))
            decode = (flat.to(device), _Rows(rows.gather.to(device), rows.scatter.to(device)))
        if dense_shape is not None:
            B, Q, N = dense_shape
            dm = build_dense_metadata(empty_lens, empty_lens, empty_table, block_size, B, Q, N)
            P = B * Q
            rows = _Rows(torch.zeros(P, dtype=torch.int64), torch.full((P,), num_tokens, dtype=torch.int64))
            dense = (dm.to(device), _Rows(rows.gather.to(device), rows.scatter.to(device)))
        return HpuPrepared(null_slots.to(device), num_tokens, decode, dense)

    def forward(self, q, k, v, kv_cache, prepared: HpuPrepared, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
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
            o = flat_paged_attention(q.index_select(0, rows.gather), kv_cache, flat, scale, window, softcap)  # [B, H, D]
            out.index_copy_(0, rows.scatter, o)
        if prepared.multi is not None:
            dm, rows = prepared.multi
            qp = q.index_select(0, rows.gather).view(dm.batch_size, dm.query_len, H, D)
            o = dense_paged_attention(qp, kv_cache, dm, scale, window, softcap)  # [B, Q, H, D]
            out.index_copy_(0, rows.scatter, o.reshape(-1, H, D))
        return out[:T]
