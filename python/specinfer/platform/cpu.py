"""The CPU platform: the Rust paged-attention kernel (cpu_native), fp32, host memory, few-rows / oneDNN GEMMs."""
from __future__ import annotations

import os

import torch

from specinfer.platform.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    default_attention_backend = "cpu_native"  # exact vs torch_ref, faster on decodes and verification

    def __init__(self, device: torch.device | None = None):
        super().__init__(device or torch.device("cpu"), torch.float32)

    def available_memory_bytes(self) -> int:
        return host_available_bytes()

    def choose_attention_backend(self, override: str | None) -> str:
        name = super().choose_attention_backend(override)
        if name == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError("attention_backend='triton' on CPU runs only in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 in the environment before triton is imported")
        return name

    def check_batch_invariant(self, dtype: torch.dtype, quantization: str | None) -> None:
        """batch_invariant=True: every GEMM through a kernel whose output row does not depend on the
        other rows (panel_linear for float32 and bfloat16 weights, w8a8_linear), attention in
        its batch-invariant mode (no SDPA for long bf16 runs). float16 (no such kernel) and
        weight-only int8 (its kernel scales differently from 3 rows on) are refused."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"batch_invariant=True needs dtype float32 or bfloat16 on CPU (got {dtype})")
        if quantization not in (None, "w8a8", "gguf"):
            raise ValueError(f"batch_invariant=True needs float32 or quantization='w8a8' / 'gguf' weights "
                             f"(got quantization={quantization!r})")

    def prepare_model(self, model) -> None:
        """Choose how GEMMs run: float32 weights (and bf16 ones on a CPU with AVX-512 BF16 and no
        AMX) in panels for our panel kernel (faster than oneDNN's packed GEMM here, and
        batch-invariant: models/panel_linear.py, panel_preferred); other bf16 (and float32 with
        SPECINFER_CPU_GEMM=onednn, or on a CPU without AVX2) pre-packed for oneDNN (MKL's small-M
        sgemm is slow on non-Intel CPUs); with SPECINFER_CPU_GEMM=few_rows, float32 models run
        plain weights through the few-rows Rust kernel, with SPECINFER_CPU_GEMM=panel bf16 ones
        through the panel kernel anywhere. SPECINFER_PACK_WEIGHTS=0 keeps dense weights and
        F.linear (a reference for tests). Int8 weights move into their kernel's tiled layout
        (else their first GEMM would do it)."""
        if getattr(model, "quantization", None) is not None:
            model.pack_linear_weights(None, None)
            # w8a8 rounds GEMM inputs to a grid: always batch-invariant attention (model_runner.py)
            model.batch_invariant = self.batch_invariant or model.quantization in ("w8a8", "gguf")
            return
        if self.batch_invariant:  # one GEMM arithmetic for every row count, row-invariant attention
            from specinfer.models.panel_linear import pack_panels, panel_linear

            model.pack_linear_weights(pack_panels, panel_linear)
            model.batch_invariant = True
            return
        if os.environ.get("SPECINFER_PACK_WEIGHTS", "1") == "0":
            return
        from specinfer.models.few_rows_linear import few_rows_linear, kernel_preferred, plain_weight
        from specinfer.models.packed_linear import pack_weight, packed_linear, packing_supported
        from specinfer.models.panel_linear import pack_panels, panel_linear, panel_preferred

        dtype = model.embed_tokens.dtype
        if kernel_preferred(dtype):
            model.pack_linear_weights(plain_weight, few_rows_linear)
        elif panel_preferred(dtype):
            model.pack_linear_weights(pack_panels, panel_linear)
        elif packing_supported(dtype):
            model.pack_linear_weights(pack_weight, packed_linear)


def host_available_bytes() -> int:
    """MemAvailable (free + reclaimable page cache), not bare free pages: the budget must not
    swing with whatever other processes happen to have cached."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 8 << 30


def bf16_matmul_is_native() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX / avx512_bf16, through oneDNN): bf16 autocast
    is then faster than float32, elsewhere emulated and slower."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
