"""The engine's tree glue: KV copies and the chain view of a verified tree."""
import numpy as np
import torch

from specinfer.attention.kv_cache import apply_kv_copies
from specinfer.engine.tree_steps import chain_rows, reorder_rows


def test_kv_copies_move_the_accepted_path_in_every_layer_and_model():
    bs, nb = 4, 6
    caches = [[torch.randn(2, nb, bs, 2, 3) for _ in range(2)], [torch.randn(2, nb, bs, 1, 5)]]
    before = [[c.clone() for c in m] for m in caches]
    # root at slot position 5 of a request whose blocks are [3, 1, 4, 0]; path = nodes 2 and 6 (positions 8, 12)
    blocks = [3, 1, 4, 0]
    flat = lambda p: blocks[p // bs] * bs + p % bs  # noqa: E731
    src = np.array([flat(5 + 1 + 2), flat(5 + 1 + 6)])
    dst = np.array([flat(6), flat(7)])
    apply_kv_copies(caches, src, dst)
    for m, b in zip(caches, before):
        for c, c0 in zip(m, b):
            f, f0 = c.view(2, -1, *c.shape[3:]), c0.view(2, -1, *c0.shape[3:])
            assert torch.equal(f[:, dst], f0[:, src])
            untouched = np.setdiff1d(np.arange(nb * bs), dst)
            assert torch.equal(f[:, untouched], f0[:, untouched])


def test_copies_in_one_gather_equal_sequential_copies():
    # dst < src and no dst is a later src: the batched copy equals applying pairs in order
    c = torch.arange(2 * 1 * 16).float().view(2, 1, 16, 1, 1)
    src, dst = np.array([3, 5, 9]), np.array([1, 2, 3])
    seq = c.clone().view(2, -1, 1, 1)
    for s_, d_ in zip(src, dst):
        seq[:, d_] = seq[:, s_]
    apply_kv_copies([[c]], src, dst)
    assert torch.equal(c.view(2, -1, 1, 1), seq)


def test_chain_rows_put_root_then_path_then_rest():
    # request 0: a prefill chunk of 3 rows; request 1: a tree run, root + 5 nodes (all rows logits rows)
    start = np.array([0, 3, 9])
    order = chain_rows(start, np.array([3, 6]), np.array([0, 6]), {1: [1, 3]})
    assert order.tolist() == [0, 1, 2, 3, 5, 7, 4, 6, 8]
    assert chain_rows(start, np.array([3, 6]), np.array([0, 6]), {}) is None
    h = torch.arange(9).float().unsqueeze(1)
    assert reorder_rows(h, order).squeeze(1).tolist() == order.tolist()
    assert reorder_rows(h, None) is h
