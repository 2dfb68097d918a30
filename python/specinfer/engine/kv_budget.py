"""How many paged KV blocks the engine keeps: bytes per block (target and draft share block ids, so a
block's bytes count both), the memory budget, and the forward's temporaries kept out of it."""
from __future__ import annotations

import torch


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


def activation_bytes(configs, max_num_batched_tokens: int, max_logits_rows: int, dtype: torch.dtype) -> int:
    """A generous estimate of the forward's peak temporaries, kept out of a device KV budget:
    per token the MLP's gate/up/act (3 x intermediate) and the attention's q/k/v/out (4 x hidden),
    and per logits row the fp32 logits, probabilities and one working copy (3 x vocab)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = max(3 * c.intermediate_size + 4 * c.hidden_size + 4 * c.num_heads * c.head_dim for c in configs)
    vocab = max(c.vocab_size for c in configs)
    return max_num_batched_tokens * per_token * elem + max_logits_rows * vocab * 4 * 3
