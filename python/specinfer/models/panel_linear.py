"""Batch-invariant dense linear layers on CPU at every row count: the panel kernel
(`specinfer._core.panel_linear`: rust/kernels/src/panel_linear.rs for float32,
panel_linear_bf16.rs for bfloat16).

Weights are re-laid out once into panels of 64 output rows: float32 `[ceil(N / 64), K, 64]`, each
output element one chain of fused multiply-adds over k in order from zero, then `+ bias`;
bfloat16 `[ceil(N / 64), ceil(K / 2), 64, 2]`, the activations rounded to bf16 and each element one
chain over the k pairs (the odd product, then the even one: AVX-512 BF16's `vdpbf16ps`, two
multiply-adds per lane per instruction; the same bits by fused multiply-adds elsewhere). Either
way the operations do not depend on the number of rows in the call, so a token's row gets the
same bits in a decode, a 1 + k verification run or a prefill chunk, and with any other requests
beside it. One rounding of the f32 result to the activation dtype. Any K and N.

    w = PanelWeight(weight)              # [N, K] dense -> panels
    y = panel_linear(x, w, bias)         # same contract as F.linear(x, weight, bias)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer._core import cpu_kernel_isa
from specinfer._core import panel_linear as _panel_linear_kernel
from specinfer.models.few_rows_linear import GEMM_ENV
from specinfer.platform.cpu_features import has_amx_bf16, has_avx512_bf16

PANEL = 64  # output rows per panel (rust/kernels/src/panel_linear.rs)
_KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def panel_preferred(dtype: torch.dtype) -> bool:
    """Serve this dtype's GEMMs through panel_linear (SPECINFER_CPU_GEMM=onednn keeps oneDNN,
    =panel asks for it): float32 by default on a CPU with AVX2 or AVX-512 (faster than oneDNN's
    packed sgemm at every row count here: benches/linear_cold.py); bfloat16 by default where the
    CPU has AVX-512 BF16 but no AMX (one `vdpbf16ps` per pair of k: on Zen 5 1.15x oneDNN's decode
    speed, level at batch 16; where AMX multiplies tiles, oneDNN's prefill is out of its reach,
    and without AVX-512 BF16 its fused-multiply-add form runs at half oneDNN's bf16 rate). Either
    way its rows are batch-invariant."""
    import os

    gemm = os.environ.get(GEMM_ENV, "")
    if cpu_kernel_isa()[0] == "scalar" or dtype not in _KERNEL_DTYPES:
        return False
    if gemm:
        return gemm == "panel"
    if dtype == torch.bfloat16:
        return has_avx512_bf16() and not has_amx_bf16()
    return True


class PanelWeight:
    """An [N, K] weight held as panels (rows past N zero): float32 as [ceil(N / 64), K, 64];
    bfloat16 as paired panels [ceil(N / 64), ceil(K / 2), 64, 2] (k = 2i and 2i + 1 of an output
    row side by side, as AVX-512 BF16's `vdpbf16ps` reads them; an odd K padded with a zero k;
    denormal weights flushed to zero, as that instruction reads them)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype not in _KERNEL_DTYPES or weight.device.type != "cpu":
            raise ValueError(f"PanelWeight: a 2-D float32/bfloat16 CPU weight is needed "
                             f"(got {tuple(weight.shape)} {weight.dtype} on {weight.device})")
        n, k = weight.shape
        p = -(-n // PANEL)
        w = weight.detach()
        if p * PANEL != n:
            w = torch.cat([w, w.new_zeros(p * PANEL - n, k)])
        if w.dtype == torch.bfloat16:
            w = torch.where(w.abs() < torch.finfo(torch.bfloat16).tiny, torch.zeros((), dtype=w.dtype), w)
            if k % 2:
                w = torch.cat([w, w.new_zeros(p * PANEL, 1)], 1)
            k2 = w.shape[1] // 2
            self.panels = w.reshape(p, PANEL, k2, 2).transpose(1, 2).contiguous()  # [P, K2, PANEL, 2]
        else:
            self.panels = w.reshape(p, PANEL, k).transpose(1, 2).contiguous()  # [P, K, PANEL]
        self.shape = torch.Size((n, k))
        self.dtype = weight.dtype
        self.device = weight.device

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight back (bf16 denormals as the zeros the kernel reads)."""
        n, k = self.shape
        if self.dtype == torch.bfloat16:
            p, k2 = self.panels.shape[:2]
            return self.panels.transpose(1, 2).reshape(p * PANEL, 2 * k2)[:n, :k]
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
    # bf16 weights with bf16 activations: x read and the output written as bf16 by the kernel (no
    # f32 copies: a 5 x 49152 logits conversion alone cost ~5 % of a bf16 verification step)
    io = torch.bfloat16 if weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 else torch.float32
    out = torch.empty(M, N, dtype=io)
    if M:
        x2 = x.reshape(M, K).to(io).contiguous()
        b = None
        if bias is not None:
            b = bias.to(torch.float32).contiguous()
            if b.shape != (N,):
                raise ValueError(f"panel_linear: bias shape {tuple(b.shape)} is not ({N},)")
        _panel_linear_kernel(x2.data_ptr(), M, K, weight.panels.data_ptr(), _KERNEL_DTYPES[weight.dtype], N,
                             out.data_ptr(), 0 if b is None else b.data_ptr(), torch.get_num_threads(),
                             io_dtype=_KERNEL_DTYPES[io])
    return out.to(x.dtype).view(*lead, N)
