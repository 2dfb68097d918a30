"""The torch reference attention over a paged cache equals dense causal attention per sequence."""
import math

import pytest
import torch

from specinfer.attention import AttentionMetadata, get_backend


def _dense(q, k, v, q_len, scale):
    # q [q_len, H, D], k/v [L, Hkv, D]; causal with the query at the end of the sequence
    H, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    L = k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(L - q_len, L).unsqueeze(1)
    s = s.masked_fill(torch.arange(L).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


MIXED = [(7, 1), (12, 5), (3, 40), (0, 33), (0, 1), (20, 17)]  # decode, verification, prefills
DECODES = [(7, 1), (30, 1), (0, 1), (12, 1)]  # the dense fast path, with key padding
EQUAL_DECODES = [(9, 1), (9, 1), (9, 1)]  # dense, no mask at all
VERIFY = [(7, 4), (20, 4), (3, 4)]  # dense multi-token runs (causal mask)
SPREAD = [(5, 1), (300, 1), (40, 5), (700, 1), (90, 1), (12, 3)]  # several length groups


@pytest.mark.parametrize("seqs", [MIXED, DECODES, EQUAL_DECODES, VERIFY, SPREAD, [(50, 1)]])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_paged_batch_matches_dense(seqs, block_size, hkv):
    torch.manual_seed(0)
    H, D = 4, 8
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 3
    cache = torch.zeros(2, num_blocks, block_size, hkv, D)
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous block ids
    full_k, full_v, tables, slots, qsl, lens = [], [], [], [], [0], []
    for c, n in seqs:
        L = c + n
        nb = math.ceil(L / block_size)
        blocks = [perm.pop() for _ in range(nb)]
        kk, vv = torch.randn(L, hkv, D), torch.randn(L, hkv, D)
        for p in range(c):  # what earlier steps wrote
            cache[0, blocks[p // block_size], p % block_size] = kk[p]
            cache[1, blocks[p // block_size], p % block_size] = vv[p]
        full_k.append(kk), full_v.append(vv), tables.append(blocks), lens.append(L)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, L)]
        qsl.append(qsl[-1] + n)
    W = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt, block_size=block_size,
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens))
    T = qsl[-1]
    q = torch.randn(T, H, D)
    k = torch.cat([kk[c:] for kk, (c, _) in zip(full_k, seqs)])
    v = torch.cat([vv[c:] for vv, (c, _) in zip(full_v, seqs)])
    backend = get_backend("torch_ref")
    out = backend.forward(q, k, v, cache, backend.prepare(meta), scale=D ** -0.5)
    for i, (c, n) in enumerate(seqs):
        want = _dense(q[qsl[i]:qsl[i + 1]], full_k[i], full_v[i], n, D ** -0.5)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_length_groups_bound_padding():
    from specinfer.attention.torch_ref import _length_groups

    lens = [5, 300, 40, 700, 90, 12, 70]
    groups = _length_groups(list(range(7)), lens)
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        assert max(lens[i] for i in g) <= 2 * min(lens[i] for i in g) + 64
    assert len(groups) >= 3
