"""Resolve what the user named (pack name, HF directory, .gguf file) and load it."""
from __future__ import annotations

from pathlib import Path

from specinfer.loader import load_model
from specinfer.packs import is_pack_name, resolve_pack


def load_any(model, *, dtype, device, platform=None, quantization=None):
    """Load and, given the platform, prepare the model for serving (e.g. packed CPU GEMMs)."""
    loaded = _load(model, dtype=dtype, device=device, quantization=quantization)
    if platform is not None:
        platform.prepare_model(loaded.model)
    return loaded


def _load(model, *, dtype, device, quantization=None):
    if isinstance(model, str) and is_pack_name(model):
        path = resolve_pack(model)
    else:
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(
                f"model {str(model)!r} is neither an existing HF directory or .gguf file nor a known pack name")
    return load_model(path, dtype=dtype, device=device, quantization=quantization)
