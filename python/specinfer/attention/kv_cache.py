"""Paged KV cache tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, head_dim],
allocated lazily on CPU; and the copies that move accepted token-tree nodes into their sequences'
slots. (How many blocks the engine keeps is engine/kv_budget.py.)"""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch

def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype, device) -> list[torch.Tensor]:
    """One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    if torch.device(device).type == "cpu":
        return [lazy_zeros(shape, dtype) for _ in range(model.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory is taken as it is first written, not at allocation, in
    small (4 KB) pages.

    torch.zeros writes every byte, so a KV pool sized for the whole budget (4.2 GB for SmolLM2 by
    default) became resident at start. A fresh anonymous mapping has its pages mapped in, zeroed,
    on first touch; the pool then costs memory as requests fill it. Transparent huge pages are
    refused on it (MADV_NOHUGEPAGE): numpy's own zeros asks for them on large arrays, and then the
    first write into each 2 MB of a layer's cache zeroed (and, where the kernel compacts memory
    to find one, waited for) a whole huge page — a SmolLM2-135M decode step spent 1.2 ms storing
    its 46 KB of K/V, 24 us once the pool was resident (docs/lab notebook, "GGUF: the KV pool's
    first touches"). Page-aligned, so cache-line aligned like torch's allocator."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS") \
        else mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # numpy's array keeps the mapping alive (the buffer protocol holds it), torch's the array
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)).view(dtype).view(shape)


def apply_kv_copies(caches_per_model: list, src: np.ndarray, dst: np.ndarray) -> None:
    """Move the accepted tree nodes' K/V into the sequence's slots, in every layer of every model.

    src/dst int64[C] flat slots (block * block_size + offset). Each cache is
    [2, num_blocks, block_size, kv_heads, head_dim]; pairs are applied as one gather then one
    scatter, which equals applying them in order because no dst is a later pair's src."""
    if len(src) == 0:
        return
    for caches in caches_per_model:
        for cache in caches:
            flat = cache.view(2, -1, *cache.shape[3:])
            s = torch.from_numpy(np.asarray(src, np.int64)).to(cache.device)
            d = torch.from_numpy(np.asarray(dst, np.int64)).to(cache.device)
            flat[:, d] = flat[:, s]
