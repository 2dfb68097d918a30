"""The Gaudi path in plain torch, on CPU: flat block-list attention, the bucketed dense path,
shape buckets and bucket-aware speculation length, against the torch reference."""

import pytest
import torch

from specinfer.attention import AttentionMetadata, get_backend
from specinfer.attention.hpu_backend import HpuFlatBackend
from specinfer.kernels.hpu import BucketConfig, BucketPlanner, bucket_range, build_flat_metadata
from specinfer.kernels.hpu.buckets import geometric_range

from paged_batch import MIXED, dense_oracle, make_batch, run_backend
from runner_harness import model_logits


DECODES = [(7, 1), (30, 1), (0, 1), (12, 1), (16, 1)]


@pytest.mark.parametrize("seqs", [DECODES, MIXED, [(9, 1)] * 3, [(5, 4), (2, 4)]], ids=["decode", "mixed", "equal", "mqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H,hkv,D", [(4, 4, 8), (4, 1, 8), (6, 2, 80)])
def test_hpu_flat_matches_reference(seqs, block_size, H, hkv, D):
    meta, cache, q, k, v, fk, fv = make_batch(seqs, block_size, H, hkv, D)
    cache_ref = cache.clone()
    out = run_backend(HpuFlatBackend(), meta, cache, q, k, v, D ** -0.5)
    ref = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)  # the KV store wrote the same slots
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    want = dense_oracle(q, fk, fv, seqs, meta.query_start_loc.tolist(), D ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_hpu_flat_bf16():
    meta, cache, q, k, v, fk, fv = make_batch(MIXED, 4, 4, 2, 64, dtype=torch.bfloat16)
    out = run_backend(HpuFlatBackend(), meta, cache, q, k, v, 64 ** -0.5)
    assert out.dtype == torch.bfloat16
    want = dense_oracle(q, fk, fv, MIXED, meta.query_start_loc.tolist(), 64 ** -0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 4])
def test_batch_expanded_verification_equals_mqa(block_size):
    """Each request's 1 + k verification tokens as k + 1 single-token decodes (the batch_expansion
    scorer on the flat decode path) give what one multi-token query gives under torch_ref."""
    H, hkv, D = 4, 2, 8
    runs = [(9, 4), (3, 3), (14, 1)]  # (context, 1 + k)
    meta, cache, q, k, v, fk, fv = make_batch(runs, block_size, H, hkv, D)
    cache_ref = cache.clone()
    mqa = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5)
    # expand: token j of run s becomes its own sequence of length c + j + 1, same block table row
    rows, lens = [], []
    for s, (c, n) in enumerate(runs):
        rows += [s] * n
        lens += [c + j + 1 for j in range(n)]
    T = len(rows)
    expanded = AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(T + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=meta.block_table[rows],
        block_size=block_size, max_query_len=1, max_seq_len=max(lens))
    backend = HpuFlatBackend()
    prepared = backend.prepare(expanded)
    assert prepared.multi is None and prepared.decode is not None  # all on the flat decode path
    out = backend.forward(q, k, v, cache, prepared, D ** -0.5)
    torch.testing.assert_close(out, mqa, atol=1e-5, rtol=1e-5)


def test_flat_metadata_by_hand():
    # two sequences, block_size 4: lengths 5 (blocks 7, 2) and 3 (block 9); padded to B=4, NB=8
    m = build_flat_metadata(torch.tensor([5, 3]), torch.tensor([[7, 2, 0], [9, 0, 0]]), 4, 4, 8)
    assert m.block_list.tolist() == [7, 2, 9, 0, 0, 0, 0, 0]
    assert m.block_groups.tolist() == [0, 0, 1, 4, 4, 4, 4, 4]  # padding -> the discard row B
    assert m.block_mapping.shape == (8, 4)
    assert m.block_mapping[:3].argmax(1).tolist() == [0, 0, 1] and m.block_mapping[3:].sum() == 0
    inf = float("-inf")
    assert m.block_bias[:3].tolist() == [[0, 0, 0, 0], [0, inf, inf, inf], [0, 0, 0, inf]]
    assert bool((m.block_bias[3:] == 0).all())


