"""Weight-only int8 GEMM weights for CPU: int8 values with one float32 scale per group of 32
inputs of each output row (GGUF Q8_0's layout, so Q8_0 tensors load without a second rounding),
multiplied by the Rust kernel (`specinfer._core.int8_linear`, rust/kernels/src/int8_linear.rs) in
float32. Chosen with `quantization="int8"`; the model's norms, biases and activations keep the
model dtype.

    w = Int8Weight.quantize(dense)            # [out, in] float -> int8 + scales (absmax / 127)
    y = int8_linear(x, w, bias)               # same contract as F.linear

Up to KERNEL_MAX_ROWS input rows the Rust kernel multiplies the int8 weights directly; longer
inputs (prefill chunks) dequantize the weight for the call and run a float GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer._core import int8_linear as _int8_linear_kernel

GROUP_SIZE = 32  # inputs per scale (GGUF Q8_0 block)
# Rows up to which the int8 kernel runs (decodes, verification runs, batches: weight-bandwidth
# bound, where int8 reads a quarter of the bytes); longer inputs (prefill chunks) are compute
# bound and go through a float GEMM over the weight dequantized for that call.
KERNEL_MAX_ROWS = 32
QUANTIZATIONS = ("int8",)


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
    slice by `load` (fused q|k|v and gate|up weights), from float tensors or QuantizedTensors."""

    dtype = torch.int8

    def __init__(self, n: int, k: int, group: int = GROUP_SIZE, device="cpu"):
        if k % group:
            raise ValueError(f"int8 weights need the input size ({k}) to be a multiple of {group}")
        self.q = torch.zeros(n, k, dtype=torch.int8, device=device)
        self.scales = torch.zeros(n, k // group, dtype=torch.float32, device=device)
        self.group = group

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scales.numel()

    def rows_shape(self, rows: slice | None) -> tuple[int, int]:
        return tuple(self.q.shape if rows is None else self.q[rows].shape)

    @torch.no_grad()
    def load(self, rows: slice | None, tensor) -> None:
        if not isinstance(tensor, QuantizedTensor):
            tensor = quantize_rows(tensor, self.group)
        elif tensor.group != self.group:
            raise ValueError(f"quantized tensor has groups of {tensor.group}, expected {self.group}")
        rows = slice(None) if rows is None else rows
        self.q[rows].copy_(tensor.q)
        self.scales[rows].copy_(tensor.scales)

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:  # -> float32[n, K]
        q = self.q if rows is None else self.q[rows]
        s = self.scales if rows is None else self.scales[rows]
        return (q.float().view(q.shape[0], -1, self.group) * s.unsqueeze(-1)).view(q.shape)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:  # int64[T] -> float32[T, K]
        return self.dequantize(ids)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight)^T (+ bias) -> [..., N] in x's dtype; float32 inside."""
    N, K = weight.shape
    assert x.shape[-1] == K, f"int8_linear: x has {x.shape[-1]} features, the weight takes {K}"
    assert x.device.type == "cpu", "int8_linear: CPU tensors only"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).to(torch.float32).contiguous()
    M = x2.shape[0]
    if M > KERNEL_MAX_ROWS:
        b = None if bias is None else bias.to(torch.float32)
        return torch.nn.functional.linear(x2, weight.dequantize(), b).to(x.dtype).view(*lead, N)
    out = torch.empty(M, N, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias.to(torch.float32).contiguous()
        assert b.shape == (N,), f"int8_linear: bias shape {tuple(b.shape)} is not ({N},)"
    q, s = weight.q, weight.scales
    assert q.is_contiguous() and s.is_contiguous() and q.dtype == torch.int8 and s.dtype == torch.float32
    _int8_linear_kernel(x2.data_ptr(), M, K, q.data_ptr(), s.data_ptr(), N, weight.group, out.data_ptr(),
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
