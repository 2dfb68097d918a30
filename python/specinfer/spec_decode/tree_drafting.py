"""Drafting token trees depth by depth, for proposers with their own KV (draft_model, eagle, eagle3).

The proposer gives the draft's logits at each request's root and a ``feed`` callback that runs
the draft over a batch of tree nodes (with a tree attention mask over its own paged KV) and
returns their logits (and, for EAGLE, their output features, which their children consume).

Layout (docs/trees.md): a fed node sits at KV slot position ``tree_start + 1 + slot`` with RoPE
position ``tree_start + depth`` and sees the prefix, the root (bit 0) and the slots of its
ancestors and itself (bit slot + 1). For a static tree ``slot`` is the node's index: the draft's
KV lands exactly where the target's tree run puts the node. For a dynamic tree the nodes are
chosen after drafting, so fed nodes take slots in feeding order (scratch KV: nothing reads it
after the proposal; the next catch-up recomputes the accepted path). Leaves are never fed.

- **Static** (`StaticTree`): node (c1..cd) is the c_d-th most likely token of the draft under its
  parent (ranks by the draft's logits). Request r keeps the first ``node_cap[r]`` nodes (a tree).
- **Dynamic** (EAGLE-2, `DynamicTree(num_nodes, top_k, depth)`): the root's top_k children form
  the first frontier, scores = draft log-probabilities. Each further depth feeds the frontier,
  creates the top_k children of every frontier node (in frontier order, then rank order) with
  cumulative scores (parent score + log-prob), and keeps the top_k of those children as the next
  frontier. Finally the num_nodes best of all created nodes are kept (a connected subtree: a
  child scores no higher than its parent, and ties go to the earlier-created node) and ordered by
  creation (depth, then creation order): parents before children.
Orderings are by (score descending, creation ascending); ranks are torch.topk's order.

Children are deterministic top-k choices (q = one-hot), so proposals carry ``draft_probs=None``
whatever the request's temperature; the tree verifier's one-hot variant keeps sampling lossless.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specinfer.attention.metadata import MAX_TREE_SLOTS
from specinfer.spec_decode.proposer import Proposal
from specinfer.spec_decode.token_tree import DynamicTree, StaticTree, ancestor_masks

# feed(req int64[n] (request index, grouped by request in ascending order), slots int64[n],
#      depths int64[n], masks int64[n], tokens int64[n], parent_hidden Tensor[n, H] | None)
#   -> (logits float32[n, V], hidden Tensor[n, H] | None)
Feed = Callable[..., tuple]


@dataclass(frozen=True)
class DraftedTree:
    tokens: np.ndarray  # int64[N] draft token of each node
    parents: np.ndarray  # int32[N] parent node index (-1: the root)


def scratch_slots(tree) -> int:
    """KV slots past the root that drafting `tree` writes (fed nodes), at most."""
    if isinstance(tree, StaticTree):
        has_child = np.zeros(tree.num_nodes, dtype=bool)
        has_child[tree.parents[tree.parents >= 0]] = True
        return int(np.flatnonzero(has_child).max() + 1) if has_child.any() else 0
    return tree.top_k * (tree.depth - 1)


def tree_lookahead(tree, shift: int) -> int:
    """Lookahead slots a proposer drafting `tree` needs past the root: the target's nodes, and its
    own fed nodes, whose slot s sits at root + shift + s (draft_model: shift 1; EAGLE, whose
    pair position p holds token p + 1: shift 0)."""
    fed = min(scratch_slots(tree), MAX_TREE_SLOTS - 1)
    nodes = tree.num_nodes
    return max(nodes, fed + shift)


def tree_proposal(core_ids: np.ndarray, trees: list[DraftedTree]) -> Proposal:
    """uint64[P] request ids and their trees -> one Proposal (deterministic children: no q)."""
    counts = np.array([len(t.tokens) for t in trees], np.int32)
    cu = np.zeros(len(trees) + 1, np.int32)
    np.cumsum(counts, out=cu[1:])
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    return Proposal(core_ids, cu, cat([t.tokens for t in trees], np.int64), None,
                    cat([t.parents for t in trees], np.int32))


def draft_trees(tree, root_logits: torch.Tensor, root_hidden: torch.Tensor | None, node_cap: np.ndarray,
                fed_cap: np.ndarray, feed: Feed) -> list[DraftedTree]:
    """root_logits float32[P, V] (the draft's next-token logits at each request's root), root_hidden
    [P, H] or None (what the root's children consume), node_cap int64[P] (most nodes request p may
    propose), fed_cap int64[P] (most nodes it may feed: the scratch slots it may write)."""
    fed_cap = np.minimum(fed_cap, MAX_TREE_SLOTS - 1)  # a fed slot's bit must fit the 64-bit mask
    if isinstance(tree, StaticTree):
        return _static(tree, root_logits, root_hidden, node_cap, fed_cap, feed)
    if isinstance(tree, DynamicTree):
        return _dynamic(tree, root_logits, root_hidden, node_cap, fed_cap, feed)
    raise TypeError(f"not a token tree: {tree!r}")


def _gather_hidden(prev: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    if prev is None:
        return None
    return prev[torch.tensor(rows, dtype=torch.int64, device=prev.device)]


def _static(tree: StaticTree, root_logits, root_hidden, node_cap, fed_cap, feed) -> list[DraftedTree]:
    P, N = root_logits.shape[0], tree.num_nodes
    R = tree.max_rank + 1
    parents, ranks, depths = tree.parents, tree.ranks, tree.depths
    masks = ancestor_masks(parents)[1:]  # int64[N] mask of node n (bit n + 1 and its ancestors', root bit 0)
    first_child = np.full(N, N, dtype=np.int64)
    for j in range(N - 1, -1, -1):
        if parents[j] >= 0:
            first_child[parents[j]] = j
    cap = np.minimum(np.minimum(node_cap, N), fed_cap + 1)  # a kept node's parent (index < it) was fed
    tokens = np.zeros((P, N), dtype=np.int64)
    top = np.zeros((P, N, R), dtype=np.int64)  # ranked candidates under each fed node
    root_top = torch.topk(root_logits, R, dim=-1).indices.cpu().numpy()  # [P, R]
    row_of: dict[tuple[int, int], int] = {}  # (request, node) -> row of prev_hidden
    prev_hidden = root_hidden
    for p in range(P):
        row_of[(p, -1)] = p
    for d in range(1, tree.max_depth + 1):
        at = np.flatnonzero(depths == d)
        for n in at:
            src = root_top if parents[n] < 0 else top[:, parents[n]]
            tokens[:, n] = src[:, ranks[n]]
        # feed the nodes at this depth that have a kept child (slot n < fed_cap)
        req, nodes = [], []
        for p in range(P):
            for n in at:
                if first_child[n] < cap[p]:
                    req.append(p)
                    nodes.append(int(n))
        if not req:
            break
        req_a, nodes_a = np.array(req, np.int64), np.array(nodes, np.int64)
        hid = _gather_hidden(prev_hidden, [row_of[(p, int(parents[n]))] for p, n in zip(req, nodes)])
        logits, out_hidden = feed(req_a, nodes_a, depths[nodes_a].astype(np.int64), masks[nodes_a],
                                  tokens[req_a, nodes_a], hid)
        top[req_a, nodes_a] = torch.topk(logits, R, dim=-1).indices.cpu().numpy()
        prev_hidden = out_hidden
        row_of = {(p, n): i for i, (p, n) in enumerate(zip(req, nodes))}
    return [DraftedTree(tokens[p, :cap[p]].copy(), parents[:cap[p]].astype(np.int32)) for p in range(P)]


def _dynamic(tree: DynamicTree, root_logits, root_hidden, node_cap, fed_cap, feed) -> list[DraftedTree]:
    P, K = root_logits.shape[0], tree.top_k
    logp = torch.log_softmax(root_logits.float(), -1)
    val, idx = torch.topk(logp, K, dim=-1)
    # per request: created nodes (creation order), their parent (creation index, -1 root), cumulative
    # score, and for fed nodes their scratch slot and mask
    tok = [idx[p].tolist() for p in range(P)]
    par = [[-1] * K for _ in range(P)]
    score = [val[p].double().tolist() for p in range(P)]
    mask_of = [dict() for _ in range(P)]  # creation index -> int mask (fed nodes)
    frontier = [list(range(K)) for _ in range(P)]  # creation indices, best first
    num_fed = np.zeros(P, dtype=np.int64)
    row_of = {(p, -1): p for p in range(P)}
    prev_hidden = root_hidden
    for d in range(2, tree.depth + 1):
        req, nodes, slots, masks = [], [], [], []
        for p in range(P):
            if num_fed[p] + K > fed_cap[p]:
                continue
            for c in frontier[p]:
                s = int(num_fed[p])
                num_fed[p] += 1
                parent_mask = 1 if par[p][c] < 0 else mask_of[p][par[p][c]]
                mask_of[p][c] = parent_mask | (1 << (s + 1))
                req.append(p)
                nodes.append(c)
                slots.append(s)
                masks.append(mask_of[p][c])
        if not req:
            break
        req_a = np.array(req, np.int64)
        toks = np.array([tok[p][c] for p, c in zip(req, nodes)], np.int64)
        hid = _gather_hidden(prev_hidden, [row_of[(p, par[p][c])] for p, c in zip(req, nodes)])
        logits, out_hidden = feed(req_a, np.array(slots, np.int64), np.full(len(req), d - 1, np.int64),
                                  np.array(masks, np.int64), toks, hid)
        val, idx = torch.topk(torch.log_softmax(logits.float(), -1), K, dim=-1)
        val, idx = val.double().tolist(), idx.tolist()
        children: dict[int, list[int]] = {}
        for i, (p, c) in enumerate(zip(req, nodes)):
            for v, t in zip(val[i], idx[i]):
                children.setdefault(p, []).append(len(tok[p]))
                tok[p].append(t)
                par[p].append(c)
                score[p].append(score[p][c] + v)
        for p, kids in children.items():
            frontier[p] = sorted(kids, key=lambda j: (-score[p][j], j))[:K]
        prev_hidden = out_hidden
        row_of = {(p, c): i for i, (p, c) in enumerate(zip(req, nodes))}
    out = []
    for p in range(P):
        n = int(min(tree.num_nodes, node_cap[p]))
        keep = sorted(sorted(range(len(tok[p])), key=lambda j: (-score[p][j], j))[:n])
        new_index = {c: i for i, c in enumerate(keep)}
        parents = np.array([-1 if par[p][c] < 0 else new_index[par[p][c]] for c in keep], np.int32)
        out.append(DraftedTree(np.array([tok[p][c] for c in keep], np.int64), parents))
    return out
