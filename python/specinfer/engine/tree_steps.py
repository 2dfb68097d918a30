"""The engine's share of token trees (docs/trees.md): showing proposers a verified tree as the chain
it accepted (the core's KV copy list is applied by attention/kv_cache.apply_kv_copies)."""
from __future__ import annotations

import numpy as np
import torch


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
