"""Dense linear layers on CPU through the few-rows Rust kernel (`specinfer._core.dense_linear`,
rust/kernels/src/few_rows_linear.rs): bf16 or f32 weights, built for decodes and 1 + k
verification runs, where a linear layer only streams its weights. oneDNN's packed GEMM streams
cold weights at 9.5 GB/s (bf16) and 11.7 GB/s (f32) on one core here; the kernel prefetches the
weight lines a few row blocks ahead and reaches 10.6 / 13.2 GB/s at 1 row (benches/linear_cold.py),
but it widens and multiplies in f32 lanes, so it falls behind oneDNN from about 16 rows.

Arithmetic: bf16 weights and activations widen exactly to f32, products and sums in f32, one
rounding of the result to the activation dtype; an output row does not depend on how many rows
are in the call, so a decode and a verification agree bit for bit. Weights stay plain dense
tensors. The CPU platform serves float32 models this way when asked (`kernel_preferred`);
inputs the kernel cannot take (other dtypes, inputs not a multiple of 16) go to `F.linear`.

    y = few_rows_linear(x, weight, bias)   # same contract as F.linear
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specinfer._core import cpu_kernel_isa
from specinfer._core import dense_linear as _dense_linear_kernel

_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
GEMM_ENV = "SPECINFER_CPU_GEMM"  # "few_rows": float32 models run every GEMM through this kernel


def kernel_preferred(dtype: torch.dtype) -> bool:
    """Serve this dtype's GEMMs with plain weights through few_rows_linear instead of oneDNN-packed
    ones: only when asked (SPECINFER_CPU_GEMM=few_rows), for float32, on a CPU with AVX2/AVX-512.
    Not the default: against oneDNN's packed GEMM on cold weights (benches/linear_cold.py, one
    thread) the kernel is 14 % faster at 1 row and 6 % at 8, but 8 % slower at 16 rows and ~1.5x
    slower from 128 rows (prefill chunks); every row count goes through the kernel, never F.linear
    for some, because only one arithmetic for all row counts keeps greedy speculation exact."""
    return (os.environ.get(GEMM_ENV, "") == "few_rows" and dtype == torch.float32
            and cpu_kernel_isa()[0] != "scalar")


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
    if (M == 0 or x.dtype != weight.dtype or not kernel_takes(weight)
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
