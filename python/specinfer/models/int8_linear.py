"""Int8 GEMM weights for CPU: int8 values with one float32 scale per group of 32 inputs of each
output row (GGUF Q8_0's layout, so Q8_0 tensors load without a second rounding), multiplied by a
Rust kernel. Two forms:

- `quantization="int8"` (weight-only): the kernel `specinfer._core.int8_linear`
  (rust/kernels/src/int8_linear.rs) widens the weights to float32 and keeps the activations
  float32. Up to KERNEL_MAX_ROWS input rows the kernel multiplies the int8 weights directly;
  longer inputs (prefill chunks) dequantize the weight for the call and run a float GEMM.
- `quantization="w8a8"`: the weights move into a tiled layout (`Int8Weight.pack`) and
  `specinfer._core.w8a8_linear` (rust/kernels/src/w8a8_linear.rs) quantizes the activations per
  group of 32 too (as llama.cpp does for Q8_0) and sums each group exactly in int32 (AVX-512
  VNNI): faster from a few rows on (verification runs, batches, prefill). Rounding activations
  to a grid turns float noise between a decode and a verification run into different greedy
  tokens after a while, so a w8a8 model's ModelRunner puts the attention kernel in its
  batch-invariant mode (attention/cpu_native.py), so speculation stays exact.

The model's norms, biases and activations keep the model dtype.

    w = Int8Weight.quantize(dense)            # [out, in] float -> int8 + scales (absmax / 127)
    y = int8_linear(x, w, bias)               # same contract as F.linear
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer._core import int8_linear as _int8_linear_kernel
from specinfer._core import int8_pack as _int8_pack
from specinfer._core import w8a8_linear as _w8a8_linear_kernel

GROUP_SIZE = 32  # inputs per scale (GGUF Q8_0 block)
# Rows up to which the weight-only kernel runs (decodes, verification runs, batches: weight-
# bandwidth bound, where int8 reads a quarter of the bytes); longer inputs (prefill chunks) are
# compute bound and go through a float GEMM over the weight dequantized for that call.
KERNEL_MAX_ROWS = 32
TILE = 16  # output rows per packed tile (rust/kernels/src/int8_pack.rs)
QUANTIZATIONS = ("int8", "w8a8", "gguf")  # "gguf": models/gguf_linear.py


def check_quantization(quantization: str | None) -> str | None:
    if quantization in (None, "none"):
        return None
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; use one of {list(QUANTIZATIONS)} or None")
    return quantization


@dataclass(frozen=True)
class QuantizedTensor:
    """Int8 values and per-group scales as a loader hands them over (a GGUF Q8_0 tensor)."""

    q: torch.Tensor  # int8[N, K]
    scales: torch.Tensor  # float32[N, K / group]
    group: int = GROUP_SIZE

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(w: torch.Tensor, group: int = GROUP_SIZE) -> QuantizedTensor:
    """[N, K] float -> symmetric absmax int8 per group of `group` inputs (Q8_0's rule)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"cannot quantize a weight with {K} inputs in groups of {group}")
    blocks = w.detach().float().reshape(N, K // group, group)
    scales = blocks.abs().amax(-1) / 127.0  # [N, K / group]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(q.reshape(N, K), scales.contiguous(), group)


class Int8Weight:
    """A [N, K] GEMM weight held as int8 + float32 scales [N, K / group]; filled row slice by row
    slice by `load` (fused q|k|v and gate|up weights), from float tensors or QuantizedTensors.

    `pack()` (the model's pack_linear_weights under quantization="w8a8") moves it into the W8A8
    kernel's layout (rust/kernels/src/int8_pack.rs: tiles of 16 rows, bytes q + 128) and frees the
    row-major copy; `q` / `scales` then unpack on demand, and `dequantize` / `embedding` read rows
    of the packed layout directly."""

    dtype = torch.int8

    def __init__(self, n: int, k: int, group: int = GROUP_SIZE, device="cpu"):
        if k % group:
            raise ValueError(f"int8 weights need the input size ({k}) to be a multiple of {group}")
        self.q = torch.zeros(n, k, dtype=torch.int8, device=device)
        self.scales = torch.zeros(n, k // group, dtype=torch.float32, device=device)
        self.group = group

    # row-major views (tensor-parallel slicing, loading); assigning one drops the packed form
    @property
    def q(self) -> torch.Tensor:  # int8[N, K]
        if self.packed is not None:
            return self._unpack()[0]
        return self._q

    @q.setter
    def q(self, value: torch.Tensor) -> None:
        if self.packed is not None:
            self._scales = self._unpack()[1]
            self.packed = self.packed_scales = None
        self._q = value

    @property
    def scales(self) -> torch.Tensor:  # float32[N, K / group]
        if self.packed is not None:
            return self._unpack()[1]
        return self._scales

    @scales.setter
    def scales(self, value: torch.Tensor) -> None:
        if self.packed is not None:
            self._q = self._unpack()[0]
            self.packed = self.packed_scales = None
        self._scales = value

    packed = None  # uint8[tiles, K / 4, 64] once packed (class default: Int8Weight.__new__ copies)
    packed_scales = None  # float32[tiles, K / group, 16]

    @property
    def shape(self) -> torch.Size:
        return self._shape if self.packed is not None else self._q.shape

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel() + 4 * self.packed_scales.numel()
        return self._q.numel() + 4 * self._scales.numel()

    def rows_shape(self, rows: slice | None) -> tuple[int, int]:
        return tuple(self.q.shape if rows is None else self.q[rows].shape)

    def pack(self) -> None:
        """Move the weights into the kernel's layout (idempotent; frees the row-major copy)."""
        if self.packed is not None:
            return
        q, s = self._q.contiguous(), self._scales.contiguous()
        assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.device.type == "cpu"
        n, k = q.shape
        tiles = -(-n // TILE)
        packed = torch.empty(tiles, k // 4, 4 * TILE, dtype=torch.uint8)
        packed_scales = torch.empty(tiles, k // self.group, TILE, dtype=torch.float32)
        _int8_pack(q.data_ptr(), s.data_ptr(), n, k, self.group, packed.data_ptr(), packed_scales.data_ptr(), False)
        self.packed, self.packed_scales, self._shape = packed, packed_scales, torch.Size((n, k))
        self._q = self._scales = None

    def _unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = self._shape
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, k // self.group, dtype=torch.float32)
        _int8_pack(q.data_ptr(), s.data_ptr(), n, k, self.group, self.packed.data_ptr(),
                   self.packed_scales.data_ptr(), True)
        return q, s

    @torch.no_grad()
    def load(self, rows: slice | None, tensor) -> None:
        if not isinstance(tensor, QuantizedTensor):
            tensor = quantize_rows(tensor, self.group)
        elif tensor.group != self.group:
            raise ValueError(f"quantized tensor has groups of {tensor.group}, expected {self.group}")
        if self.packed is not None:  # back to row-major (loading after packing: rare)
            self._q, self._scales = self._unpack()
            self.packed = self.packed_scales = None
        rows = slice(None) if rows is None else rows
        self._q[rows].copy_(tensor.q)
        self._scales[rows].copy_(tensor.scales)

    def _rows(self, rows: torch.Tensor | slice | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 q, float32 scales) of the given rows."""
        if self.packed is None:
            if rows is None:
                return self._q, self._scales
            return self._q[rows], self._scales[rows]
        if rows is None:
            return self._unpack()
        n, k = self._shape
        ids = torch.arange(n)[rows] if isinstance(rows, slice) else rows.reshape(-1)
        t, r = ids // TILE, ids % TILE
        tiles = self.packed.view(-1, k // 4, TILE, 4)
        q = (tiles[t, :, r, :].reshape(-1, k).to(torch.int16) - 128).to(torch.int8)  # [len, k]
        return q, self.packed_scales[t, :, r]  # [len, k / group]

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:  # -> float32[n, K]
        q, s = self._rows(rows)
        return (q.float().view(q.shape[0], -1, self.group) * s.unsqueeze(-1)).view(q.shape)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # int64[T] -> float32[T, K]
        return self.dequantize(ids)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight)^T (+ bias) -> [..., N] in x's dtype; float32 inside. A packed
    weight runs the W8A8 kernel (activations rounded per group of 32), else weight-only int8."""
    N, K = weight.shape
    assert x.shape[-1] == K, f"int8_linear: x has {x.shape[-1]} features, the weight takes {K}"
    assert x.device.type == "cpu", "int8_linear: CPU tensors only"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).to(torch.float32).contiguous()
    M = x2.shape[0]
    packed = weight.packed is not None
    if M > KERNEL_MAX_ROWS and not packed:
        b = None if bias is None else bias.to(torch.float32)
        return torch.nn.functional.linear(x2, weight.dequantize(), b).to(x.dtype).view(*lead, N)
    out = torch.empty(M, N, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias.to(torch.float32).contiguous()
        assert b.shape == (N,), f"int8_linear: bias shape {tuple(b.shape)} is not ({N},)"
    if packed:
        w, s = weight.packed, weight.packed_scales
        kernel = _w8a8_linear_kernel
    else:
        w, s = weight.q, weight.scales
        assert w.is_contiguous() and s.is_contiguous() and w.dtype == torch.int8 and s.dtype == torch.float32
        kernel = _int8_linear_kernel
    kernel(x2.data_ptr(), M, K, w.data_ptr(), s.data_ptr(), N, weight.group, out.data_ptr(),
           0 if b is None else b.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype).view(*lead, N)


def any_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense weight, int8_linear for an Int8Weight: the GEMM of code whose weights
    may or may not have been quantized (draft heads)."""
    if isinstance(weight, Int8Weight):
        return int8_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def quantized(weight, what: str) -> Int8Weight:
    """A dense [N, K] weight as an Int8Weight (an Int8Weight as it is); `what` names it in errors."""
    if isinstance(weight, Int8Weight):
        return weight
    n, k = weight.shape
    if weight.device.type != "cpu":
        raise ValueError(f"int8 weights run on CPU only ({what} is on {weight.device})")
    if k % GROUP_SIZE:
        raise ValueError(f"cannot make {what} int8: its input size {k} is not a multiple of {GROUP_SIZE}")
    w = Int8Weight(n, k, device=weight.device)
    w.load(None, weight)
    return w
