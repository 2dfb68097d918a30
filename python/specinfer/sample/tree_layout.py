"""TreeLayout: the flat draft trees of R requests viewed as padded per-request node tables.

Flat inputs (docs/trees.md):
- ``draft_token_ids`` int64[N]: the nodes of all R trees, request after request; request r
  owns ``cu_num_draft[r] .. cu_num_draft[r+1] - 1`` (m_r nodes, m_r <= 63).
- ``draft_parents`` int[N]: the parent of each node as an index among its request's nodes,
  -1 = child of the root. Parents come before children (``-1 <= parent < own index``),
  siblings in candidate order. A chain of k is ``[-1, 0, ..., k-2]``.
- target rows: every tree has a bonus row, so request r owns ``1 + m_r`` rows starting at
  ``first_row[r] = cu_num_draft[r] + r``: row 0 = the root's distribution, row 1 + i = node i's.

Slots: the walk addresses the root as slot 0 and node i as slot 1 + i, so a slot is also the
request-local target row. ``children[r, s, j]`` is the node index of the j-th child (in
candidate order) of slot s, -1 past the last child.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TREE_NODES = 63  # root + nodes fit the 64-bit tree_mask


@dataclass(frozen=True)
class TreeLayout:
    num_nodes: list[int]  # R, host copy of m_r
    max_nodes: int  # M = max_r m_r
    max_children: int  # K = most children of any slot (0 when there are no nodes)
    max_depth: int  # D = deepest node (root = 0; 0 when there are no nodes)
    first_draft: torch.Tensor  # int64[R]; cu_num_draft[:-1]
    first_row: torch.Tensor  # int64[R]; cu_num_draft[:-1] + r
    valid: torch.Tensor  # bool[R, M]; i < m_r
    tokens: torch.Tensor  # int64[R, M]; 0 where invalid
    parents: torch.Tensor  # int64[R, M]; -1 = root; -2 where invalid
    depth: torch.Tensor  # int64[R, M]; 1 for a child of the root; 0 where invalid
    children: torch.Tensor  # int64[R, 1 + M, max(K, 1)]; node index, -1 = none
    num_rows: int  # N + R, rows of target_probs

    @classmethod
    def build(
        cls,
        draft_token_ids: torch.Tensor,  # int64[N]
        draft_parents: torch.Tensor,  # int[N]
        cu_num_draft: torch.Tensor,  # int[R + 1], cu_num_draft[0] == 0
        device: torch.device | str | None = None,
    ) -> "TreeLayout":
        cu = np.asarray(torch.as_tensor(cu_num_draft).cpu(), dtype=np.int64)
        if cu.ndim != 1 or cu.shape[0] < 1 or cu[0] != 0 or (cu[1:] < cu[:-1]).any():
            raise ValueError(f"cu_num_draft must be non-decreasing from 0, got {cu.tolist()}")
        R, N = cu.shape[0] - 1, int(cu[-1])
        tokens_flat = np.asarray(torch.as_tensor(draft_token_ids).cpu(), dtype=np.int64)
        parents_flat = np.asarray(torch.as_tensor(draft_parents).cpu(), dtype=np.int64)
        if tokens_flat.shape != (N,):
            raise ValueError(f"draft_token_ids has shape {tokens_flat.shape}, cu_num_draft says [{N}]")
        if parents_flat.shape != (N,):
            raise ValueError(f"draft_parents has shape {parents_flat.shape}, cu_num_draft says [{N}]")
        counts = np.diff(cu)
        if (counts > MAX_TREE_NODES).any():
            raise ValueError(f"draft_parents: a tree has {int(counts.max())} nodes, at most {MAX_TREE_NODES}")
        req = np.repeat(np.arange(R), counts)
        local = np.arange(N) - np.repeat(cu[:-1], counts)
        bad = (parents_flat < -1) | (parents_flat >= local)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"draft_parents[{i}] = {parents_flat[i]}: node {local[i]} of request {req[i]} "
                             f"needs -1 <= parent < {local[i]} (parents come before children)")
        M = int(counts.max(initial=0))
        valid = np.zeros((R, M), dtype=bool)
        tokens = np.zeros((R, M), dtype=np.int64)
        parents = np.full((R, M), -2, dtype=np.int64)
        valid[req, local] = True
        tokens[req, local] = tokens_flat
        parents[req, local] = parents_flat
        depth = np.zeros((R, M), dtype=np.int64)
        rows = np.arange(R)
        for i in range(M):  # parents come before children
            par = parents[:, i]
            depth[:, i] = np.where(par >= 0, depth[rows, np.maximum(par, 0)] + 1, 1)
        depth[~valid] = 0
        # rank of node i among its siblings = earlier valid nodes with the same parent
        same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :]  # [R, i, j]
        rank = (same & np.tril(np.ones((M, M), dtype=bool), -1)[None]).sum(axis=2)  # [R, M]
        K = int(rank[valid].max(initial=-1)) + 1
        children = np.full((R, 1 + M, max(K, 1)), -1, dtype=np.int64)
        r_idx, i_idx = np.nonzero(valid)
        children[r_idx, parents[r_idx, i_idx] + 1, rank[r_idx, i_idx]] = i_idx
        first_draft = cu[:-1]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return cls(counts.tolist(), M, K, int(depth.max(initial=0)), t(first_draft),
                   t(first_draft + np.arange(R)), t(valid), t(tokens), t(parents), t(depth),
                   t(children), N + R)

    @property
    def num_requests(self) -> int:
        return len(self.num_nodes)

    def is_chain(self) -> torch.Tensor:  # bool[R]: parents are -1, 0, 1, ... (no branching)
        expected = torch.arange(self.max_nodes, device=self.parents.device) - 1
        return ((self.parents == expected) | ~self.valid).all(dim=1)


def chain_parents(num_draft) -> np.ndarray:  # int[R] -> int32[sum]: -1, 0, ..., k-2 per request
    num_draft = np.asarray(num_draft, dtype=np.int64)
    offsets = np.arange(int(num_draft.sum())) - np.repeat(np.cumsum(num_draft) - num_draft, num_draft)
    return (offsets - 1).astype(np.int32)


def is_chain_request(draft_parents, cu_num_draft) -> np.ndarray:  # -> bool[R]
    """Per request: its parents segment is a chain (-1, 0, 1, ...); a request without drafts is one."""
    cu = np.asarray(cu_num_draft, dtype=np.int64)
    parents = np.asarray(draft_parents, dtype=np.int64)
    ok = parents == chain_parents(np.diff(cu))
    bad_before = np.concatenate([[0], np.cumsum(~ok)])
    return (bad_before[cu[1:]] - bad_before[cu[:-1]]) == 0


def node_depths(parents) -> np.ndarray:  # int[m] (parents before children) -> int64[m], root children 1
    parents = np.asarray(parents, dtype=np.int64)
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, par in enumerate(parents.tolist()):
        depth[i] = 1 if par < 0 else depth[par] + 1
    return depth