def test_shapes_are_static_within_a_bucket():
    """Two different decode batches in one bucket produce identically shaped tensors."""
    backend = HpuFlatBackend(BucketPlanner(BucketConfig(batch_buckets=(4, 8), block_buckets=(16, 32))))
    shapes = []
    for seqs in ([(3, 1), (9, 1)], [(1, 1), (2, 1), (20, 1)]):
        meta = make_batch(seqs, 2, 2, 1, 8)[0]
        flat, rows = backend.prepare(meta).decode
        shapes.append((flat.block_list.shape, flat.block_mapping.shape, flat.block_bias.shape, rows.gather.shape))
    assert shapes[0] == shapes[1] == (torch.Size([16]), torch.Size([16, 4]), torch.Size([16, 2]), torch.Size([4]))
    assert not backend.planner.cold_shapes


def test_cold_shape_is_recorded_not_fatal():
    planner = BucketPlanner(BucketConfig(batch_buckets=(1, 2), block_buckets=(4,)))
    meta, cache, q, k, v, fk, fv = make_batch([(9, 1), (5, 1), (3, 1)], 2, 2, 1, 8)
    out = run_backend(HpuFlatBackend(planner), meta, cache, q, k, v, 8 ** -0.5)
    want = dense_oracle(q, fk, fv, [(9, 1), (5, 1), (3, 1)], meta.query_start_loc.tolist(), 8 ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert planner.cold_shapes == {("batch", 4), ("blocks", 12)}


def test_bucket_range_and_pad():
    assert bucket_range(1, 32, 128) == (1, 2, 4, 8, 16, 32, 64, 96, 128)
    assert bucket_range(16, 128, 300) == (16, 32, 64, 128, 256, 300)
    assert geometric_range(8, 100) == (8, 16, 32, 64, 100)
    assert geometric_range(8, 100, per_octave=2) == (8, 11, 16, 23, 32, 45, 64, 91, 100)
    assert geometric_range(5, 5) == (5,)
    planner = BucketPlanner(BucketConfig(batch_buckets=(1, 2, 4, 8), spec_lengths=(0, 2, 4),
                                         prefill_query_buckets=(16, 64)))
    assert [planner.pad(n, "batch") for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    assert planner.config.query_buckets == (1, 3, 5, 16, 64)  # 1 + k for every warmed k, then prefill
    assert planner.pad(2, "query") == 3 and planner.pad(4, "query") == 5
    assert planner.pad(9, "tokens") == 16  # the token axis the packer pads (default ramp from 8)
    with pytest.raises(ValueError, match="axis"):
        planner.pad(1, "seqs")


def test_speculation_length_never_picks_an_unwarmed_k():
    planner = BucketPlanner(BucketConfig(batch_buckets=(1, 2, 4, 8, 16), spec_lengths=(0, 2, 4)))
    assert planner.warmed_speculation_lengths() == (0, 2, 4)
    assert planner.speculation_length(4, 4) == 4
    assert planner.speculation_length(3, 4) == 2  # 3 was not warmed up: the next smaller warmed k
    assert planner.speculation_length(1, 4) == 0
    assert planner.speculation_length(9, 4) == 4
    # batch expansion: 4 requests * (k + 1) decode rows must fit the largest batch bucket (16)
    assert planner.speculation_length(4, 4, "batch_expansion") == 2  # 4 * 5 = 20 > 16; 4 * 3 = 12
    assert planner.speculation_length(4, 9, "batch_expansion") == 0  # 9 * 3 = 27 > 16
    assert planner.speculation_length(4, 17) == 0  # mqa: 17 requests exceed every batch bucket
    for wanted in range(8):
        for n in range(1, 20):
            for scorer in ("mqa", "batch_expansion"):
                assert planner.speculation_length(wanted, n, scorer) in (0, 2, 4)
    with pytest.raises(ValueError, match="scorer"):
        planner.speculation_length(2, 1, "tree")


@pytest.mark.parametrize("bad, field", [(dict(batch_buckets=()), "batch_buckets"),
                                        (dict(block_buckets=(8, 4)), "block_buckets"),
                                        (dict(spec_lengths=(1, 2)), "spec_lengths"),
                                        (dict(context_block_buckets=(0, 4)), "context_block_buckets")])
def test_bucket_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        BucketConfig(**bad)


def test_device_wrappers_import_habana_lazily():
    """device.py imports anywhere; its calls need habana_frameworks (absent here)."""
    from specinfer.kernels.hpu import device

    cache = device.HpuGraphCache(lambda x: x)
    assert len(cache) == 0
    try:
        import habana_frameworks  # noqa: F401
    except ImportError:
        assert not device.hpu_available()
        with pytest.raises(ImportError):
            device.mark_step()


def test_registry_and_platform_choose_hpu_flat():
    from specinfer.attention import available_backends

    assert "hpu_flat" in available_backends()
    assert isinstance(get_backend("hpu_flat"), HpuFlatBackend)


def test_tiny_model_logits_hpu_flat_equal_torch_ref(tiny_dir):
    ref = model_logits(tiny_dir, "torch_ref")
    out = model_logits(tiny_dir, "hpu_flat")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.hpu
def test_hpu_flat_on_gaudi():  # pragma: no cover - needs a Gaudi device
    import habana_frameworks.torch  # noqa: F401

    meta, cache, q, k, v, fk, fv = make_batch(MIXED, 16, 4, 2, 64, dtype=torch.bfloat16)
    dev = torch.device("hpu")
    meta_dev = AttentionMetadata(*(t.to(dev) if isinstance(t, torch.Tensor) else t for t in
                                   (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                    meta.block_size, meta.max_query_len, meta.max_seq_len)))
    out = run_backend(HpuFlatBackend(), meta_dev, cache.to(dev), q.to(dev), k.to(dev), v.to(dev), 64 ** -0.5)
    want = dense_oracle(q, fk, fv, MIXED, meta.query_start_loc.tolist(), 64 ** -0.5)
    torch.testing.assert_close(out.cpu().float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 4])
def test_all_flat_layout_with_packer_padding_matches_reference(block_size):
    """multi_token_path="flat": every query token (prefill chunks and verification runs too) is a
    row of the flat path; token rows the packer padded (no sequence, null-block slots) come out as
    zeros and write nothing but the null block."""
    H, hkv, D = 4, 2, 8
    meta, cache, q, k, v, fk, fv = make_batch(MIXED, block_size, H, hkv, D)
    ref = run_backend(get_backend("torch_ref"), meta, cache.clone(), q, k, v, D ** -0.5)
    T = q.shape[0]
    pad = 128 - T  # the packer pads T up to the token bucket 128
    null = cache.shape[1]  # one block past the batch's blocks
    big = torch.cat([cache, torch.zeros_like(cache[:, :1])], dim=1)
    slots = torch.cat([meta.slot_mapping, null * block_size + torch.arange(pad) % block_size])
    padded = AttentionMetadata(slots, meta.query_start_loc, meta.seq_lens, meta.block_table, block_size,
                               meta.max_query_len, meta.max_seq_len)
    qp, kp, vp = (torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (q, k, v))
    planner = BucketPlanner(BucketConfig(token_buckets=(8, 64, 128), block_buckets=(16, 256, 1024, 4096)))
    backend = HpuFlatBackend(planner, "flat")
    prepared = backend.prepare(padded)
    assert prepared.multi is None and prepared.decode[0].batch_size == T + pad
    out = backend.forward(qp, kp, vp, big, prepared, D ** -0.5)
    torch.testing.assert_close(out[:T], ref, atol=1e-5, rtol=1e-5)
    assert out[T:].abs().max() == 0
    torch.testing.assert_close(big[:, :null], run_cache_after(meta, cache, k, v), atol=0, rtol=0)
    # the warm-up plan holds this forward's shape, and its dummy metadata has the same signature
    plan = backend.shape_plan()
    sig = backend.signature(prepared)
    dummies = {backend.signature(backend.dummy_prepared(t, f, d, torch.zeros(t, dtype=torch.int64), block_size,
                                                        "cpu")) for t, f, d in plan}
    assert sig in dummies and not planner.cold_shapes


def run_cache_after(meta, cache, k, v):
    """The cache after torch_ref's KV store of this batch (the expected real blocks)."""
    c = cache.clone()
    Hkv, D = k.shape[1], k.shape[2]
    flat = c.view(2, -1, Hkv, D)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    return c
