"""Sliding-window attention and attention-logit soft-capping (attention/backend.py's rule) in the
torch reference and the Gaudi flat backend, against the dense oracles of tests/paged_batch.py
(plain mixed batches) and tests/tree_batch.py (token trees: the window by logical position)."""
import random

import pytest
import torch

from specinfer.attention import get_backend
from specinfer.attention.hpu_backend import HpuFlatBackend

from paged_batch import MIXED, dense_oracle, make_batch, run_backend
from tree_batch import build, mixed_requests

SPREAD = [(5, 1), (300, 1), (40, 5), (700, 1), (90, 1), (12, 3)]
BACKENDS = ["torch_ref", "hpu_flat", "hpu_flat/flat"]


def make_backend(name):
    return HpuFlatBackend(multi_token_path="flat") if name == "hpu_flat/flat" else get_backend(name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqs", [MIXED, SPREAD, [(9, 1), (9, 1)], [(7, 4), (20, 4)]])
@pytest.mark.parametrize("window,softcap", [(4, None), (13, None), (1000, None), (None, 2.0), (6, 1.5)])
def test_window_and_softcap_match_dense(backend, seqs, window, softcap):
    H, hkv, D = 4, 2, 8
    meta, cache, q, k, v, full_k, full_v = make_batch(seqs, 4, H, hkv, D)
    out = run_backend(make_backend(backend), meta, cache, q, k, v, D ** -0.5, window=window, softcap=softcap)
    want = dense_oracle(q * 3, full_k, full_v, seqs, meta.query_start_loc.tolist(), D ** -0.5 / 3,
                        window=window, softcap=softcap)  # same scores, built another way
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["mqa", "expand"])
@pytest.mark.parametrize("window,softcap", [(8, None), (70, 3.0)])
def test_trees_take_the_window_by_logical_position(backend, layout, window, softcap):
    b = build(mixed_requests(random.Random(7)), layout, 4, 4, 2, 16, 7, window=window, softcap=softcap)
    be = make_backend(backend)
    out = be.forward(b.q, b.k, b.v, b.cache.clone(), be.prepare(b.meta), 16 ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), b.want, atol=2e-5, rtol=2e-5)


def test_the_options_change_the_output():
    """Neither option is a no-op on these batches: the oracles differ from plain attention."""
    meta, cache, q, k, v, full_k, full_v = make_batch(MIXED, 4, 4, 2, 8)
    qsl = meta.query_start_loc.tolist()
    plain = dense_oracle(q, full_k, full_v, MIXED, qsl, 8 ** -0.5)
    for opts in ({"window": 4}, {"softcap": 1.0}):
        assert (dense_oracle(q, full_k, full_v, MIXED, qsl, 8 ** -0.5, **opts) - plain).abs().max() > 1e-2
    b = build(mixed_requests(random.Random(7)), "mqa", 4, 4, 2, 16, 7)
    bw = build(mixed_requests(random.Random(7)), "mqa", 4, 4, 2, 16, 7, window=8)
    assert (b.want - bw.want).abs().max() > 1e-2
