"""Reference paged attention in plain torch: the CPU backend and the oracle for every kernel.

Sequences with short queries (decodes and speculative verification runs) are padded into one
batched SDPA call; long queries (prefill chunks) run one SDPA call each. Both gather the
sequence's keys from the paged cache through its block table, so prefix-cache hits and
chunked prefill read exactly what earlier steps wrote.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specinfer.attention.metadata import AttentionMetadata, tree_visibility

SHORT_QUERY_MAX = 16  # query runs up to this length are batched together with padding


@dataclass
class _ShortGroup:
    token_rows: torch.Tensor | None  # int64[n] rows of the batch in the group; None: all T rows, in order
    pad_index: torch.Tensor | None  # int64[n] flat index into [G * Q] padded query slots; None: no padding
    key_slots: torch.Tensor  # int64[G, K] cache slots of each sequence's keys (padded)
    mask: torch.Tensor | None  # bool[G, 1, Q, K] True where attention is allowed; None: attend to all K
    num_seqs: int
    max_q: int


@dataclass
class _LongSeq:
    start: int
    end: int
    key_slots: torch.Tensor  # int64[L]
    mask: torch.Tensor | None  # bool[q, L] or None when the query is the whole sequence


@dataclass
class TorchRefPrepared:
    meta: AttentionMetadata
    short: list[_ShortGroup]  # short queries, grouped by context length (bounded key padding)
    long: list[_LongSeq]


def _key_slots(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.int64, device=block_table_row.device)
    return block_table_row.to(torch.int64)[pos // block_size] * block_size + pos % block_size


class TorchRefBackend:
    name = "torch_ref"

    def prepare(self, meta: AttentionMetadata) -> TorchRefPrepared:
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        bs = meta.block_size
        dev = meta.block_table.device  # the reference runs on any device: index tensors live there
        short_ids, long = [], []
        for s, L in enumerate(seq_lens):
            q_len = qsl[s + 1] - qsl[s]
            if q_len <= SHORT_QUERY_MAX:
                short_ids.append(s)
                continue
            slots = _key_slots(meta.block_table[s], L, bs)
            mask = None
            tree = meta.has_tree and bool((meta.tree_mask[qsl[s]:qsl[s + 1]] != 0).any())
            if q_len != L or tree:
                q_pos = torch.arange(L - q_len, L, device=dev).unsqueeze(1)
                mask = torch.arange(L, device=dev).unsqueeze(0) <= q_pos
                if tree:
                    mask = _with_tree(mask, meta, torch.arange(qsl[s], qsl[s + 1], device=dev),
                                      torch.full((q_len,), s, dtype=torch.int64, device=dev),
                                      torch.arange(L, device=dev))
            long.append(_LongSeq(qsl[s], qsl[s + 1], slots, mask))
        groups = [self._prepare_short(meta, ids) for ids in _length_groups(short_ids, seq_lens)]
        return TorchRefPrepared(meta, groups, long)

    @staticmethod
    def _prepare_short(meta, ids) -> _ShortGroup:
        dev = meta.block_table.device
        idx = torch.tensor(ids, dtype=torch.int64, device=dev)
        start = meta.query_start_loc.to(torch.int64)
        q_lens = (start[1:] - start[:-1])[idx]  # [G]
        lens = meta.seq_lens.to(torch.int64)[idx]  # [G]
        G, Q, K = len(ids), int(q_lens.max()), int(lens.max())
        bs = meta.block_size
        kpos = torch.arange(K, dtype=torch.int64, device=dev)  # [K]
        blocks = meta.block_table.to(torch.int64)[idx]  # [G, W]
        kblock = torch.clamp(kpos // bs, max=blocks.shape[1] - 1)
        key_slots = blocks[:, kblock] * bs + kpos % bs  # [G, K]
        qi = torch.arange(Q, dtype=torch.int64, device=dev)  # [Q]
        q_valid = qi.unsqueeze(0) < q_lens.unsqueeze(1)  # [G, Q]
        q_pos = lens.unsqueeze(1) - q_lens.unsqueeze(1) + qi.unsqueeze(0)  # [G, Q]
        mask = kpos.view(1, 1, K) <= q_pos.unsqueeze(2)  # [G, Q, K]
        if meta.has_tree:
            rows = (start[idx].unsqueeze(1) + qi.unsqueeze(0)).clamp(max=meta.num_tokens - 1)  # [G, Q]
            mask = _with_tree(mask, meta, rows, idx.unsqueeze(1).expand(G, Q), kpos)
        mask &= kpos.view(1, 1, K) < lens.view(G, 1, 1)
        mask |= (~q_valid).unsqueeze(2) & (kpos.view(1, 1, K) == 0)  # padded rows see key 0: no NaN
        token_rows = (start[idx].unsqueeze(1) + qi.unsqueeze(0))[q_valid]  # [n]
        pad_index = (torch.arange(G, device=dev).unsqueeze(1) * Q + qi.unsqueeze(0))[q_valid]  # [n]
        mask = mask.unsqueeze(1)
        if len(ids) == meta.num_seqs and ids == sorted(ids) and bool(q_valid.all()):
            # every sequence is short and has Q query tokens: the batch is already [G, Q] dense
            token_rows = pad_index = None
            if Q == 1 and bool((lens == K).all()) and not meta.has_tree:
                mask = None  # single-token queries over equal-length contexts: nothing to mask
        return _ShortGroup(token_rows, pad_index, key_slots, mask, G, Q)

    def forward(self, q, k, v, kv_cache, prepared: TorchRefPrepared, scale: float):
        T, H, D = q.shape
        Hkv = k.shape[1]
        kv_flat = kv_cache.view(2, -1, Hkv, D)
        k_flat, v_flat = kv_flat[0], kv_flat[1]
        slots = prepared.meta.slot_mapping
        k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.dtype))
        gqa = H != Hkv
        groups = prepared.short
        if len(groups) == 1 and groups[0].token_rows is None:  # dense: decodes / equal verification runs
            g = groups[0]
            return _attend(q.view(g.num_seqs, g.max_q, H, D), kv_flat, g, scale, Hkv).reshape(T, H, D)
        out = torch.empty_like(q)
        for g in groups:
            qp = q.new_zeros(g.num_seqs * g.max_q, H, D)
            qp[g.pad_index] = q[g.token_rows]
            o = _attend(qp.view(g.num_seqs, g.max_q, H, D), kv_flat, g, scale, Hkv)
            out[g.token_rows] = o.reshape(-1, H, D)[g.pad_index]
        for s in prepared.long:
            qs = q[s.start : s.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            kk = k_flat[s.key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
            vv = v_flat[s.key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            if s.mask is None:
                o = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=s.mask, scale=scale, enable_gqa=gqa)
            out[s.start : s.end] = o.squeeze(0).transpose(0, 1)
        return out


def _with_tree(causal: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor, seqs: torch.Tensor,
               kpos: torch.Tensor) -> torch.Tensor:
    """causal bool[..., K] for query tokens at batch rows `rows` [...] of sequences `seqs` [...]
    -> the same with tree tokens' rows replaced by the tree rule (see AttentionMetadata)."""
    tm = meta.tree_mask.to(torch.int64)[rows]  # [...]
    ts = meta.tree_start.to(torch.int64)[seqs]  # [...]
    vis = tree_visibility(tm, ts, kpos.expand(*rows.shape, kpos.shape[-1]))
    return torch.where((tm != 0).unsqueeze(-1), vis, causal)


