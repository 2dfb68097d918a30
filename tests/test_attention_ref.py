"""The torch reference attention over a paged cache equals dense causal attention per sequence."""
import pytest
import torch

from specinfer.attention import get_backend

from paged_batch import dense_oracle, make_batch, run_backend


MIXED = [(7, 1), (12, 5), (3, 40), (0, 33), (0, 1), (20, 17)]  # decode, verification, prefills
DECODES = [(7, 1), (30, 1), (0, 1), (12, 1)]  # the dense fast path, with key padding
EQUAL_DECODES = [(9, 1), (9, 1), (9, 1)]  # dense, no mask at all
VERIFY = [(7, 4), (20, 4), (3, 4)]  # dense multi-token runs (causal mask)
SPREAD = [(5, 1), (300, 1), (40, 5), (700, 1), (90, 1), (12, 3)]  # several length groups


@pytest.mark.parametrize("seqs", [MIXED, DECODES, EQUAL_DECODES, VERIFY, SPREAD, [(50, 1)]])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_paged_batch_matches_dense(seqs, block_size, hkv):
    H, D = 4, 8
    meta, cache, q, k, v, full_k, full_v = make_batch(seqs, block_size, H, hkv, D, table_pad=0)
    backend = get_backend("torch_ref")
    out = run_backend(backend, meta, cache, q, k, v, D ** -0.5)
    want = dense_oracle(q, full_k, full_v, seqs, meta.query_start_loc.tolist(), D ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


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
