"""Mixed paged batches with token trees and their dense oracle built from explicit masks, shared
by the tree attention tests (tests/test_attention_trees.py, the CUDA suite).

A batch mixes prefill chunks (queries > 16 tokens: torch_ref's long path), decodes, chain
verification runs and token trees with random parent arrays (up to 63 nodes, so bit 63, the
int64 sign bit, is used), in the MQA layout (a tree's root + nodes are one query run) or the
batch-expansion layout (each node, and each chain token, its own single-token sequence whose
context ends at its own position, over the request's shared block-table row). The oracle builds
each token's visible key positions explicitly (walking parent pointers into sets) and runs dense
fp64 softmax attention over them: it shares no code with the backends' tree rule.
"""
import math
import random
from dataclasses import dataclass

import torch

from specinfer.attention import AttentionMetadata

@dataclass
class Request:
    cached: int  # tokens already in the cache
    kind: str  # "prefill" | "decode" | "chain" | "tree"
    new: int  # tokens this step (tree: root + nodes)
    parents: list | None = None  # tree: parent index per node (-1: the root)
    query: list | None = None  # tree: the slots (0 = root) queried, in this order, as ONE sequence
    # whose context ends at the highest of them (a proposer drafting a tree level by level); the
    # other slots are already cached. None: every slot is queried.


def random_parents(rng: random.Random, nodes: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(nodes)]


def ancestors_or_self(parents: list[int]) -> list[set[int]]:
    """Per tree slot (0 = root, i + 1 = node i): the slots it may see, walking parent pointers."""
    out = [{0}]
    for i in range(len(parents)):
        seen, p = {0, i + 1}, parents[i]
        while p >= 0:
            seen.add(p + 1)
            p = parents[p]
        out.append(seen)
    return out


def to_int64(bits: set[int]) -> int:
    m = sum(1 << j for j in bits)
    return m - (1 << 64) if m >= 1 << 63 else m


@dataclass
class TreeBatch:
    meta: AttentionMetadata
    cache: torch.Tensor  # [2, NB, BS, Hkv, D] with every request's cached context written
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] strided views of one fused qkv tensor
    v: torch.Tensor
    want: torch.Tensor  # [T, H, D] the dense oracle


