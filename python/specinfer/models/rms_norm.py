"""RMSNorm for the models: the one-pass Rust kernel (`specinfer._core.rms_norm`,
rust/kernels/src/rms_norm.rs) for bfloat16 and float32 CPU tensors in inference, torch's
`F.rms_norm` otherwise. On CPU torch's `rms_norm` makes several passes (upcast, square, mean,
rsqrt, two multiplies, downcast: 14 % of a bf16 batch-16 run, docs/lab/2026-12-notebook.md; in float32
3.2 ms for a 2048 x 576 prefill chunk against 0.39 ms, 13 us for 16 rows against 2 us); the
kernel computes the same f32 expression in one pass and rounds once, as torch does (float32:
within a few ulps of torch, from the order of the sum). Anything that needs autograd, another
device, dtype or a layout the kernel does not take falls back to torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer._core import rms_norm as _rms_norm_kernel


_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _torch_rms_norm(x, shape, weight, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, shape, weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # torch < 2.4


def rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, shape, weight, eps) over the last dimension."""
    if not _kernel_takes(x, weight):
        return _torch_rms_norm(x, shape, weight, eps)
    out = torch.empty_like(x)
    _rms_norm_kernel(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), float(eps),
                     out.data_ptr(), _KERNEL_DTYPES[x.dtype], torch.get_num_threads())
    return out


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return (weight is not None and x.dtype in _KERNEL_DTYPES and weight.dtype is x.dtype
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.dim() >= 1
            and x.is_contiguous() and weight.is_contiguous() and weight.shape == x.shape[-1:]
            and x.numel() > 0 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
