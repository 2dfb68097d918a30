"""Weight packing for CPU GEMMs: oneDNN's pre-packed linear.

On CPU, torch's fp32 `F.linear` goes to MKL's sgemm, whose small-M kernels (a decode batch, a
1 + k verification run) are slow on non-Intel CPUs: on the AMD EPYC machines we run on, a
16-row GEMM costs 4-7x a 1-row one. oneDNN with weights re-laid out once at load time keeps the
cost nearly flat in M (measured: lm_head of SmolLM2 at M=16, 34 ms -> 14 ms). The Platform
decides whether to pack (`Platform.prepare_model`); the model only swaps its linear function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def mkldnn_packing_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_PACKS: dict = {}  # dtype -> whether oneDNN packs it on this CPU


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN can pack weights of `dtype` here (its bf16 path needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; on CPUs without them it raises, and the model keeps dense weights)."""
    if dtype not in PACKABLE_DTYPES or not mkldnn_packing_available():
        return False
    if dtype not in _PACKS:
        try:
            pack_weight(torch.zeros(8, 8, dtype=dtype))
            _PACKS[dtype] = True
        except RuntimeError:
            _PACKS[dtype] = False
    return _PACKS[dtype]


def pack_weight(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor:
    """[out, in] dense weight -> an opaque oneDNN-packed copy for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (contiguous) @ packed weight -> [M, out], same contract as F.linear."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def dense_linear(x, weight, bias=None):
    return F.linear(x, weight, bias)
