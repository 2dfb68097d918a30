"""Resolve what the user named (pack name, HF directory, .gguf file) and load it.

`shared_models()`: within it, engines of one process that load the same model with the same
settings share one loaded, prepared copy (weights are read-only once prepared). The bench runs
every method inside it: each method then reads the very same weight memory, so a comparison
between methods does not include where each engine's copy happened to land in physical memory
(measured on a bandwidth-bound CPU, benches/experiments/instance_effect.py: identical engines with their own
copies differed by up to ~2 %, the same in every repeat, and methods of one bench run by 4 %; with
one shared copy by under 0.6 %), and a run of ten methods holds one target copy instead of ten."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path

from specinfer.loader import load_model
from specinfer.packs import is_pack_name, resolve_pack

# environment that changes how prepare_model lays the weights out (platform/cpu.py)
_PREPARE_ENV = ("SPECINFER_CPU_GEMM", "SPECINFER_PACK_WEIGHTS")
_shared: dict | None = None  # key -> LoadedModel while shared_models() is active
_shared_lock = threading.Lock()


@contextmanager
def shared_models():
    """Share loaded models between the engines built inside (see the module doc); re-entrant."""
    global _shared
    with _shared_lock:
        outer = _shared is not None
        if not outer:
            _shared = {}
    try:
        yield
    finally:
        if not outer:
            with _shared_lock:
                _shared = None


def resolve_quantization(quantization, model, device, *, dtype="auto", tensor_parallel_size: int = 1):
    """The weight form a model loads with. "auto" (the default): a .gguf file on CPU keeps its
    tensors as stored ("gguf": models/gguf_linear.py) unless a dtype was asked for or the model
    is sharded over ranks; anything else loads dense (None). An explicit "gguf" for a model that
    is not a .gguf file, off CPU or sharded is refused by name."""
    import torch

    from specinfer.models.int8_linear import check_quantization

    device_type = torch.device(device).type if not isinstance(device, str) or device != "auto" else "cpu"
    if quantization == "auto":
        if dtype not in ("auto", None) or device_type != "cpu" or tensor_parallel_size > 1:
            return None
        return "gguf" if _resolve(model).suffix == ".gguf" else None
    quantization = check_quantization(quantization)
    if quantization == "gguf":
        path = _resolve(model)
        if path.suffix != ".gguf":
            raise ValueError(f"quantization='gguf' keeps a GGUF file's tensors as stored; {str(model)!r} is not a "
                             f".gguf file (use quantization=None, 'int8' or 'w8a8')")
        if device_type != "cpu":
            raise ValueError(f"quantization='gguf' runs on CPU only (device={device!s})")
        if tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' does not shard over tensor-parallel ranks yet; use "
                             "quantization=None (dequantized) with tensor_parallel_size > 1")
    return quantization


def load_any(model, *, dtype, device, platform=None, quantization=None):
    """Load and, given the platform, prepare the model for serving (e.g. packed CPU GEMMs)."""
    path = _resolve(model)
    key = _share_key(path, dtype, device, platform, quantization)
    if key is not None:
        with _shared_lock:
            found = _shared.get(key) if _shared is not None else None
        if found is not None:
            return found
    loaded = load_model(path, dtype=dtype, device=device, quantization=quantization)
    if platform is not None:
        platform.prepare_model(loaded.model)
    if key is not None:
        with _shared_lock:
            if _shared is not None:
                loaded = _shared.setdefault(key, loaded)
    return loaded


def _share_key(path: Path, dtype, device, platform, quantization):
    """What makes two loads the same prepared model; None when nothing is being shared."""
    if _shared is None or platform is None:  # unprepared loads (tokenizer, lengths) are not kept
        return None
    return (str(path.resolve()), str(dtype), str(device), quantization, type(platform).__name__,
            bool(getattr(platform, "batch_invariant", False)), tuple(os.environ.get(v) for v in _PREPARE_ENV))


def _resolve(model) -> Path:
    if isinstance(model, str) and is_pack_name(model):
        return Path(resolve_pack(model))
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is neither an existing HF directory or .gguf file nor a known pack name")
    return path
