"""The one place that knows what hardware we run on: one Platform subclass per hardware,
resolved once per engine. Scheduler, proposer and sampler code never asks "is this CUDA?":
they get a Platform (device, default dtype, attention backend, memory budget, forward runner,
shape buckets, speculation length among warmed shapes).

    cpu           CpuPlatform           cpu_native attention (Rust kernel), fp32
    cuda[:N]      CudaPlatform          Triton kernels, bf16/fp16, CUDA graphs for decode buckets
    hpu           HpuPlatform           flat block-list attention, bucketed static shapes, HPU graphs
    hpu-emulated  HpuEmulatedPlatform   the Gaudi path on CPU, device calls emulated (for tests)
"""
from __future__ import annotations

import torch

from specinfer.platform.base import ATTENTION_BACKENDS, EngineLimits, MemoryBudget, Platform
from specinfer.platform.cpu import CpuPlatform
from specinfer.platform.cuda import CudaPlatform
from specinfer.platform.hpu import HpuEmulatedPlatform, HpuPlatform

DEVICES = ("auto", "cpu", "cuda", "hpu", "hpu-emulated")


def _hpu_available() -> bool:
    from specinfer.kernels.hpu.device import hpu_available

    return hpu_available()


def resolve_platform(device="auto") -> Platform:
    """device: a Platform (used as is), or "auto" | "cpu" | "cuda[:N]" | "hpu" | "hpu-emulated"."""
    if isinstance(device, Platform):
        return device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else ("hpu" if _hpu_available() else "cpu")
    if device == "hpu-emulated":
        return HpuEmulatedPlatform()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not supported (one of {', '.join(DEVICES)})") from None
    if dev.type == "cpu":
        return CpuPlatform(dev)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} requested but CUDA is not available")
        return CudaPlatform(dev)
    if dev.type == "hpu":
        if not _hpu_available():
            raise ValueError(f"device={device!r} requested but habana_frameworks is not available")
        return HpuPlatform(dev)
    raise ValueError(f"device={device!r} is not supported (one of {', '.join(DEVICES)})")


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype, platform: Platform) -> torch.dtype:
    if dtype == "auto" or dtype is None:
        return platform.default_dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or 'auto'") from None


__all__ = ["ATTENTION_BACKENDS", "CpuPlatform", "CudaPlatform", "EngineLimits", "HpuEmulatedPlatform",
           "HpuPlatform", "MemoryBudget", "Platform", "resolve_dtype", "resolve_platform"]
