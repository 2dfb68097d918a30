"""GGUF tensor data to float32 through the Rust kernel (`specinfer._core.dequantize_gguf`,
rust/kernels/src/dequant.rs): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K,
rows in parallel, bit-identical to the `gguf` package's numpy dequantizers, which remain the
path for every other type. Theirs made most of a GGUF load's time (numpy temporaries per block
row); this reads the file's memory map once and writes the result once."""
from __future__ import annotations

import math

import numpy as np
import torch

from specinfer._core import dequantize_gguf, gguf_type_supported


def dequantize_into(data: np.ndarray, type_id: int, out: torch.Tensor) -> bool:
    """Write the tensor's values into `out` (contiguous float32 CPU, the tensor's [rows, cols]
    shape); False (nothing written) where the kernel does not read this type."""
    type_id = int(type_id)
    if not (gguf_type_supported(type_id) and out.dtype == torch.float32 and out.device.type == "cpu"
            and out.is_contiguous()):
        return False
    src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    cols = int(out.shape[-1]) if out.dim() else 1
    rows = out.numel() // cols if cols else 0
    dequantize_gguf(src.ctypes.data, src.nbytes, type_id, rows, cols, out.data_ptr(), torch.get_num_threads())
    return True


def dequantize(data: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's data (the reader's array over the file) of ggml type `type_id` -> a new float32
    array of `shape` (rows-major, the reader's [rows, cols] order). ValueError if the data does
    not hold exactly that many values."""
    type_id = int(type_id)
    if not gguf_type_supported(type_id):
        from gguf.quants import dequantize as numpy_dequantize

        out = numpy_dequantize(data, type_id)
        if out.size != math.prod(shape):
            raise ValueError(f"{out.size} values for shape {shape}")
        return np.array(out.reshape(shape), dtype=np.float32, copy=True)
    src = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    cols = int(shape[-1]) if shape else 1
    rows = math.prod(shape) // cols if cols else 0
    out = np.empty(shape, dtype=np.float32)
    dequantize_gguf(src.ctypes.data, src.nbytes, type_id, rows, cols, out.ctypes.data, torch.get_num_threads())
    return out
