"""Triton kernels for CUDA: the paged-KV store and paged varlen attention of a mixed batch, and
the mixture-of-experts GEMMs of a layer in one launch each (fused_moe).

Importing this package imports triton. On a CPU-only machine set TRITON_INTERPRET=1 BEFORE the
first import (the @triton.jit decorator reads it once) to run the kernels in Triton's interpreter;
that is how the test suite checks them against the torch reference.
"""
from specinfer.kernels.triton.fused_moe import fused_moe
from specinfer.kernels.triton.paged_attention import paged_attention
from specinfer.kernels.triton.reshape_and_cache import reshape_and_cache

__all__ = ["fused_moe", "paged_attention", "reshape_and_cache"]
