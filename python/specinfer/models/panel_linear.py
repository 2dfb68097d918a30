"""Batch-invariant dense linear layers on CPU at every row count: the panel kernel
(`specinfer._core.panel_linear`, rust/kernels/src/panel_linear.rs).

Weights (f32 or bf16) are re-laid out once into panels of 64 output rows, `[ceil(N / 64), K, 64]`;
every output element is one chain of fused multiply-adds over k in order, from zero, then
`+ bias`: the same operations whatever the number of rows in the call, so a token's row gets the
same bits in a decode, a 1 + k verification run or a prefill chunk, and with any other
requests beside it. bf16 weights and activations widen exactly to f32; one rounding of the
result to the activation dtype. Any K and N (no multiple-of-16 rule).

    w = PanelWeight(weight)              # [N, K] dense -> panels
    y = panel_linear(x, w, bias)         # same contract as F.linear(x, weight, bias)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer._core import cpu_kernel_isa
from specinfer._core import panel_linear as _panel_linear_kernel
from specinfer.models.few_rows_linear import GEMM_ENV

PANEL = 64  # output rows per panel (rust/kernels/src/panel_linear.rs)
_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def panel_preferred(dtype: torch.dtype) -> bool:
    """Serve this dtype's GEMMs through panel_linear: float32 by default on a CPU with AVX2 or
    AVX-512 (it beats oneDNN's packed sgemm at every row count here: benches/linear_cold.py, and
    its rows are batch-invariant); bfloat16 only when asked (SPECINFER_CPU_GEMM=panel: its f32
    arithmetic halves oneDNN's bf16 rate on prefill). SPECINFER_CPU_GEMM=onednn keeps oneDNN."""
    import os

    gemm = os.environ.get(GEMM_ENV, "")
    if cpu_kernel_isa()[0] == "scalar" or dtype not in _KERNEL_DTYPES:
        return False
    return gemm == "panel" or (gemm == "" and dtype == torch.float32)


class PanelWeight:
    """An [N, K] f32/bf16 weight held as panels [ceil(N / 64), K, 64] (rows past N zero)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype not in _KERNEL_DTYPES or weight.device.type != "cpu":
            raise ValueError(f"PanelWeight: a 2-D float32/bfloat16 CPU weight is needed "
                             f"(got {tuple(weight.shape)} {weight.dtype} on {weight.device})")
        n, k = weight.shape
        p = -(-n // PANEL)
        w = weight.detach()
        if p * PANEL != n:
            w = torch.cat([w, w.new_zeros(p * PANEL - n, k)])
        self.panels = w.reshape(p, PANEL, k).transpose(1, 2).contiguous()  # [P, K, PANEL]
        self.shape = torch.Size((n, k))
        self.dtype = weight.dtype
        self.device = weight.device

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight back."""
        n, k = self.shape
        return self.panels.transpose(1, 2).reshape(-1, k)[:n]


def pack_panels(weight: torch.Tensor) -> PanelWeight:
    """The `pack` of `pack_linear_weights` for panel_linear."""
    return PanelWeight(weight)


def panel_linear(x: torch.Tensor, weight: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) -> [..., N] in x's dtype."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"panel_linear: x has {x.shape[-1]} features, the weight takes {K}")
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight.to_dense().to(x.dtype), bias)
    lead = x.shape[:-1]
    M = x.numel() // K if K else 0
    out = torch.empty(M, N, dtype=torch.float32)
    if M:
        x2 = x.reshape(M, K).to(torch.float32).contiguous()
        b = None
        if bias is not None:
            b = bias.to(torch.float32).contiguous()
            if b.shape != (N,):
                raise ValueError(f"panel_linear: bias shape {tuple(b.shape)} is not ({N},)")
        _panel_linear_kernel(x2.data_ptr(), M, K, weight.panels.data_ptr(), _KERNEL_DTYPES[weight.dtype], N,
                             out.data_ptr(), 0 if b is None else b.data_ptr(), torch.get_num_threads())
    return out.to(x.dtype).view(*lead, N)
