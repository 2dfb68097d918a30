"""Mixture of experts on CUDA: every active expert's GEMM of a layer in ONE launch.

The host groups the (token, expert) pairs by expert (models/moe.py) and pads each expert's run
to a multiple of BLOCK_M rows (`align_by_expert`), so every BLOCK_M-row tile of the padded list
belongs to one expert: the kernel's program (tile, column block) reads that expert's weight tile
and the tile's rows of A gathered by index (-1: padding, skipped). Two launches make the MLP:
gate|up over the tokens' rows of x, then down over the activated rows; the host weighs each
pair and adds it into its token, in ascending expert order (a token's sum does not depend on the
batch order). Plain tl.dot tiles, no per-expert host loop; it runs under TRITON_INTERPRET=1 on
CPU, which is how the suite checks it against the torch path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr,  # A [rows_a, K]; W [E, N, K]; C [P_pad, N]
    rows_ptr,  # int64[P_pad] the row of A each padded row reads (-1: padding)
    expert_ptr,  # int64[P_pad / BLOCK_M] the expert of each tile
    N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    src = tl.load(rows_ptr + offs_m)
    valid = src >= 0
    src = tl.where(valid, src, 0)
    expert = tl.load(expert_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(a_ptr + src[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32))
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def align_by_expert(token: torch.Tensor, counts: torch.Tensor, block_m: int = BLOCK_M):
    """Pairs sorted by expert (their tokens `token` [P], `counts` [E] per expert) -> (rows
    int64[P_pad]: each padded row's token, -1 for padding; position int64[P]: each pair's padded
    row; tile_expert int64[P_pad / block_m])."""
    E = counts.shape[0]
    counts = counts.to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    expert_of_pair = torch.repeat_interleave(torch.arange(E, device=counts.device), counts)
    position = pad_start[expert_of_pair] + torch.arange(token.shape[0], device=token.device) - start[expert_of_pair]
    total = int(padded.sum())
    rows = torch.full((total,), -1, dtype=torch.int64, device=token.device)
    rows[position] = token.to(torch.int64)
    tile_expert = torch.repeat_interleave(torch.arange(E, device=counts.device), padded // block_m)
    return rows, position, tile_expert


def expert_gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, tile_expert: torch.Tensor,
                block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """C [P_pad, N] with C[r] = A[rows[r]] @ W[tile_expert[r // BLOCK_M]]^T (padding rows unwritten)."""
    assert a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[2], f"a {tuple(a.shape)} / w {tuple(w.shape)}"
    P, N, K = rows.shape[0], w.shape[1], w.shape[2]
    c = torch.zeros(P, N, dtype=a.dtype, device=a.device)
    if P == 0:
        return c
    grid = (P // BLOCK_M, triton.cdiv(N, block_n))
    _expert_gemm_kernel[grid](a, w, c, rows, tile_expert, N, K, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
                              w.stride(2), c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                              BLOCK_K=block_k)
    return c


def fused_moe(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, token: torch.Tensor,
              pair_weight: torch.Tensor, counts: torch.Tensor, act) -> torch.Tensor:
    """The routed experts' MLP of h [T, hidden] (pairs sorted by expert: their tokens, weights and
    per-expert counts) -> [T, hidden]; act is the gate activation (torch)."""
    inter = w_down.shape[2]
    rows, position, tile_expert = align_by_expert(token, counts)
    gu = expert_gemm(h, w_gate_up, rows, tile_expert)  # [P_pad, 2I]
    a = act(gu[:, :inter]) * gu[:, inter:]
    own = torch.where(rows >= 0, torch.arange(rows.shape[0], device=rows.device), -1)
    y = expert_gemm(a, w_down, own, tile_expert)  # [P_pad, hidden]
    out = torch.zeros_like(h)
    out.index_add_(0, token, y[position] * pair_weight.unsqueeze(1).to(y.dtype))
    return out
