"""Dense linear layers at few activation rows on CPU: the Rust kernel (`specinfer._core.dense_linear`,
rust/kernels/src/few_rows_linear.rs) for bf16 and f32 weights up to KERNEL_MAX_ROWS rows — decodes,
1 + k verification runs, small batches — and torch's `F.linear` above (prefill chunks, big batches).

At such M a linear layer only streams its weights. oneDNN's packed GEMM streams cold weights at
9.5 GB/s (bf16) and 11.7 GB/s (f32) on one core here; the kernel prefetches the weight lines a few
row blocks ahead (`benches/linear_cold.py`). Weights stay plain dense tensors (no packed copy), so
`F.linear` takes the long inputs. The CPU platform serves float32 models this way
(`kernel_preferred`); bf16 stays oneDNN-packed. Arithmetic: bf16 weights and activations widen exactly to f32,
products and sums in f32, one rounding of the result to the activation dtype; an output row does
not depend on how many rows are in the call, so a decode and a verification agree bit for bit.

    y = few_rows_linear(x, weight, bias)   # same contract as F.linear
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer._core import dense_linear as _dense_linear_kernel

from specinfer._core import cpu_kernel_isa

_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# Rows up to which the kernel beats oneDNN's packed GEMM on cold weights (benches/linear_cold.py,
# one thread): f32 1 row -14 %, 8 rows -6 %, 16 rows +8 % (but plain F.linear, the alternative
# without a packed copy, is +24 % there); bf16 widens each weight to f32 while oneDNN multiplies
# bf16 pairs natively, so only decodes gain (1 row -15 %, 5 rows +2 %, 16 rows +80 %).
KERNEL_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 4}


def kernel_preferred(dtype: torch.dtype) -> bool:
    """Serve this dtype's GEMMs with plain weights through few_rows_linear instead of oneDNN-packed
    ones: f32 on a CPU with AVX2 or AVX-512 (decodes and verifications gain, a 16-row batch loses
    a little, prefill chunks go through F.linear)."""
    return dtype == torch.float32 and cpu_kernel_isa()[0] != "scalar"


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """The 'packing' for few_rows_linear: the weight as a plain contiguous tensor."""
    return weight.detach().contiguous()


def kernel_takes(weight: torch.Tensor) -> bool:
    """The kernel can hold this weight: a 2-D contiguous bf16/f32 CPU tensor with inputs a multiple of 16."""
    return (weight.dim() == 2 and weight.dtype in _KERNEL_DTYPES and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % 16 == 0 and not weight.requires_grad)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype."""
    N, K = weight.shape
    M = x.numel() // K if K else 0
    if (M == 0 or M > KERNEL_MAX_ROWS.get(weight.dtype, 0) or x.dtype != weight.dtype or not kernel_takes(weight)
            or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad)):
        return F.linear(x, weight, bias)
    assert x.shape[-1] == K, f"few_rows_linear: x has {x.shape[-1]} features, the weight takes {K}"
    lead = x.shape[:-1]
    x2 = x.reshape(M, K).to(torch.float32).contiguous()
    out = torch.empty(M, N, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias.to(torch.float32).contiguous()
        assert b.shape == (N,), f"few_rows_linear: bias shape {tuple(b.shape)} is not ({N},)"
    _dense_linear_kernel(x2.data_ptr(), M, K, weight.data_ptr(), _KERNEL_DTYPES[weight.dtype], N, out.data_ptr(),
                         0 if b is None else b.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype).view(*lead, N)
