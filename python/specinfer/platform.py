"""The one place that knows what hardware we run on. Resolved once per engine.

Scheduler, proposer and sampler code never asks "is this CUDA?": they get a Platform.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    name: str  # "cpu" | "cuda" | "hpu"
    device: torch.device
    default_dtype: torch.dtype
    attention_backend: str  # key in specinfer.attention's registry

    def available_memory_bytes(self) -> int:
        if self.name == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free)
        if self.name == "hpu":  # pragma: no cover - needs Gaudi
            import habana_frameworks.torch.hpu as hthpu  # noqa: F401

            return int(torch.hpu.mem_get_info()[0])
        return _host_available_bytes()

    def prepare_model(self, model) -> None:
        """Last touches before serving: on CPU, pre-pack GEMM weights for oneDNN (MKL's small-M
        sgemm is slow on non-Intel CPUs; packed oneDNN keeps decode and verification GEMMs fast)."""
        if self.name != "cpu" or os.environ.get("SPECINFER_PACK_WEIGHTS", "1") == "0":
            return
        from specinfer.models.packed_linear import (PACKABLE_DTYPES, mkldnn_packing_available, pack_weight,
                                                    packed_linear)

        if model.embed_tokens.dtype in PACKABLE_DTYPES and mkldnn_packing_available():
            model.pack_linear_weights(pack_weight, packed_linear)

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)


def _host_available_bytes() -> int:
    """MemAvailable (free + reclaimable page cache), not bare free pages: the budget must not
    swing with whatever other processes happen to have cached."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 << 30


def _hpu_available() -> bool:
    try:
        import habana_frameworks.torch  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "hpu", None)) and torch.hpu.is_available()


def _triton_available() -> bool:
    """Whether triton is installed, without importing it (its import is slow and CUDA-probing)."""
    return importlib.util.find_spec("triton") is not None


def _cpu_attention_backend() -> str:
    """The Rust kernel (cpu_native) unless SPECINFER_CPU_ATTENTION names another backend."""
    from specinfer.attention import available_backends

    name = os.environ.get("SPECINFER_CPU_ATTENTION", "cpu_native")
    if name not in available_backends():
        raise ValueError(f"SPECINFER_CPU_ATTENTION={name!r} is not an attention backend; available: "
                         f"{available_backends()}")
    return name


def resolve_platform(device: str = "auto") -> Platform:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else ("hpu" if _hpu_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not supported (auto, cpu, cuda, hpu)") from None
    if dev.type == "cpu":
        return Platform("cpu", dev, torch.float32, _cpu_attention_backend())
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} requested but CUDA is not available")
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return Platform("cuda", dev, dtype, "triton" if _triton_available() else "torch_ref")
    if dev.type == "hpu":
        if not _hpu_available():
            raise ValueError(f"device={device!r} requested but habana_frameworks is not available")
        return Platform("hpu", dev, torch.bfloat16, "hpu_flat")
    raise ValueError(f"device={device!r} is not supported (cpu, cuda, hpu)")


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
