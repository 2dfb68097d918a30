"""Triton kernels for CUDA: the paged-KV store and paged varlen attention of a mixed batch.

Importing this package imports triton. On a CPU-only machine set TRITON_INTERPRET=1 BEFORE the
first import (the @triton.jit decorator reads it once) to run the kernels in Triton's interpreter;
that is how the test suite checks them against the torch reference.
"""
from specinfer.kernels.triton.paged_attention import paged_attention
from specinfer.kernels.triton.reshape_and_cache import reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
