"""The engine's share of token trees (docs/trees.md): applying the core's KV copy list after a
tree verification, and showing proposers a verified tree as the chain it accepted."""
from __future__ import annotations

import numpy as np
import torch


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


def chain_rows(token_start: np.ndarray, num_scheduled: np.ndarray, num_rows: np.ndarray,
               tree_paths: dict) -> np.ndarray | None:
    """int64[T] a permutation of the batch rows that lays each verified tree out as a chain: the
    run's rows before its logits rows, the root row, the accepted path's node rows, then the rest
    in their order. None when no tree was verified (the identity).

    token_start int64[R + 1], num_scheduled/num_rows int64[R], tree_paths {request row: accepted
    node indices (0-based among the run's drafts)}."""
    if not tree_paths:
        return None
    order = np.arange(int(token_start[-1]), dtype=np.int64)
    for r, path in tree_paths.items():
        root = int(token_start[r] + num_scheduled[r] - num_rows[r])  # the root's row
        end = int(token_start[r + 1])
        path_rows = root + 1 + np.asarray(path, np.int64)
        rest = np.setdiff1d(np.arange(root + 1, end), path_rows, assume_unique=True)
        order[root + 1:end] = np.concatenate([path_rows, rest])
    return order


def reorder_rows(t: torch.Tensor | None, order: np.ndarray | None) -> torch.Tensor | None:
    if t is None or order is None:
        return t
    return t[torch.from_numpy(order).to(t.device)]
