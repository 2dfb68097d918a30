"""Triton kernels (KV store, paged varlen attention) under TRITON_INTERPRET=1 on CPU, against the
torch reference and an fp32 oracle, with and without a sliding window and a logit soft-cap (token
trees included); and the "triton" backend end to end in a tiny model."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specinfer.attention import get_backend  # noqa: E402
from specinfer.attention.triton_backend import TritonBackend  # noqa: E402
from specinfer.kernels.triton import paged_attention, reshape_and_cache  # noqa: E402
from paged_batch import MIXED, dense_oracle, make_batch, run_backend  # noqa: E402
from runner_harness import model_logits  # noqa: E402
from tree_batch import build, mixed_requests  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

CASES = [
    # seqs (context, query length), block_size, H, Hkv, D, dtype
    (MIXED, 4, 4, 2, 8, torch.float32),  # every kind of query in one launch; D padded to 16
    (MIXED, 1, 4, 4, 16, torch.float32),  # block_size 1, MHA
    (MIXED, 16, 8, 1, 16, torch.float32),  # MQA: 8 heads packed into one tile
    ([(7, 1), (30, 1), (0, 1), (12, 1)], 8, 6, 2, 80, torch.float32),  # decodes; GQA 3 (padded to 4); D 80
    ([(7, 4), (20, 4), (3, 4)], 4, 4, 2, 64, torch.float32),  # verification runs 1 + 3
    ([(5, 70)], 32, 2, 1, 64, torch.float32),  # a long chunk: several query tiles and KV tiles
    ([(9, 1), (12, 5), (3, 40)], 16, 4, 2, 64, torch.bfloat16),
    ([(9, 1), (12, 5), (3, 20)], 4, 4, 1, 64, torch.float16),
    ([(33, 1), (2, 3)], 3, 4, 2, 8, torch.float32),  # block_size need not be a power of two
]


@pytest.mark.parametrize("seqs,block_size,H,hkv,D,dtype", CASES)
def test_triton_backend_matches_reference(seqs, block_size, H, hkv, D, dtype):
    meta, cache, q, k, v, fk, fv = make_batch(seqs, block_size, H, hkv, D, dtype=dtype)
    cache_ref = cache.clone()
    out = run_backend(TritonBackend(), meta, cache, q, k, v, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)  # the KV store wrote exactly the slots
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    want = dense_oracle(q, fk, fv, seqs, meta.query_start_loc.tolist(), D ** -0.5)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


# decodes far past the window, verification runs, prefill chunks with and without context (rows of
# one query tile with different window starts), a context ending on a key-tile boundary (BLOCK_N 32)
WINDOWED = [(7, 1), (100, 1), (40, 5), (3, 40), (0, 33), (31, 1)]

WINDOW_CASES = [
    # seqs, block_size, H, Hkv, D, dtype, options
    (WINDOWED, 4, 4, 2, 8, torch.float32, dict(window=1)),  # each token sees itself only
    (WINDOWED, 16, 8, 1, 16, torch.float32, dict(window=5)),  # MQA: rows of one tile, different bounds
    (WINDOWED, 3, 6, 2, 64, torch.float32, dict(window=33)),  # windows across key tiles and blocks
    (WINDOWED, 4, 4, 2, 8, torch.float32, dict(window=1000)),  # longer than every context
    (WINDOWED, 4, 4, 2, 8, torch.float32, dict(softcap=0.5)),
    (WINDOWED, 16, 4, 4, 32, torch.float32, dict(window=20, softcap=2.0)),
    ([(5, 70)], 32, 2, 1, 64, torch.float32, dict(window=40)),  # several query tiles, each its own start
    ([(9, 1), (70, 5), (3, 40)], 16, 4, 2, 64, torch.bfloat16, dict(window=17, softcap=3.0)),
    ([(9, 1), (70, 5), (3, 20)], 4, 4, 1, 64, torch.float16, dict(window=9, softcap=1.0)),
]


@pytest.mark.parametrize("seqs,block_size,H,hkv,D,dtype,options", WINDOW_CASES)
def test_window_and_softcap_match_reference(seqs, block_size, H, hkv, D, dtype, options):
    meta, cache, q, k, v, fk, fv = make_batch(seqs, block_size, H, hkv, D, dtype=dtype)
    cache_ref = cache.clone()
    out = run_backend(TritonBackend(), meta, cache, q, k, v, D ** -0.5, **options)
    ref = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5, **options)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    want = dense_oracle(q, fk, fv, seqs, meta.query_start_loc.tolist(), D ** -0.5, **options)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_the_options_are_not_ignored_and_a_long_window_changes_nothing():
    meta, cache, q, k, v, *_ = make_batch(WINDOWED, 4, 4, 2, 8)
    b = TritonBackend()
    plain = run_backend(b, meta, cache, q, k, v, 0.3)
    for options in (dict(window=8), dict(softcap=0.5)):
        assert (run_backend(b, meta, cache, q, k, v, 0.3, **options) - plain).abs().max() > 1e-2
    assert torch.equal(run_backend(b, meta, cache, q, k, v, 0.3, window=200), plain)


@pytest.mark.parametrize("layout", ["mqa", "expand"])
@pytest.mark.parametrize("window,softcap", [(1, None), (8, 2.0), (70, None)])
def test_trees_take_the_window_by_logical_position(layout, window, softcap):
    """A tree token's window counts from its logical position (root + depth, the popcount of its
    mask, 63-node trees using the int64 sign bit) over the prefix; its ancestors stay visible."""
    b = build(mixed_requests(random.Random(7), small=True), layout, 4, 4, 2, 16, 7, window=window, softcap=softcap)
    be = TritonBackend()
    out = be.forward(b.q, b.k, b.v, b.cache.clone(), be.prepare(b.meta), 16 ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), b.want, atol=1e-5, rtol=1e-5)


def test_bad_options_are_refused():
    meta, cache, q, k, v, *_ = make_batch([(3, 2)], 4, 2, 1, 8)
    b = TritonBackend()
    prepared = b.prepare(meta)
    for options in (dict(window=0), dict(window=2.5), dict(softcap=0.0), dict(softcap=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(options))):
            b.forward(q, k, v, cache, prepared, 0.3, **options)
    with pytest.raises(AssertionError, match="window"):
        paged_attention(q, cache, meta.block_table, meta.query_start_loc, meta.seq_lens, 2, 0.3, window=0)


def test_kv_store_writes_rows_and_skips_negative_slots():
    torch.manual_seed(0)
    cache = torch.zeros(2, 5, 4, 2, 24)  # head_dim 24: padded to 32 inside the kernel
    kv = torch.randn(3, 2 * 2 * 24 + 5)  # k/v as strided views of one row per token
    k, v = kv[:, :48].view(3, 2, 24), kv[:, 48:96].view(3, 2, 24)
    slots = torch.tensor([13, -1, 2])
    reshape_and_cache(k, v, cache, slots)
    want = torch.zeros_like(cache)
    want[0, 3, 1], want[1, 3, 1] = k[0], v[0]
    want[0, 0, 2], want[1, 0, 2] = k[2], v[2]
    torch.testing.assert_close(cache, want, atol=0, rtol=0)


def test_contracts_are_asserted():
    meta, cache, q, k, v, *_ = make_batch([(3, 2)], 4, 2, 1, 8)
    args = (meta.block_table, meta.query_start_loc, meta.seq_lens, 2, 0.3)
    with pytest.raises(AssertionError, match="dtype"):
        paged_attention(q, cache.half(), *args)
    with pytest.raises(AssertionError, match="seq_lens"):
        paged_attention(q, cache, meta.block_table, meta.query_start_loc, meta.seq_lens.long(), 2, 0.3)
    with pytest.raises(AssertionError, match="block_table"):
        paged_attention(q, cache, meta.block_table.long(), meta.query_start_loc, meta.seq_lens, 2, 0.3)
    with pytest.raises(AssertionError, match="unit stride"):
        paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), cache, *args)
    with pytest.raises(AssertionError, match="multiple"):
        paged_attention(q, torch.zeros(2, 4, 4, 3, 8), *args)
    with pytest.raises(AssertionError, match="slot_mapping"):
        reshape_and_cache(k, v, cache, meta.slot_mapping.int())
    with pytest.raises(AssertionError, match="dtypes differ"):
        reshape_and_cache(k, v.half(), cache, meta.slot_mapping)


def test_tiny_model_logits_triton_equal_torch_ref(tiny_dir):
    ref = model_logits(tiny_dir, "torch_ref")
    out = model_logits(tiny_dir, "triton")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_registry_is_lazy_and_platform_picks_triton_on_cuda(monkeypatch):
    code = ("import sys, specinfer.attention as a; from specinfer.platform import resolve_platform; "
            "resolve_platform('cpu'); assert 'triton' in a.available_backends(); "
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith(('triton.', 'specinfer.kernels'))]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    from specinfer import platform
    from specinfer.platform import cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert platform.resolve_platform("cuda").attention_backend == "triton"
    monkeypatch.setattr(cuda, "triton_available", lambda: False)
    assert platform.resolve_platform("cuda").attention_backend == "torch_ref"


_CUDA_CHECK = """
import torch
from specinfer.attention import AttentionMetadata
from specinfer.attention.triton_backend import TritonBackend
from paged_batch import MIXED, dense_oracle, make_batch, run_backend
for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)):
    meta, cache, q, k, v, fk, fv = make_batch(MIXED, 16, 8, 2, 128, dtype=dtype)
    d = torch.device("cuda")
    dm = AttentionMetadata(meta.slot_mapping.to(d), meta.query_start_loc.to(d), meta.seq_lens.to(d),
                           meta.block_table.to(d), meta.block_size, meta.max_query_len, meta.max_seq_len)
    out = run_backend(TritonBackend(), dm, cache.to(d), q.to(d), k.to(d), v.to(d), 128 ** -0.5)
    want = dense_oracle(q, fk, fv, MIXED, meta.query_start_loc.tolist(), 128 ** -0.5)
    torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)
print("cuda ok")
"""


@pytest.mark.gpu
def test_triton_backend_on_cuda():  # pragma: no cover - needs a CUDA device
    """Compiled kernels on a real GPU, in a fresh process without TRITON_INTERPRET (set above)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    subprocess.run([sys.executable, "-c", _CUDA_CHECK], check=True, env=env, cwd=os.path.dirname(__file__))
