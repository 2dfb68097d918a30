"""KV store: write each token's k/v row into the paged cache at its slot.

One program per (token, kv head) copies a head_dim row of k and of v. A negative slot means
"padding token, store nothing" (the convention padded CUDA-graph batches use).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D] (any token/head stride, unit stride along D)
    cache_ptr,  # [2, NB, BS, Hkv, D]
    slot_ptr,  # int64[T]
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    block_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, HEAD_DIM_PAD)
        dmask = d < HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
        dst = cache_ptr + blk * stride_c_blk + off * stride_c_slot + h * stride_c_head + d
        tl.store(dst, k, mask=dmask)
        tl.store(dst + stride_c_kv, v, mask=dmask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64[T]; slot = block_id * block_size + offset; < 0: skip
) -> None:
    """Store k/v rows at slot_mapping into kv_cache, in place.

    Memory contract: k, v and kv_cache share one dtype and device; k/v may be strided views but
    need unit stride along head_dim; kv_cache needs unit stride along head_dim; slot_mapping is
    int64 and contiguous. Slots must lie in [0, num_blocks * block_size) or be negative.
    """
    assert k.dim() == 3 and v.shape == k.shape, f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D]"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"kv_cache {tuple(kv_cache.shape)} must be [2, NB, BS, Hkv, D]"
    T, Hkv, D = k.shape
    assert tuple(kv_cache.shape[3:]) == (Hkv, D), f"kv_cache heads/dim {tuple(kv_cache.shape[3:])} != k's {(Hkv, D)}"
    assert k.dtype == v.dtype == kv_cache.dtype, f"dtypes differ: k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}"
    assert k.device == v.device == kv_cache.device == slot_mapping.device, "tensors on different devices"
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must have unit stride"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (T,) and slot_mapping.is_contiguous(), \
        f"slot_mapping must be contiguous int64[{T}], got {slot_mapping.dtype}{tuple(slot_mapping.shape)}"
    if T == 0:
        return
    _reshape_and_cache_kernel[(T, Hkv)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_cache.shape[2],
        HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D),
    )
