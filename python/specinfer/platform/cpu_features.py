"""The host CPU's feature flags, for choosing between kernels whose speed depends on them (which
GEMM form serves bf16, which attention path takes long bf16 prefill runs)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_amx_bf16() -> bool:
    """AMX tiles for bf16 (Intel Sapphire Rapids and later), which oneDNN uses for bf16 GEMMs and
    torch's bf16 SDPA."""
    return "amx_bf16" in cpu_flags()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()
