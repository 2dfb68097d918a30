"""RMSNorm for the models: the one-pass Rust kernel (`specinfer._core.rms_norm`,
rust/kernels/src/rms_norm.rs) for bfloat16 CPU tensors in inference, torch's `F.rms_norm`
otherwise. For bfloat16 torch's CPU `rms_norm` makes several passes (upcast, square, mean,
rsqrt, two multiplies, downcast: 14 % of a bf16 batch-16 run, docs/benchmarks.md); the kernel
computes the same f32 expression in one pass and rounds once, as torch does. float32 keeps
torch's kernel (already one fused pass), and anything that needs autograd, another device or a
layout the kernel does not take falls back to torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer._core import rms_norm as _rms_norm_kernel


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
                     out.data_ptr(), "bfloat16", torch.get_num_threads())
    return out


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return (weight is not None and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16
            and x.device.type == "cpu" and weight.device.type == "cpu" and x.dim() >= 1
            and x.is_contiguous() and weight.is_contiguous() and weight.shape == x.shape[-1:]
            and x.numel() > 0 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