def build(requests: list[Request], layout: str, block_size: int, H: int, hkv: int, D: int, seed: int,
          dtype=torch.float32, window: int | None = None, softcap: float | None = None) -> TreeBatch:
    """layout "mqa": one query sequence per request; "expand": chain and tree requests become one
    single-token sequence per token (prefills and decodes stay as they are). The oracle applies
    a sliding window W by each token's logical position (a tree node's: the root's + its depth;
    its ancestors stay visible) and a soft-cap c as c tanh(s / c)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((r.cached + r.new) / block_size) for r in requests) + 3
    cache = torch.zeros(2, num_blocks, block_size, hkv, D, dtype=dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    rows, seqs, tokens = [], [], []  # rows: block rows; seqs: (row, query rows, seq_len, tree_start)
    full_k, full_v = [], []
    for ri, r in enumerate(requests):
        L = r.cached + r.new
        blocks = [free.pop() for _ in range(math.ceil(L / block_size))]
        kk = torch.randn(L, hkv, D, generator=g).to(dtype)
        vv = torch.randn(L, hkv, D, generator=g).to(dtype)
        queried = list(range(r.new)) if r.query is None else r.query
        for p in range(L):
            if p < r.cached or p - r.cached not in queried:
                cache[0, blocks[p // block_size], p % block_size] = kk[p]
                cache[1, blocks[p // block_size], p % block_size] = vv[p]
        rows.append(blocks), full_k.append(kk), full_v.append(vv)
        sees = ancestors_or_self(r.parents) if r.kind == "tree" else None
        new_tokens = []
        for i in queried:
            pos = r.cached + i
            if sees is None:
                visible, mask = set(range(pos + 1)), 0
                if window is not None:
                    visible = {j for j in visible if pos - j < window}
            else:
                logical = r.cached + len(sees[i]) - 1  # root + depth
                prefix = range(r.cached) if window is None else [j for j in range(r.cached) if logical - j < window]
                visible = set(prefix) | {r.cached + j for j in sees[i]}
                mask = to_int64(sees[i])
            slot = blocks[pos // block_size] * block_size + pos % block_size
            new_tokens.append(dict(request=ri, pos=pos, slot=slot, visible=sorted(visible), mask=mask))
        if r.query is not None:
            seqs.append((ri, new_tokens, r.cached + max(queried) + 1, r.cached))
        elif layout == "expand" and r.kind in ("chain", "tree"):
            for t in new_tokens:
                start = r.cached if r.kind == "tree" else t["pos"]
                seqs.append((ri, [t], t["pos"] + 1, start))
        else:
            seqs.append((ri, new_tokens, L, r.cached))
    random.Random(seed).shuffle(seqs)  # trees, chains, prefills and decodes interleaved
    W = max(len(b) for b in rows) + 1
    table, qsl, lens, starts = [], [0], [], []
    for ri, toks, L, start in seqs:
        table.append(rows[ri] + [0] * (W - len(rows[ri])))
        tokens += toks
        qsl.append(qsl[-1] + len(toks))
        lens.append(L)
        starts.append(start)
    T = len(tokens)
    masks = [t["mask"] for t in tokens]
    has_tree = any(masks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t["slot"] for t in tokens], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32), block_size=block_size,
        max_query_len=max(len(s[1]) for s in seqs), max_seq_len=max(lens),
        tree_mask=torch.tensor(masks, dtype=torch.int64) if has_tree else None,
        tree_start=torch.tensor(starts, dtype=torch.int32) if has_tree else None)
    qkv = torch.randn(T, (H + 2 * hkv) * D, generator=g).to(dtype)
    for i, t in enumerate(tokens):
        qkv[i, H * D:(H + hkv) * D] = full_k[t["request"]][t["pos"]].reshape(-1)
        qkv[i, (H + hkv) * D:] = full_v[t["request"]][t["pos"]].reshape(-1)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + hkv) * D].view(T, hkv, D)
    v = qkv[:, (H + hkv) * D:].view(T, hkv, D)
    want = torch.empty(T, H, D, dtype=torch.float64)
    for i, t in enumerate(tokens):
        vis = torch.tensor(t["visible"])
        kk = full_k[t["request"]][vis].double().repeat_interleave(H // hkv, 1)  # [n, H, D]
        vv = full_v[t["request"]][vis].double().repeat_interleave(H // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * D ** -0.5
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        want[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    return TreeBatch(meta, cache, q, k, v, want)


def mixed_requests(rng: random.Random, small: bool = False) -> list[Request]:
    """A prefill chunk (> 16 tokens), two decodes, a chain verification, four trees (one of 63
    nodes, one single node, two random) and a random tree queried at a shuffled subset of its
    nodes, with random cached lengths. small: one decode, three trees (63 nodes, one node, a few
    nodes) and the subset query."""
    out = [Request(rng.randint(0, 20), "prefill", rng.randint(17, 40)),
           Request(rng.randint(1, 30), "decode", 1), Request(rng.randint(1, 30), "decode", 1),
           Request(rng.randint(1, 25), "chain", 1 + rng.randint(2, 5))]
    sizes = (63, 1, rng.randint(2, 20), rng.randint(2, 63))
    if small:
        out, sizes = out[:2] + out[3:], sizes[:2] + (rng.randint(2, 8),)
    for nodes in sizes:
        out.append(Request(rng.randint(0, 40), "tree", 1 + nodes, random_parents(rng, nodes)))
    nodes = rng.randint(3, 40)
    query = rng.sample(range(1, nodes + 1), rng.randint(1, nodes // 2))
    out.append(Request(rng.randint(1, 40), "tree", 1 + nodes, random_parents(rng, nodes), query))
    return out
