"""Brute-force token-tree references: every node's children come from running the draft on the
whole root-to-node path as a plain sequence (no tree attention, no paged KV), as a user would
with HF transformers; the tree rules (docs/trees.md, spec_decode/tree_drafting.py) applied on top."""
from __future__ import annotations

import torch


def static_tree(paths, next_logits, num_nodes: int) -> list[int]:
    """paths: the static tree's paths in node order; next_logits(path_tokens tuple) -> float[V]
    (the draft's logits after the context + those tokens). The first num_nodes nodes' tokens."""
    tokens: dict[tuple, int] = {}
    out = []
    for path in list(paths)[:num_nodes]:
        ctx = tuple(tokens[path[:i]] for i in range(1, len(path)))
        ranked = torch.topk(next_logits(ctx), path[-1] + 1).indices.tolist()
        tokens[path] = ranked[path[-1]]
        out.append(tokens[path])
    return out


def dynamic_tree(num_nodes: int, top_k: int, depth: int, next_logits, node_cap: int, fed_cap: int):
    """EAGLE-2 selection on brute-force log-probs -> (tokens, parents)."""
    nodes = []  # (path tokens tuple, parent creation index, cumulative score)

    def expand(parent: int):
        path = () if parent < 0 else nodes[parent][0]
        base = 0.0 if parent < 0 else nodes[parent][2]
        lp = torch.log_softmax(next_logits(path).float(), -1)
        val, idx = torch.topk(lp, top_k)
        made = []
        for v, t in zip(val.double().tolist(), idx.tolist()):
            made.append(len(nodes))
            nodes.append((path + (t,), parent, base + v))
        return made

    key = (lambda j: (-nodes[j][2], j))
    frontier = expand(-1)
    fed = 0
    for _ in range(2, depth + 1):
        if fed + top_k > fed_cap:
            break
        fed += top_k
        kids = [c for f in frontier for c in expand(f)]
        frontier = sorted(kids, key=key)[:top_k]
    keep = sorted(sorted(range(len(nodes)), key=key)[:min(num_nodes, node_cap)])
    index = {c: i for i, c in enumerate(keep)}
    return [nodes[c][0][-1] for c in keep], [-1 if nodes[c][1] < 0 else index[nodes[c][1]] for c in keep]


def record_tree_proposals(gen):
    """Spy on the engine's proposer: [(context tokens, max_drafts, drafts, parents)] per proposed request."""
    proposer, seen = gen.engine.proposer, []
    inner = proposer.propose

    def spy(inp):
        prop = inner(inp)
        by_id = {st.core_id: (r, st) for r, st in enumerate(inp.requests)}
        for j, cid in enumerate(prop.core_ids.tolist()):
            r, st = by_id[cid]
            lo, hi = prop.cu_num_draft[j], prop.cu_num_draft[j + 1]
            parents = None if prop.draft_parents is None else prop.draft_parents[lo:hi].tolist()
            seen.append((st.tokens_slice(0, st.num_tokens), int(inp.max_drafts[r]),
                         prop.draft_token_ids[lo:hi].tolist(), parents))
        return prop

    proposer.propose = spy
    return seen
