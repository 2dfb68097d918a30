"""Load a Llama-family model from an HF directory or a single GGUF file.

    from specinfer.loader import load_model
    lm = load_model("path/to/hf_dir")          # config.json + *.safetensors + tokenizer.json
    lm = load_model("path/to/model.Q4_1.gguf") # dequantized to `dtype`
"""
from __future__ import annotations

import os

import torch

from specinfer.loader.loaded import LoadedModel


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device="cpu",
               quantization: str | None = None) -> LoadedModel:
    """quantization="int8": GEMM weights int8 (GGUF Q8_0 kept as is, others quantized per 32)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        from specinfer.loader.hf import load_hf_dir

        return load_hf_dir(path, dtype=dtype, device=device, quantization=quantization)
    if path.endswith(".gguf"):
        from specinfer.loader.gguf_weights import load_gguf

        return load_gguf(path, dtype=dtype, device=device, quantization=quantization)
    raise ValueError(f"{path}: expected an HF model directory or a .gguf file")


__all__ = ["LoadedModel", "load_model"]
