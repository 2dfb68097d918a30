"""Block-list ("flat") paged attention for single-token queries, the Gaudi decode path.

The design follows vllm-hpu-extension's flat_pa: instead of a [batch, max_blocks] block table
(ragged, padded per sequence), the batch's blocks are flattened into ONE list:

    block_list    int64[NB]      physical block id of every block of every sequence
    block_groups  int64[NB]      which sequence (batch row) each block belongs to; padding -> B
    block_mapping float[NB, B]   one-hot of block_groups (all-zero rows for padding blocks)
    block_bias    float[NB, BS]  0 where the slot holds a context token, -inf past the sequence end

Attention is computed per block — the query is broadcast to its blocks with a matmul
(block_mapping @ q), scores against that block's keys, a local softmax numerator and P @ V —
and then combined per sequence: each block's scores are shifted by its sequence's max (one
scatter-amax over block_groups), and numerators and sums are added per sequence with
block_mapping^T @ (...). Shapes depend only on (B, NB), both padded to buckets, so one compiled
graph serves every batch of the bucket; all arithmetic is plain torch (matmuls, index_select,
one scatter_reduce) and runs on CPU too.

Batch-expanded verification (the `batch_expansion` scorer) is also just this: each of a request's
1 + k tokens is a single-token query with its own sequence length over the same block table row.
Token trees too: a tree row's block_bias also masks the tree slots its tree_mask does not name
(specinfer.attention.metadata); a block may then be fully masked (its max is -inf, its terms 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.attention.metadata import NO_TREE, tree_depth, tree_visibility, window_hidden


@dataclass(frozen=True)
class FlatBlockMetadata:
    block_list: torch.Tensor  # int64[NB] physical block ids (padding: block 0, harmless to read)
    block_groups: torch.Tensor  # int64[NB] batch row of each block; padding blocks -> B (a discard row)
    block_mapping: torch.Tensor  # float32[NB, B] one-hot of block_groups
    block_bias: torch.Tensor  # float32[NB, BS] additive mask: 0 valid, -inf past the sequence end
    batch_size: int  # B, the padded batch
    # sliding windows (applied in flat_paged_attention, same shapes for every window):
    query_pos: torch.Tensor  # int64[NB, 1] logical position of the query each block serves (padding: 0)
    tree_from: torch.Tensor  # int64[NB, 1] its tree_start if a tree row (in-tree keys skip the window), else NO_TREE
    key_pos: torch.Tensor  # int64[NB, BS] position of each slot

    def to(self, device) -> "FlatBlockMetadata":
        return FlatBlockMetadata(self.block_list.to(device), self.block_groups.to(device),
                                 self.block_mapping.to(device), self.block_bias.to(device), self.batch_size,
                                 self.query_pos.to(device), self.tree_from.to(device), self.key_pos.to(device))


def build_flat_metadata(
    seq_lens: torch.Tensor,  # int[b] context lengths of the real sequences (each >= 1)
    block_table: torch.Tensor,  # int[b, W] their block table rows
    block_size: int,
    padded_batch: int,  # B >= b
    padded_blocks: int,  # NB >= total blocks of the batch
    tree_mask: torch.Tensor | None = None,  # int64[b] per row (0: causal row); None: no tree row
    tree_start: torch.Tensor | None = None,  # int[b] KV position of each row's tree root
) -> FlatBlockMetadata:
    b = int(seq_lens.shape[0])
    assert padded_batch >= b, f"padded_batch {padded_batch} < batch {b}"
    seq_lens = seq_lens.to(torch.int64)
    W = block_table.shape[1]
    num_blocks = (seq_lens + block_size - 1) // block_size  # [b]
    assert bool((num_blocks <= W).all()), "a sequence needs more blocks than its block table row holds"
    used = torch.arange(W).unsqueeze(0) < num_blocks.unsqueeze(1)  # [b, W]
    n = int(used.sum())
    assert padded_blocks >= n, f"padded_blocks {padded_blocks} < blocks of the batch {n}"
    block_list = torch.zeros(padded_blocks, dtype=torch.int64)
    block_list[:n] = block_table.to(torch.int64)[used]
    block_groups = torch.full((padded_blocks,), padded_batch, dtype=torch.int64)
    block_groups[:n] = torch.arange(b).unsqueeze(1).expand(b, W)[used]
    first_pos = (torch.arange(W) * block_size).unsqueeze(0).expand(b, W)[used]  # [n]
    pos = first_pos.unsqueeze(1) + torch.arange(block_size).unsqueeze(0)  # [n, BS]
    block_bias = torch.zeros(padded_blocks, block_size)
    hidden = pos >= seq_lens[block_groups[:n]].unsqueeze(1)  # [n, BS]
    query_pos = torch.zeros(padded_blocks, 1, dtype=torch.int64)
    tree_from = torch.full((padded_blocks, 1), NO_TREE, dtype=torch.int64)
    key_pos = torch.zeros(padded_blocks, block_size, dtype=torch.int64)
    key_pos[:n] = pos
    query_pos[:n, 0] = seq_lens[block_groups[:n]] - 1
    if tree_mask is not None:
        tm = tree_mask.to(torch.int64)[block_groups[:n]]  # [n]
        ts = tree_start.to(torch.int64)[block_groups[:n]]
        hidden |= (tm != 0).unsqueeze(1) & ~tree_visibility(tm, ts, pos)
        query_pos[:n, 0] = torch.where(tm != 0, ts + tree_depth(tm), query_pos[:n, 0])
        tree_from[:n, 0] = torch.where(tm != 0, ts, tree_from[:n, 0])
    block_bias[:n].masked_fill_(hidden, float("-inf"))
    block_mapping = torch.zeros(padded_blocks, padded_batch + 1)
    block_mapping[torch.arange(padded_blocks), block_groups] = 1.0
    return FlatBlockMetadata(block_list, block_groups, block_mapping[:, :padded_batch].contiguous(),
                             block_bias, padded_batch, query_pos, tree_from, key_pos)


def flat_paged_attention(
    query: torch.Tensor,  # [B, H, D] one query token per (padded) batch row
    kv_cache: torch.Tensor,  # [2, num_blocks, BS, Hkv, D]
    meta: FlatBlockMetadata,
    scale: float,
    window: int | None = None,  # sliding window (attention/backend.py's rule)
    softcap: float | None = None,  # attention-logit soft-cap
) -> torch.Tensor:  # [B, H, D]; padding rows hold zeros
    B, H, D = query.shape
    _, _, BS, Hkv, _ = kv_cache.shape
    assert B == meta.batch_size, f"query batch {B} != metadata batch {meta.batch_size}"
    assert H % Hkv == 0, f"num_heads {H} is not a multiple of num_kv_heads {Hkv}"
    G = H // Hkv
    NB = meta.block_list.shape[0]
    f32 = torch.float32
    mapping = meta.block_mapping
    # batch -> block: every block gets its sequence's query (zeros for padding blocks)
    q_blocks = (mapping @ query.reshape(B, H * D).to(f32)).view(NB, Hkv, G, D)
    keys = kv_cache[0].index_select(0, meta.block_list).to(f32)  # [NB, BS, Hkv, D]
    values = kv_cache[1].index_select(0, meta.block_list).to(f32)
    scores = torch.matmul(q_blocks, keys.permute(0, 2, 3, 1)) * scale  # [NB, Hkv, G, BS]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    bias = meta.block_bias
    if window is not None:  # elementwise on the device: the same graph shape for every window
        bias = bias.masked_fill(window_hidden(meta.query_pos, meta.tree_from, meta.key_pos, window), float("-inf"))
    scores = scores + bias.view(NB, 1, 1, BS)
    block_max = scores.amax(-1)  # [NB, Hkv, G]; -inf only for a block a tree row sees none of
    seq_max = torch.full((B + 1, Hkv, G), float("-inf"), dtype=f32, device=query.device)
    seq_max = seq_max.scatter_reduce(0, meta.block_groups.view(NB, 1, 1).expand(NB, Hkv, G), block_max, "amax")
    p = torch.exp(scores - seq_max.index_select(0, meta.block_groups).unsqueeze(-1))  # [NB, Hkv, G, BS]
    block_sums = p.sum(-1)  # [NB, Hkv, G]
    block_out = torch.matmul(p, values.permute(0, 2, 1, 3))  # [NB, Hkv, G, D]
    # block -> batch: add every block's numerator and denominator into its sequence
    out = mapping.t() @ block_out.reshape(NB, H * D)  # [B, H*D]
    sums = mapping.t() @ block_sums.reshape(NB, H)  # [B, H]
    out = out.view(B, H, D) / sums.clamp_min(torch.finfo(f32).tiny).unsqueeze(-1)
    return out.to(query.dtype)
