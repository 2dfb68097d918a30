"""Paged varlen attention for one mixed batch: prefill chunks, decodes and verification runs.

Every query sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1] and a context
of seq_lens[s] tokens in the paged cache (its query sits at the END of that context); each query
token attends causally to every earlier position of its sequence. One launch covers the batch:

    grid = (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)

A program takes BLOCK_Q query tokens of one sequence and ALL query heads that share one kv head
(GQA packing: the tile's BLOCK_M = BLOCK_Q * GROUP_PAD rows are (token, head-in-group) pairs, so a
decode with 8 heads per kv head still fills a 16-row tensor-core tile and reads each K/V tile once).
It walks the context in BLOCK_N-token tiles, reading each token's physical block through the block
table (so block_size is free: any size >= 1, tokens of a tile may span blocks), and keeps an online
softmax (running max m, running sum l, fp32 accumulator). Programs past a sequence's query length
exit at once. head_dim is padded to a power of two (>= 16) with masked loads.

Token trees (HAS_TREE; specinfer.attention.metadata): a row whose tree_mask is nonzero sees key
position p (< seq_len) iff p < tree_start[seq] or bit p - tree_start[seq] of its mask is set,
wherever the row itself sits (a proposer drafting a tree depth by depth queries nodes that need
not be the context's last tokens), so a tile holding tree rows walks the whole context. Without
trees the constexpr flag compiles the plain causal kernel.

Per-layer options (specinfer.attention.backend), each behind a constexpr flag so a call without
them compiles the plain kernel: a sliding window W (HAS_WINDOW; a row at position p sees keys
p - W < j; a tree row's p is its logical position tree_start + popcount(mask) - 1, the window
bounds its prefix keys only) starts the tile's key walk at the BLOCK_N tile holding its rows'
smallest bound and masks each row below its own; a soft-cap c (HAS_SOFTCAP) maps each score s to
c * tanh(s / c) before the mask.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: the interpreter's tl.dot multiplies bf16 bit patterns as uint16 (triton
    3.x), so bf16 tiles are widened to fp32 before the dot there. Products of bf16 values are exact
    in fp32 and the sum is in fp32 either way, so the result matches the tensor-core path."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _popcount64(x):
    """Set bits of each int64 (bit 63 included), SWAR: arithmetic shifts are harmless here, every
    mask below clears the bits a sign extension fills."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return (x & 0x7F).to(tl.int32)


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), from exp(-2 |s| / cap) in (0, 1]: no overflow."""
    e = tl.exp(-2.0 * tl.abs(s) / cap)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(s < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr,  # [T, H, D]
    cache_ptr,  # [2, NB, BS, Hkv, D]
    block_table_ptr,  # int32[S, W]
    query_start_loc_ptr,  # int32[S + 1]
    seq_lens_ptr,  # int32[S]
    tree_mask_ptr,  # int64[T] (HAS_TREE only)
    tree_start_ptr,  # int32[S] (HAS_TREE only)
    scale,
    window,  # sliding window W >= 1 (HAS_WINDOW only)
    softcap,  # soft-cap c > 0 (HAS_SOFTCAP only)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    stride_bt,
    block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: numpy cannot matmul bf16, so dot in fp32 (same products)
    HAS_TREE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    qb = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + r // GROUP_PAD  # query token within the sequence
    g = r % GROUP_PAD
    row_valid = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    dmask = d < HEAD_DIM
    row_off = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & dmask[None, :], other=0.0)
    # a row's token sits at context position ctx_len - q_len + tok; padding rows see key 0 only (no NaN)
    q_pos = tl.where(row_valid, ctx_len - q_len + tok, 0)
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (qb + 1) * BLOCK_Q)  # last key this tile needs, + 1
    if HAS_TREE:
        tmask = tl.load(tree_mask_ptr + row_off, mask=row_valid, other=0).to(tl.int64)  # [BLOCK_M]
        is_tree = tmask != 0
        tstart = tl.load(tree_start_ptr + seq)
        tile_has_tree = tl.max(is_tree.to(tl.int32), 0) > 0
        kv_end = tl.where(tile_has_tree, ctx_len, kv_end)
    kv_begin = 0
    if HAS_WINDOW:
        # first key each row sees: p - W + 1 (a tree row: by its logical position, and at most its
        # root, so its in-tree keys keep the tree rule)
        lo = q_pos - window + 1
        if HAS_TREE:
            depth = _popcount64(tmask) - 1
            lo = tl.where(is_tree, tl.minimum(tstart + depth - window + 1, tstart), lo)
        lo_min = tl.min(tl.where(row_valid, lo, ctx_len), 0)
        kv_begin = (tl.maximum(lo_min, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < kv_end
        blk = tl.load(block_table_ptr + seq * stride_bt + n // block_size, mask=nmask, other=0)
        kv_off = blk.to(tl.int64) * stride_c_blk + (n % block_size) * stride_c_slot + kvh * stride_c_head
        k = tl.load(cache_ptr + kv_off[None, :] + d[:, None], mask=nmask[None, :] & dmask[:, None], other=0.0)
        if DOT_UPCAST:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = s * scale  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:
            s = _soft_cap(s, softcap)
        allowed = nmask[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_TREE:
            rel = n - tstart  # [BLOCK_N] key position relative to the tree root
            bit = (tmask[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1
            seen = (rel[None, :] < 0) | ((rel[None, :] < 64) & (bit != 0))
            allowed = tl.where(is_tree[:, None], nmask[None, :] & seen, allowed)
        if HAS_WINDOW:
            allowed = allowed & (n[None, :] >= lo[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
        if HAS_WINDOW:
            # a row may have seen no key yet (its window starts in a later tile): shift by 0
            # there, not by -inf (-inf - -inf is NaN); its running max stays -inf
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_c_kv + kv_off[:, None] + d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
        p_lo = p.to(v.dtype)  # P rounded to the cache dtype, as on tensor cores
        if DOT_UPCAST:
            pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_lo, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_WINDOW:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows may have seen no key
    out = acc / l_i[:, None]
    out_row = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + out_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dmask[None, :])


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # int32[S, W]
    query_start_loc: torch.Tensor,  # int32[S + 1]
    seq_lens: torch.Tensor,  # int32[S] context length including the query
    max_query_len: int,  # >= every query_start_loc[s+1] - query_start_loc[s]
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]; allocated contiguous when None
    tree_mask: torch.Tensor | None = None,  # int64[T] token-tree masks (0: causal token); None: no tree
    tree_start: torch.Tensor | None = None,  # int32[S] each sequence's tree root position
    window: int | None = None,  # sliding window W >= 1; None: full causal attention
    softcap: float | None = None,  # attention-logit soft-cap c > 0; None: none
) -> torch.Tensor:  # [T, H, D]
    """Causal paged attention of a mixed batch whose K/V already sit in kv_cache. With token-tree
    masks (specinfer.attention.metadata; every tree token must see key 0, i.e. tree_start > 0 or
    bit 0 set, as the contract's masks do) tree tokens see the prefix and their mask's tree slots.
    With a window W a token at position p sees keys p - W < j only (a tree token: p = tree_start +
    popcount(mask) - 1, its in-tree keys by the mask whatever W); with a soft-cap c each score s
    becomes c * tanh(s / c) before the mask and the softmax.

    Memory contract: q, kv_cache and out share one dtype (fp32, bf16 or fp16) and device; q/out
    may be strided views with unit stride along head_dim; kv_cache has unit stride along head_dim;
    block_table is int32 with unit stride along its columns; query_start_loc and seq_lens are
    contiguous int32; H is a multiple of Hkv. Any block_size >= 1 and any head_dim >= 1 work.
    """
    assert q.dim() == 3, f"q {tuple(q.shape)} must be [T, H, D]"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache {tuple(kv_cache.shape)} must be [2, NB, BS, Hkv, D]"
    T, H, D = q.shape
    _, _, block_size, Hkv, Dc = kv_cache.shape
    assert Dc == D, f"kv_cache head_dim {Dc} != q head_dim {D}"
    assert H % Hkv == 0, f"num_heads {H} is not a multiple of num_kv_heads {Hkv}"
    assert q.dtype in (torch.float32, torch.bfloat16, torch.float16), f"q dtype {q.dtype} unsupported"
    assert kv_cache.dtype == q.dtype, f"kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}"
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must have unit stride"
    assert block_size >= 1
    S = seq_lens.shape[0]
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(), "seq_lens must be contiguous int32[S]"
    assert query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous() \
        and query_start_loc.shape == (S + 1,), f"query_start_loc must be contiguous int32[{S + 1}]"
    assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == S \
        and block_table.stride(1) == 1, f"block_table must be int32[{S}, W] with unit column stride"
    assert len({t.device for t in (q, kv_cache, block_table, query_start_loc, seq_lens)}) == 1, "devices differ"
    has_tree = tree_mask is not None
    if has_tree:
        assert tree_mask.dtype == torch.int64 and tree_mask.is_contiguous() and tree_mask.shape == (T,), \
            f"tree_mask must be contiguous int64[{T}]"
        assert tree_start is not None and tree_start.dtype == torch.int32 and tree_start.is_contiguous() \
            and tree_start.shape == (S,), f"tree_start must be contiguous int32[{S}] with tree_mask"
        assert tree_mask.device == q.device and tree_start.device == q.device, "devices differ"
    assert window is None or (isinstance(window, int) and window >= 1), f"window must be an int >= 1 or None, got {window!r}"
    assert softcap is None or (math.isfinite(softcap) and softcap > 0), f"softcap must be finite and > 0, got {softcap!r}"
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must match q, unit stride on D"
    if T == 0 or S == 0:
        return out
    assert max_query_len >= 1

    group = H // Hkv
    group_pad = triton.next_power_of_2(group)
    target_m = 16 if max_query_len * group_pad <= 16 else 64  # decode/verify tiles vs prefill tiles
    block_q = max(target_m // group_pad, 1)
    block_m = block_q * group_pad
    grid = (triton.cdiv(max_query_len, block_q), S, Hkv)
    _paged_attention_kernel[grid](
        q, out, kv_cache, block_table, query_start_loc, seq_lens,
        tree_mask if has_tree else seq_lens, tree_start if has_tree else seq_lens, float(scale),
        0 if window is None else int(window), 0.0 if softcap is None else float(softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0), block_size,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=32,
        HEAD_DIM=D, HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=q.dtype == torch.bfloat16 and _interpreting(),
        HAS_TREE=has_tree, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
    )
    return out
