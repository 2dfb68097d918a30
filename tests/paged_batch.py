"""Random paged attention batches and the dense fp32 oracle, shared by the attention tests."""
import math

import torch

from specinfer.attention import AttentionMetadata

MIXED = [(7, 1), (12, 5), (3, 40), (0, 33), (0, 1), (20, 17)]  # decode, verification, prefills


def make_batch(seqs, block_size, H, hkv, D, dtype=torch.float32, seed=0, table_pad=2):
    """A random paged batch. seqs: (cached context c, query length n) per sequence; blocks are
    scattered; q/k/v are strided views of one fused qkv tensor, as the model hands them over.
    Returns meta, cache (context already written), q, k, v and the full per-sequence k/v."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 3
    cache = torch.zeros(2, num_blocks, block_size, hkv, D, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    full_k, full_v, tables, slots, qsl, lens = [], [], [], [], [0], []
    for c, n in seqs:
        L = c + n
        blocks = [perm.pop() for _ in range(math.ceil(L / block_size))]
        kk = torch.randn(L, hkv, D, generator=g).to(dtype)
        vv = torch.randn(L, hkv, D, generator=g).to(dtype)
        for p in range(c):  # what earlier steps wrote
            cache[0, blocks[p // block_size], p % block_size] = kk[p]
            cache[1, blocks[p // block_size], p % block_size] = vv[p]
        full_k.append(kk), full_v.append(vv), tables.append(blocks), lens.append(L)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, L)]
        qsl.append(qsl[-1] + n)
    W = max(len(t) for t in tables) + table_pad
    bt = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt, block_size=block_size,
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens))
    T = qsl[-1]
    qkv = torch.randn(T, (H + 2 * hkv) * D, generator=g).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = torch.cat([kk[c:] for kk, (c, _) in zip(full_k, seqs)])
    v = torch.cat([vv[c:] for vv, (c, _) in zip(full_v, seqs)])
    qkv[:, H * D:(H + hkv) * D] = k.reshape(T, -1)
    qkv[:, (H + hkv) * D:] = v.reshape(T, -1)
    k = qkv[:, H * D:(H + hkv) * D].view(T, hkv, D)  # strided views (token stride (H + 2 Hkv) D)
    v = qkv[:, (H + hkv) * D:].view(T, hkv, D)
    return meta, cache, q, k, v, full_k, full_v


def dense_oracle(q, full_k, full_v, seqs, qsl, scale, window=None, softcap=None):
    """fp32 causal attention per sequence, the query at the end of its context; with a sliding
    window W a query at p sees keys p - W < j <= p; a soft-cap c maps scores to c tanh(s / c)."""
    out = []
    for i, (c, n) in enumerate(seqs):
        qq, kk, vv = q[qsl[i]:qsl[i + 1]].float(), full_k[i].float(), full_v[i].float()
        H, Hkv = qq.shape[1], kk.shape[1]
        kk, vv = kk.repeat_interleave(H // Hkv, 1), vv.repeat_interleave(H // Hkv, 1)
        L = c + n
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        kpos, qpos = torch.arange(L).unsqueeze(0), torch.arange(c, L).unsqueeze(1)
        hidden = kpos > qpos
        if window is not None:
            hidden |= qpos - kpos >= window
        s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(out)


def run_backend(backend, meta, cache, q, k, v, scale, **options):
    """options: window=, softcap= (omitted when not given, so backends see their default call)."""
    return backend.forward(q, k, v, cache, backend.prepare(meta), scale, **options)