def _attend(q: torch.Tensor, kv_flat: torch.Tensor, g: _ShortGroup, scale: float, Hkv: int) -> torch.Tensor:
    """q [G, Q, H, D] -> out [G, Q, H, D] over the group's gathered keys.

    GQA without enable_gqa (whose masked path is slow on CPU): the query heads sharing a KV head
    are stacked along the query axis, [G, Hkv, group * Q, D], and the mask repeats per head."""
    G, Q, H, D = q.shape
    group = H // Hkv
    kv = kv_flat[:, g.key_slots].to(q.dtype).transpose(2, 3)  # [2, G, Hkv, K, D]
    qg = q.permute(0, 2, 1, 3).reshape(G, Hkv, group * Q, D)  # head h = kv_head * group + j
    mask = g.mask
    if mask is not None and Q > 1 and group > 1:
        mask = mask.repeat(1, 1, group, 1)  # [G, 1, group * Q, K]
    o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=scale)
    return o.reshape(G, H, Q, D).transpose(1, 2)  # (a CUDA SDPA kernel may return it strided)


def _length_groups(ids: list[int], seq_lens: list[int], ratio: float = 2.0, slack: int = 64) -> list[list[int]]:
    """Split short sequences into groups of similar context length, so padding every key run to
    its group's longest stays within ratio x (plus slack) instead of the batch's longest."""
    if not ids:
        return []
    order = sorted(ids, key=lambda s: seq_lens[s])
    groups, current, floor = [], [], None
    for s in order:
        if current and seq_lens[s] > floor * ratio + slack:
            groups.append(sorted(current))
            current = []
        if not current:
            floor = seq_lens[s]
        current.append(s)
    groups.append(sorted(current))
    return groups
