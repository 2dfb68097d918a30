"""Token-tree shapes: the `speculative["token_tree"]` option, parsed and validated.

Two kinds (docs/trees.md):

- **Static** (Medusa choices): a list of paths. Path ``(c1, ..., cd)`` is the node at depth d whose
  token is the ``c_d``-th most likely proposal (0-based rank) under its parent. Every proper prefix
  of a path must itself be listed (the parent must exist). Nodes are ordered by (depth, path): a
  parent always comes before its children and siblings come in rank order, so the first m nodes of
  a tree always form a tree (what a token-budget cut keeps).
- **Dynamic** (EAGLE-2): ``{"dynamic": True, "num_nodes": N, "top_k": K, "depth": D}``: each step the
  proposer expands the K best children of each of the K best frontier nodes per depth for D depths
  and keeps the N nodes of highest cumulative draft log-probability (a connected subtree).

Node i of a proposal's tree has ``parents[i]`` = index of its parent among the proposal's nodes, or
-1 for a child of the root (the request's last confirmed token). A chain of k is the tree with
parents ``[-1, 0, 1, ..., k-2]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specinfer.attention.metadata import MAX_TREE_SLOTS

MAX_TREE_NODES = MAX_TREE_SLOTS - 1  # the root takes one slot of a tree run
MAX_TREE_RANK = 64  # the largest sibling rank a static tree may ask for


@dataclass(frozen=True)
class StaticTree:
    paths: tuple  # tuple[tuple[int, ...], ...] sorted by (depth, path)
    parents: np.ndarray  # int32[N] parent node index (-1: root)
    ranks: np.ndarray  # int32[N] sibling rank c_d of the node under its parent
    depths: np.ndarray  # int32[N] depth (1 for children of the root)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def max_rank(self) -> int:
        return int(self.ranks.max())

    def children(self, node: int) -> np.ndarray:  # node -1: the root's children; int64[c] in rank order
        return np.flatnonzero(self.parents == node)


@dataclass(frozen=True)
class DynamicTree:
    num_nodes: int
    top_k: int
    depth: int

    @property
    def max_depth(self) -> int:
        return self.depth


TokenTree = StaticTree | DynamicTree


def parse_token_tree(value) -> TokenTree | None:
    """The `token_tree` option -> a validated tree shape (None: no tree, chains as before)."""
    if value is None or isinstance(value, (StaticTree, DynamicTree)):
        return value
    if isinstance(value, dict):
        return _parse_dynamic(value)
    if isinstance(value, (list, tuple)):
        return _parse_static(value)
    raise ValueError("speculative.token_tree must be a list of paths (static tree) or a dict "
                     f"{{'dynamic': True, 'num_nodes', 'top_k', 'depth'}} (got {type(value).__name__})")


def _positive_int(name: str, v, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
        raise ValueError(f"speculative.token_tree[{name!r}] must be an integer in 1..{hi} (got {v!r})")
    return v


def _parse_dynamic(d: dict) -> DynamicTree:
    known = {"dynamic", "num_nodes", "top_k", "depth"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"speculative.token_tree has unknown keys {unknown}; known: {sorted(known)}")
    if d.get("dynamic") is not True:
        raise ValueError("speculative.token_tree as a dict must say 'dynamic': True "
                         "(a static tree is a list of paths)")
    missing = sorted(known - set(d))
    if missing:
        raise ValueError(f"speculative.token_tree is missing {missing}")
    n = _positive_int("num_nodes", d["num_nodes"], MAX_TREE_NODES)
    k = _positive_int("top_k", d["top_k"], MAX_TREE_RANK)
    depth = _positive_int("depth", d["depth"], MAX_TREE_NODES)
    if depth > n:
        raise ValueError(f"speculative.token_tree: depth {depth} exceeds num_nodes {n} (a path of that "
                         "depth needs that many nodes)")
    return DynamicTree(n, k, depth)


def _parse_static(paths) -> StaticTree:
    if not paths:
        raise ValueError("speculative.token_tree is an empty list; give at least one path, e.g. [[0]]")
    norm = []
    for i, p in enumerate(paths):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"speculative.token_tree[{i}] must be a non-empty list of ranks (got {p!r})")
        for c in p:
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < MAX_TREE_RANK:
                raise ValueError(f"speculative.token_tree[{i}] = {list(p)}: ranks must be integers in "
                                 f"0..{MAX_TREE_RANK - 1}")
        norm.append(tuple(p))
    if len(set(norm)) != len(norm):
        dup = next(p for p in norm if norm.count(p) > 1)
        raise ValueError(f"speculative.token_tree lists path {list(dup)} twice")
    if len(norm) > MAX_TREE_NODES:
        raise ValueError(f"speculative.token_tree has {len(norm)} nodes; at most {MAX_TREE_NODES} fit one tree run")
    order = sorted(norm, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(order)}
    parents = np.empty(len(order), np.int32)
    for i, p in enumerate(order):
        if len(p) == 1:
            parents[i] = -1
        elif p[:-1] in index:
            parents[i] = index[p[:-1]]
        else:
            raise ValueError(f"speculative.token_tree: path {list(p)} has no parent (path {list(p[:-1])} is missing)")
    ranks = np.array([p[-1] for p in order], np.int32)
    depths = np.array([len(p) for p in order], np.int32)
    return StaticTree(tuple(order), parents, ranks, depths)


def chain_tree(k: int) -> StaticTree:
    """The degenerate tree: a chain of k top-1 drafts."""
    return _parse_static([[0] * d for d in range(1, k + 1)])


def node_depths(parents: np.ndarray) -> np.ndarray:
    """int32[N] depth of each node (1 for root children) from parent indices (parents before children)."""
    depths = np.empty(len(parents), np.int32)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: a parent must come before its children")
        depths[i] = 1 if p < 0 else depths[p] + 1
    return depths


def ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """int64[N + 1] tree_mask of the root (bit 0) and of every node i (bit i + 1): itself, its
    ancestors and the root (see specinfer.attention.metadata)."""
    masks = np.empty(len(parents) + 1, np.int64)
    masks[0] = 1
    for i, p in enumerate(parents):
        masks[i + 1] = masks[p + 1] | (np.int64(1) << np.int64(i + 1))
    return masks


def is_chain(parents: np.ndarray) -> bool:
    return bool(np.array_equal(parents, np.arange(-1, len(parents) - 1)))
