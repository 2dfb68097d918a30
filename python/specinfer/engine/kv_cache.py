"""Paged KV cache tensors. Target and draft share block ids, so a block's bytes count both."""
from __future__ import annotations

import math

import numpy as np
import torch

_ALIGN = 64  # bytes: a cache line, as torch's own CPU allocator aligns


def bytes_per_block(models, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block costs across every model that keeps a cache over the block tables (on
    this rank: a tensor-parallel shard keeps only its KV heads, model.num_kv_heads)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * m.config.num_layers * block_size * getattr(m, "num_kv_heads", m.config.num_kv_heads)
               * m.config.head_dim * elem for m in models)


def budget_blocks(*, block_bytes: int, available_bytes: int, memory_fraction: float, max_bytes: int) -> int:
    """How many blocks the KV memory budget holds."""
    return min(int(available_bytes * memory_fraction), max_bytes) // block_bytes


def choose_num_blocks(num_kv_blocks: int | None, *, block_size: int, max_model_len: int, block_bytes: int,
                      available_bytes: int, memory_fraction: float, max_bytes: int) -> int:
    """Blocks for the pool: the user's count, or as many as the memory budget allows.

    Refuses a pool that cannot hold one request of max_model_len tokens.
    """
    needed = -(-max_model_len // block_size)
    if num_kv_blocks is None:
        budget = min(int(available_bytes * memory_fraction), max_bytes)
        num_kv_blocks = budget_blocks(block_bytes=block_bytes, available_bytes=available_bytes,
                                      memory_fraction=memory_fraction, max_bytes=max_bytes)
        if num_kv_blocks < needed:
            raise ValueError(
                f"num_kv_blocks: the KV memory budget ({budget / 2**20:.0f} MiB) holds {num_kv_blocks} blocks of "
                f"{block_size} tokens, fewer than the {needed} one max_model_len={max_model_len} request needs; "
                f"lower max_model_len or set num_kv_blocks")
        return int(num_kv_blocks)
    if num_kv_blocks < needed:
        raise ValueError(
            f"num_kv_blocks={num_kv_blocks} is too small: one request of max_model_len={max_model_len} tokens "
            f"needs {needed} blocks of block_size={block_size}")
    return num_kv_blocks


def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype, device) -> list[torch.Tensor]:
    """One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    if torch.device(device).type == "cpu":
        return [lazy_zeros(shape, dtype) for _ in range(model.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory is taken as it is first written, not at allocation.

    torch.zeros writes every byte, so a KV pool sized for the whole budget (4.2 GB for SmolLM2 by
    default) became resident at start. numpy's zeros is a calloc, and a large calloc is a fresh
    anonymous mapping whose pages the kernel maps in, zeroed, on first touch; the pool then costs
    memory as requests fill it. (A small one may come zeroed from the heap: the same contents.)
    Aligned to a cache line like torch's allocator."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    buf = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    off = -buf.ctypes.data % _ALIGN
    return torch.from_numpy(buf[off:off + nbytes]).view(dtype).view(shape)


def activation_bytes(configs, max_num_batched_tokens: int, max_logits_rows: int, dtype: torch.dtype) -> int:
    """A generous estimate of the forward's peak temporaries, kept out of a device KV budget:
    per token the MLP's gate/up/act (3 x intermediate) and the attention's q/k/v/out (4 x hidden),
    and per logits row the fp32 logits, probabilities and one working copy (3 x vocab)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = max(3 * c.intermediate_size + 4 * c.hidden_size + 4 * c.num_heads * c.head_dim for c in configs)
    vocab = max(c.vocab_size for c in configs)
    return max_num_batched_tokens * per_token * elem + max_logits_rows * vocab * 4 * 3
