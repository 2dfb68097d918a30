"""Attention backend registry with lazy imports (one entry per platform kernel family)."""
from __future__ import annotations

import importlib

from specinfer.attention.metadata import AttentionMetadata, ForwardContext

# name -> "module:Class"; modules are imported only when the backend is chosen.
_REGISTRY: dict[str, str] = {
    "torch_ref": "specinfer.attention.torch_ref:TorchRefBackend",
    "cpu_native": "specinfer.attention.cpu_native:CpuNativeBackend",  # Rust kernel (rust/kernels); CPU default
    "triton": "specinfer.attention.triton_backend:TritonBackend",  # CUDA (CPU: TRITON_INTERPRET=1)
    "hpu_flat": "specinfer.attention.hpu_backend:HpuFlatBackend",  # Gaudi; plain torch, runs on CPU too
}


def register_backend(name: str, target: str) -> None:
    _REGISTRY[name] = target


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str):
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {available_backends()}"
        ) from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["AttentionMetadata", "ForwardContext", "get_backend", "register_backend", "available_backends"]
