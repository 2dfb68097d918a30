"""Resolve what the user named (pack name, HF directory, .gguf file) and load it."""
from __future__ import annotations

from pathlib import Path

from specinfer.loader import load_model
from specinfer.packs import is_pack_name, resolve_pack


def load_any(model, *, dtype, device):
    if isinstance(model, str) and is_pack_name(model):
        path = resolve_pack(model)
    else:
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(
                f"model {str(model)!r} is neither an existing HF directory or .gguf file nor a known pack name")
    return load_model(path, dtype=dtype, device=device)
