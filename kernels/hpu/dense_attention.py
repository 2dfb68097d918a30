"""Static-shape dense attention for multi-token queries (prefill chunks, 1 + k verification runs).

The flat path takes one query token per row; a sequence with a multi-token query instead gets a
dense [Q, K] attention over its whole context gathered from the paged cache. To keep shapes
static, every multi-token sequence of the batch is padded to one bucket (B, Q, N): B sequences,
Q query tokens, N context blocks each (K = N * BS keys). Padded query rows and padded sequences
see key 0 only (a finite softmax, results discarded); padded block table entries read block 0.
Token trees (specinfer.attention.metadata) only change the bias: a tree row sees the keys before
its sequence's tree_start and the tree slots its mask's bits name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.attention.metadata import NO_TREE, tree_depth, tree_visibility, window_hidden


@dataclass(frozen=True)
class DenseBlockMetadata:
    block_table: torch.Tensor  # int64[B, N] padded block table rows (padding: block 0)
    attn_bias: torch.Tensor  # float32[B, 1, Q, N*BS] additive causal mask: 0 allowed, -inf not
    batch_size: int  # B
    query_len: int  # Q
    # sliding windows (applied in dense_paged_attention, same shapes for every window):
    query_pos: torch.Tensor  # int64[B, 1, Q, 1] logical position of each query row (padding: 0, so key 0 stays)
    tree_from: torch.Tensor  # int64[B, 1, Q, 1] a tree row's tree_start (in-tree keys skip the window), else NO_TREE

    def to(self, device) -> "DenseBlockMetadata":
        return DenseBlockMetadata(self.block_table.to(device), self.attn_bias.to(device), self.batch_size,
                                  self.query_len, self.query_pos.to(device), self.tree_from.to(device))


def build_dense_metadata(
    query_lens: torch.Tensor,  # int[b] query tokens of each real sequence
    seq_lens: torch.Tensor,  # int[b] context lengths including the query
    block_table: torch.Tensor,  # int[b, W]
    block_size: int,
    padded_batch: int,  # B >= b
    padded_query: int,  # Q >= max query length
    padded_blocks: int,  # N >= max blocks per sequence
    tree_mask: torch.Tensor | None = None,  # int64[b, Q'] per query row (Q' <= Q; 0: causal row); None: no tree
    tree_start: torch.Tensor | None = None,  # int[b] KV position of each sequence's tree root
) -> DenseBlockMetadata:
    b = int(seq_lens.shape[0])
    q_lens, lens = query_lens.to(torch.int64), seq_lens.to(torch.int64)
    assert padded_batch >= b and (b == 0 or padded_query >= int(q_lens.max()))
    need = int(((lens + block_size - 1) // block_size).max()) if b else 0
    assert padded_blocks >= need, f"padded_blocks {padded_blocks} < blocks of the longest sequence {need}"
    table = torch.zeros(padded_batch, padded_blocks, dtype=torch.int64)
    w = min(block_table.shape[1], padded_blocks)
    table[:b, :w] = block_table[:, :w].to(torch.int64)
    K = padded_blocks * block_size
    full_q = torch.zeros(padded_batch, dtype=torch.int64)
    full_l = torch.ones(padded_batch, dtype=torch.int64)  # padded sequences: one key, one query row
    full_q[:b], full_l[:b] = q_lens, lens
    qi = torch.arange(padded_query)
    kpos = torch.arange(K)
    q_pos = full_l.unsqueeze(1) - full_q.unsqueeze(1) + qi.unsqueeze(0)  # [B, Q] context position of each row
    q_pos = torch.where(qi.unsqueeze(0) < full_q.unsqueeze(1), q_pos, torch.zeros_like(q_pos))  # padding rows: key 0
    allowed = kpos.view(1, 1, K) <= q_pos.unsqueeze(2)  # [B, Q, K]; q_pos < seq_len, so no key past the end
    logical, tree_from = q_pos.clone(), torch.full_like(q_pos, NO_TREE)
    if tree_mask is not None and b:
        tm = torch.zeros(padded_batch, padded_query, dtype=torch.int64)
        tm[:b, : tree_mask.shape[1]] = tree_mask.to(torch.int64)
        ts = torch.zeros(padded_batch, dtype=torch.int64)
        ts[:b] = tree_start.to(torch.int64)
        tree = tree_visibility(tm, ts.unsqueeze(1).expand(padded_batch, padded_query), kpos)  # [B, Q, K]
        tree &= kpos.view(1, 1, K) < full_l.view(-1, 1, 1)
        allowed = torch.where((tm != 0).unsqueeze(2), tree, allowed)
        logical = torch.where(tm != 0, ts.unsqueeze(1) + tree_depth(tm), logical)
        tree_from = torch.where(tm != 0, ts.unsqueeze(1), tree_from)
    bias = torch.zeros(padded_batch, 1, padded_query, K).masked_fill_(~allowed.unsqueeze(1), float("-inf"))
    return DenseBlockMetadata(table, bias, padded_batch, padded_query, logical.view(padded_batch, 1, padded_query, 1),
                              tree_from.view(padded_batch, 1, padded_query, 1))


def dense_paged_attention(
    query: torch.Tensor,  # [B, Q, H, D] padded query rows
    kv_cache: torch.Tensor,  # [2, num_blocks, BS, Hkv, D]
    meta: DenseBlockMetadata,
    scale: float,
    window: int | None = None,  # sliding window (attention/backend.py's rule)
    softcap: float | None = None,  # attention-logit soft-cap
) -> torch.Tensor:  # [B, Q, H, D]
    B, Q, H, D = query.shape
    _, _, BS, Hkv, _ = kv_cache.shape
    assert (B, Q) == (meta.batch_size, meta.query_len), f"query {(B, Q)} != bucket {(meta.batch_size, meta.query_len)}"
    G = H // Hkv
    N = meta.block_table.shape[1]
    f32 = torch.float32
    kv = kv_cache[:, meta.block_table.reshape(-1)].to(f32).view(2, B, N * BS, Hkv, D)  # gather the contexts
    k = kv[0].permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, K, D]
    v = kv[1].permute(0, 2, 1, 3).unsqueeze(2)
    q = query.to(f32).view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Q, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, G, Q, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    bias = meta.attn_bias  # [B, 1, Q, K]
    if window is not None:  # elementwise on the device: the same graph shape for every window
        kpos = torch.arange(bias.shape[-1], device=bias.device)
        hidden = window_hidden(meta.query_pos, meta.tree_from, kpos, window)
        bias = bias.masked_fill(hidden, float("-inf"))
    scores = scores + bias.unsqueeze(1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hkv, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Q, H, D).to(query.dtype)
