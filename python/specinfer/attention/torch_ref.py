"""Reference paged attention in plain torch: the CPU backend and the oracle for every kernel.

Sequences with short queries (decodes and speculative verification runs) are padded into one
batched SDPA call; long queries (prefill chunks) run one SDPA call each. Both gather the
sequence's keys from the paged cache through its block table, so prefix-cache hits and
chunked prefill read exactly what earlier steps wrote.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specinfer.attention.metadata import NO_TREE, AttentionMetadata, tree_depth, tree_visibility, window_hidden

SHORT_QUERY_MAX = 16  # query runs up to this length are batched together with padding


@dataclass
class _ShortGroup:
    token_rows: torch.Tensor | None  # int64[n] rows of the batch in the group; None: all T rows, in order
    pad_index: torch.Tensor | None  # int64[n] flat index into [G * Q] padded query slots; None: no padding
    key_slots: torch.Tensor  # int64[G, K] cache slots of each sequence's keys (padded)
    mask: torch.Tensor | None  # bool[G, 1, Q, K] True where attention is allowed; None: attend to all K
    num_seqs: int
    max_q: int
    q_pos: torch.Tensor  # int64[G, Q] each query's (logical) position, for sliding windows
    tree_from: torch.Tensor  # int64[G, Q] tree tokens: their tree_start (in-tree keys skip the window); else a huge value
    windowed: dict = field(default_factory=dict)  # window -> bool[G, 1, Q, K], built on first use


@dataclass
class _LongSeq:
    start: int
    end: int
    key_slots: torch.Tensor  # int64[L]
    mask: torch.Tensor | None  # bool[q, L] or None when the query is the whole sequence
    q_pos: torch.Tensor  # int64[q] each query's (logical) position
    tree_from: torch.Tensor  # int64[q] as in _ShortGroup
    windowed: dict = field(default_factory=dict)  # window -> bool[q, L]


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
            rows = torch.arange(qsl[s], qsl[s + 1], device=dev)
            logical, tree_from = _query_positions(meta, rows, torch.full((q_len,), s, dtype=torch.int64, device=dev),
                                                torch.arange(L - q_len, L, device=dev))
            tree = meta.has_tree and bool((meta.tree_mask[qsl[s]:qsl[s + 1]] != 0).any())
            if q_len != L or tree:
                q_pos = torch.arange(L - q_len, L, device=dev).unsqueeze(1)
                mask = torch.arange(L, device=dev).unsqueeze(0) <= q_pos
                if tree:
                    mask = _with_tree(mask, meta, torch.arange(qsl[s], qsl[s + 1], device=dev),
                                      torch.full((q_len,), s, dtype=torch.int64, device=dev),
                                      torch.arange(L, device=dev))
            long.append(_LongSeq(qsl[s], qsl[s + 1], slots, mask, logical, tree_from))
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
        rows = (start[idx].unsqueeze(1) + qi.unsqueeze(0)).clamp(max=meta.num_tokens - 1)  # [G, Q]
        logical, tree_from = _query_positions(meta, rows, idx.unsqueeze(1).expand(G, Q), q_pos)
        logical = torch.where(q_valid, logical, 0)  # padded rows keep key 0 inside any window
        if meta.has_tree:
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
        return _ShortGroup(token_rows, pad_index, key_slots, mask, G, Q, logical, tree_from)

    def forward(self, q, k, v, kv_cache, prepared: TorchRefPrepared, scale: float, *,
                window: int | None = None, softcap: float | None = None):
        T, H, D = q.shape
        Hkv = k.shape[1]
        kv_flat = kv_cache.view(2, -1, Hkv, D)
        k_flat, v_flat = kv_flat[0], kv_flat[1]
        slots = prepared.meta.slot_mapping
        k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.dtype))
        groups = prepared.short
        if len(groups) == 1 and groups[0].token_rows is None:  # dense: decodes / equal verification runs
            g = groups[0]
            return _attend(q.view(g.num_seqs, g.max_q, H, D), kv_flat, g, scale, Hkv, window, softcap).reshape(T, H, D)
        out = torch.empty_like(q)
        for g in groups:
            qp = q.new_zeros(g.num_seqs * g.max_q, H, D)
            qp[g.pad_index] = q[g.token_rows]
            o = _attend(qp.view(g.num_seqs, g.max_q, H, D), kv_flat, g, scale, Hkv, window, softcap)
            out[g.token_rows] = o.reshape(-1, H, D)[g.pad_index]
        for s in prepared.long:
            qs = q[s.start : s.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            kk = k_flat[s.key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
            vv = v_flat[s.key_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            mask = s.mask
            if window is not None:
                mask = _long_window_mask(s, window)
            out[s.start : s.end] = _sdpa(qs, kk, vv, mask, scale, softcap).squeeze(0).transpose(0, 1)
        return out


def _query_positions(meta: AttentionMetadata, rows: torch.Tensor, seqs: torch.Tensor, kv_pos: torch.Tensor):
    """(logical position int64[...], tree_from int64[...]) of the query tokens at batch `rows` of
    sequences `seqs` whose KV positions are kv_pos: a tree token's logical position is its
    root's plus its depth (popcount of its mask - 1), and its in-tree keys (>= tree_from) are
    exempt from the window; other tokens: their KV position, and no exemption."""
    never = torch.full_like(kv_pos, NO_TREE)
    if not meta.has_tree:
        return kv_pos, never
    tm = meta.tree_mask.to(torch.int64)[rows]
    ts = meta.tree_start.to(torch.int64)[seqs]
    tree = tm != 0
    return torch.where(tree, ts + tree_depth(tm), kv_pos), torch.where(tree, ts, never)


def _window_rule(q_pos: torch.Tensor, tree_from: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """bool[..., K]: key positions kpos [K] inside the window of queries at q_pos [...]."""
    kp = kpos.view(*([1] * q_pos.dim()), -1)
    return ~window_hidden(q_pos.unsqueeze(-1), tree_from.unsqueeze(-1), kp, window)


def _long_window_mask(s: _LongSeq, window: int) -> torch.Tensor:
    if window not in s.windowed:
        L = s.key_slots.shape[0]
        kpos = torch.arange(L, device=s.key_slots.device)
        base = s.mask if s.mask is not None else kpos.unsqueeze(0) <= s.q_pos.unsqueeze(1)
        s.windowed[window] = base & _window_rule(s.q_pos, s.tree_from, kpos, window)
    return s.windowed[window]


def _short_window_mask(g: _ShortGroup, window: int) -> torch.Tensor:
    if window not in g.windowed:
        K = g.key_slots.shape[1]
        kpos = torch.arange(K, device=g.key_slots.device)
        rule = _window_rule(g.q_pos, g.tree_from, kpos, window).unsqueeze(1)  # [G, 1, Q, K]
        g.windowed[window] = rule if g.mask is None else g.mask & rule
    return g.windowed[window]


def _sdpa(q, k, v, mask, scale: float, softcap: float | None, *, is_causal_when_none: bool = True):
    """SDPA over q [B, H, Q, D], k/v [B, Hkv, K, D] with GQA; mask bool[.., Q, K] or None (causal
    when is_causal_when_none). With a soft-cap: explicit scores, c * tanh(s / c), float32 softmax."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal_when_none, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal_when_none:
        Q, K = scores.shape[-2:]
        mask = torch.ones(Q, K, dtype=torch.bool, device=q.device).tril(K - Q)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _with_tree(causal: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor, seqs: torch.Tensor,
               kpos: torch.Tensor) -> torch.Tensor:
    """causal bool[..., K] for query tokens at batch rows `rows` [...] of sequences `seqs` [...]
    -> the same with tree tokens' rows replaced by the tree rule (see AttentionMetadata)."""
    tm = meta.tree_mask.to(torch.int64)[rows]  # [...]
    ts = meta.tree_start.to(torch.int64)[seqs]  # [...]
    vis = tree_visibility(tm, ts, kpos.expand(*rows.shape, kpos.shape[-1]))
    return torch.where((tm != 0).unsqueeze(-1), vis, causal)


def _attend(q: torch.Tensor, kv_flat: torch.Tensor, g: _ShortGroup, scale: float, Hkv: int,
            window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [G, Q, H, D] -> out [G, Q, H, D] over the group's gathered keys.

    GQA without enable_gqa (whose masked path is slow on CPU): the query heads sharing a KV head
    are stacked along the query axis, [G, Hkv, group * Q, D], and the mask repeats per head."""
    G, Q, H, D = q.shape
    group = H // Hkv
    kv = kv_flat[:, g.key_slots].to(q.dtype).transpose(2, 3)  # [2, G, Hkv, K, D]
    qg = q.permute(0, 2, 1, 3).reshape(G, Hkv, group * Q, D)  # head h = kv_head * group + j
    mask = g.mask if window is None else _short_window_mask(g, window)
    if mask is not None and Q > 1 and group > 1:
        mask = mask.repeat(1, 1, group, 1)  # [G, 1, group * Q, K]
    o = _sdpa(qg, kv[0], kv[1], mask, scale, softcap, is_causal_when_none=False)
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
