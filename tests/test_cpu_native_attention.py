"""The native CPU attention backend (Rust kernel, rust/kernels) equals the torch reference and a
dense fp32 oracle on the attention matrix (mixed batches, block sizes 1..32, GQA 1..8, head dims
8..128) for every instruction set this CPU has, with and without a sliding window and a logit
soft-cap (token trees, bfloat16, the SDPA route and batch-invariant mode included); and end to
end, a tiny model's logits and greedy generation through the engine (speculative, chunked
prefill, tiny blocks) equal torch_ref's."""
import random

import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer._core import cpu_kernel_isa
from specinfer.attention import AttentionMetadata, get_backend
from specinfer.attention.cpu_native import CpuNativeBackend

from paged_batch import MIXED, dense_oracle, make_batch, run_backend
from runner_harness import model_logits
from tree_batch import build, mixed_requests

DECODES = [(7, 1), (30, 1), (0, 1), (12, 1)]
VERIFY = [(7, 4), (20, 4), (3, 4)]
SPREAD = [(5, 1), (300, 1), (40, 5), (700, 1), (90, 1), (12, 3)]
LONG = [(70, 90), (5, 200)]  # several query tiles per sequence
ISAS = cpu_kernel_isa()[1]  # every instruction set this CPU supports (scalar always)


def _check(seqs, block_size, H, hkv, D, *, isa=None, threads=1, dtype=torch.float32, tol=1e-5, **options):
    """options: window=, softcap= (left out of the backends' calls when not given)."""
    meta, cache, q, k, v, fk, fv = make_batch(seqs, block_size, H, hkv, D, dtype=dtype)
    cache_ref = cache.clone()
    out = run_backend(CpuNativeBackend(num_threads=threads, isa=isa), meta, cache, q, k, v, D ** -0.5, **options)
    assert out.dtype == dtype and out.shape == q.shape
    ref = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5, **options)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)  # the KV store wrote exactly the slots
    want = dense_oracle(q, fk, fv, seqs, meta.query_start_loc.tolist(), D ** -0.5, **options)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("seqs", [MIXED, DECODES, VERIFY, SPREAD, [(50, 1)]])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("H,hkv", [(4, 4), (4, 2), (8, 1), (8, 8)])
def test_matches_reference_over_the_matrix(seqs, block_size, H, hkv):
    _check(seqs, block_size, H, hkv, 8)  # the instruction set this CPU runs by default


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("H,hkv", [(4, 4), (8, 1), (6, 3)])
def test_every_instruction_set(isa, block_size, H, hkv):
    _check(MIXED, block_size, H, hkv, 8, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("D", [8, 20, 64, 80, 128])
def test_head_dims(isa, D):
    _check(MIXED, 16, 6, 2, D, isa=isa)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_prefill_chunks_and_threads(threads):
    _check(LONG, 16, 8, 2, 64, threads=threads)


def test_bfloat16_cache():
    _check(MIXED, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2, threads=2)


def test_bfloat16_long_prefill_runs_go_to_sdpa_the_rest_to_the_kernel(monkeypatch):
    from specinfer.attention import cpu_native

    seqs = MIXED + [(10, 70), (0, 64)]  # two runs at or past SDPA_MIN_QUERY_LEN, one with context
    monkeypatch.setattr(cpu_native, "SDPA_ROUTE", True)  # as on a CPU with AMX
    monkeypatch.setattr(cpu_native, "_sdpa_runs", _counting(cpu_native._sdpa_runs, calls := []))
    _check(seqs, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2)
    assert [len(runs) for runs in calls] == [2]
    calls.clear()
    _check(seqs, 16, 8, 2, 64, dtype=torch.float32)  # float32: the kernel attends everything
    assert calls == []


def test_without_amx_the_kernel_attends_long_bfloat16_runs_too(monkeypatch):
    from specinfer.attention import cpu_native

    monkeypatch.setattr(cpu_native, "SDPA_ROUTE", False)  # e.g. AVX-512 BF16 without AMX (Zen 5)
    monkeypatch.setattr(cpu_native, "_sdpa_runs", _counting(cpu_native._sdpa_runs, calls := []))
    _check(MIXED + [(10, 70), (0, 64)], 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2)
    assert calls == []


def _counting(fn, calls):
    def wrapped(q, kv_flat, runs, *args):
        calls.append(runs)
        return fn(q, kv_flat, runs, *args)
    return wrapped


def test_float16_cache_goes_to_torch_ref():
    _check(MIXED, 4, 4, 2, 16, dtype=torch.float16, tol=2e-3)


def test_contracts_are_asserted():
    meta, cache, q, k, v, *_ = make_batch([(3, 2)], 4, 2, 1, 8)
    b = CpuNativeBackend()
    prepared = b.prepare(meta)
    with pytest.raises(AssertionError, match="contiguous"):
        b.forward(q, k, v, torch.zeros(*cache.shape[:4], 16)[..., :8], prepared, 0.3)
    with pytest.raises(AssertionError, match="block_size"):
        b.forward(q, k, v, cache.view(2, -1, 2, 1, 8), prepared, 0.3)
    with pytest.raises(AssertionError, match="multiple"):
        b.forward(q, k.expand(2, 3, 8), v.expand(2, 3, 8), torch.zeros(2, 4, 4, 3, 8), prepared, 0.3)
    with pytest.raises(AssertionError, match="query tokens"):
        b.forward(q[:1], k[:1], v[:1], cache, prepared, 0.3)
    # what Python cannot see, Rust refuses naming the field: a block id past the cache
    with pytest.raises(ValueError, match="block_table"):
        b.forward(q, k, v, cache[:, :1].contiguous(), prepared, 0.3)
    with pytest.raises(ValueError, match="isa"):
        CpuNativeBackend(isa="sse9").forward(q, k, v, cache, prepared, 0.3)
    with pytest.raises(ValueError, match="num_threads"):
        CpuNativeBackend(num_threads=0)


def test_bad_metadata_is_refused_once_per_forward():
    meta, *_ = make_batch([(3, 2)], 4, 2, 1, 8)
    from dataclasses import replace

    with pytest.raises(ValueError, match="seq_lens"):
        CpuNativeBackend().prepare(replace(meta, seq_lens=torch.tensor([1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="slot_mapping"):
        CpuNativeBackend().prepare(replace(meta, slot_mapping=torch.tensor([-1, 3])))


# ---------------------------------------------------------------- sliding window and soft-cap

# decodes far past the window, verification runs, prefill chunks with and without context (rows of
# one query tile with different window starts), a context ending on a key-chunk boundary (64)
WINDOWED = [(7, 1), (100, 1), (40, 5), (3, 40), (0, 33), (70, 20), (31, 3), (63, 1)]
OPTIONS = [dict(window=1), dict(window=5), dict(window=33), dict(window=1000), dict(softcap=0.5),
           dict(softcap=5.0), dict(window=20, softcap=2.0)]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size,H,hkv,D", [(1, 4, 4, 8), (16, 8, 2, 64), (4, 6, 3, 32), (16, 4, 1, 128)])
def test_window_and_softcap_match_reference(options, isa, block_size, H, hkv, D):
    _check(WINDOWED, block_size, H, hkv, D, isa=isa, **options)


@pytest.mark.parametrize("options", [dict(window=9), dict(softcap=1.0), dict(window=40, softcap=3.0)], ids=str)
def test_window_and_softcap_bfloat16(options):
    _check(WINDOWED, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2, threads=2, **options)


@pytest.mark.parametrize("threads", [1, 3])
def test_windowed_long_prefill_chunks_and_threads(threads):
    _check(LONG, 16, 8, 2, 64, threads=threads, window=50)
    _check(LONG, 8, 4, 4, 32, threads=threads, window=100, softcap=1.5)


def test_window_and_softcap_float16_cache_go_to_torch_ref():
    _check(WINDOWED, 4, 4, 2, 16, dtype=torch.float16, tol=2e-3, window=6, softcap=2.0)


def test_the_options_are_not_ignored():
    meta, cache, q, k, v, *_ = make_batch(WINDOWED, 16, 4, 2, 32)
    b = CpuNativeBackend()
    plain = run_backend(b, meta, cache, q, k, v, 0.3)
    for options in (dict(window=8), dict(softcap=0.5)):
        assert (run_backend(b, meta, cache, q, k, v, 0.3, **options) - plain).abs().max() > 1e-2
    # a window past every context changes nothing, bit for bit
    assert torch.equal(run_backend(b, meta, cache, q, k, v, 0.3, window=200), plain)


def test_bad_options_are_refused():
    meta, cache, q, k, v, *_ = make_batch([(3, 2)], 4, 2, 1, 8)
    b = CpuNativeBackend()
    prepared = b.prepare(meta)
    for options in (dict(window=0), dict(window=-3), dict(window=2.5), dict(softcap=0.0), dict(softcap=-1.0),
                    dict(softcap=float("nan")), dict(softcap=float("inf"))):
        with pytest.raises(ValueError, match=next(iter(options))):
            b.forward(q, k, v, cache, prepared, 0.3, **options)


@pytest.mark.parametrize("layout", ["mqa", "expand"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window,softcap", [(1, None), (8, None), (70, 3.0), (None, 0.7)])
def test_trees_take_the_window_by_logical_position(layout, isa, window, softcap):
    b = build(mixed_requests(random.Random(7)), layout, 4, 4, 2, 16, 7, window=window, softcap=softcap)
    be = CpuNativeBackend(isa=isa)
    out = be.forward(b.q, b.k, b.v, b.cache.clone(), be.prepare(b.meta), 16 ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), b.want, atol=2e-5, rtol=2e-5)


def test_sdpa_route_applies_the_window_and_leaves_soft_capped_layers_to_the_kernel(monkeypatch):
    from specinfer.attention import cpu_native

    seqs = WINDOWED + [(10, 70), (0, 64)]  # two runs at or past SDPA_MIN_QUERY_LEN, one with context
    monkeypatch.setattr(cpu_native, "SDPA_ROUTE", True)  # as on a CPU with AMX
    monkeypatch.setattr(cpu_native, "_sdpa_runs", _counting(cpu_native._sdpa_runs, calls := []))
    for window in (7, 40):
        _check(seqs, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2, window=window)
    assert [len(runs) for runs in calls] == [2, 2]
    calls.clear()
    _check(seqs, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2, softcap=2.0)
    _check(seqs, 16, 8, 2, 64, dtype=torch.bfloat16, tol=2e-2, window=7, softcap=2.0)
    assert calls == []


def test_sdpa_masks_are_built_once_per_window():
    from specinfer.attention import cpu_native

    meta, *_ = make_batch([(10, 70), (0, 64), (5, 1)], 16, 4, 2, 8)
    prepared = CpuNativeBackend().prepare(meta)
    batch, plain = cpu_native.CpuNativeBackend._split(prepared, 64)
    assert [r[3] is None for r in plain] == [False, True]  # the whole-sequence chunk: SDPA's is_causal
    batch_w, windowed = cpu_native.CpuNativeBackend._split(prepared, 64, 16)
    assert batch_w is batch and cpu_native.CpuNativeBackend._split(prepared, 64, 16)[1] is windowed
    key, query = torch.arange(80).unsqueeze(0), torch.arange(10, 80).unsqueeze(1)
    assert torch.equal(windowed[0][3], (key <= query) & (query - key < 16))


def _single_run(q, k, v, n, block_size, **options):
    """The last n tokens of one sequence (q [L, H, D], k/v [L, Hkv, D]) attended after L - n cached
    ones, in batch-invariant mode; returns their output rows."""
    L, H, D = q.shape
    hkv = k.shape[1]
    nb = -(-L // block_size)
    cache = torch.zeros(2, nb + 1, block_size, hkv, D, dtype=q.dtype)
    flat = cache.view(2, -1, hkv, D)
    flat[0, :L - n], flat[1, :L - n] = k[:L - n], v[:L - n]
    meta = AttentionMetadata(slot_mapping=torch.arange(L - n, L), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([L], dtype=torch.int32),
                             block_table=torch.arange(nb + 1, dtype=torch.int32).unsqueeze(0), block_size=block_size,
                             max_query_len=n, max_seq_len=L)
    b = CpuNativeBackend(num_threads=1)
    b.batch_invariant = True
    return run_backend(b, meta, cache, q[L - n:], k[L - n:], v[L - n:], D ** -0.5, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(window=20), dict(softcap=0.5), dict(window=40, softcap=1.0)], ids=str)
def test_batch_invariant_rows_keep_their_bits_under_window_and_softcap(dtype, options):
    """A token's attention output is the same bits as a decode, in a verification run or in a
    prefill chunk, whatever the window (the key chunks stay aligned however far a run's windows
    start) and the soft-cap."""
    g = torch.Generator().manual_seed(3)
    L, H, hkv, D = 70, 4, 2, 32
    q, k, v = (torch.randn(L, h, D, generator=g).to(dtype) for h in (H, hkv, hkv))
    prefill = _single_run(q, k, v, L, 16, **options)
    for n in (1, 5, 9, 30):
        assert torch.equal(_single_run(q, k, v, n, 16, **options), prefill[L - n:]), n
    want = dense_oracle(q, [k], [v], [(0, L)], [0, L], D ** -0.5, **options)
    torch.testing.assert_close(prefill.float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


def test_tiny_model_logits_equal_torch_ref(tiny_dir):
    ref = model_logits(tiny_dir, "torch_ref")
    out = model_logits(tiny_dir, "cpu_native")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_cpu_platform_defaults_to_cpu_native():
    from specinfer.platform import CpuPlatform, resolve_platform

    assert resolve_platform("cpu").attention_backend == "cpu_native"
    assert CpuPlatform().choose_attention_backend("torch_ref") == "torch_ref"


def test_greedy_generation_through_the_engine_equals_torch_ref(tiny_dir):
    """Speculative ngram k=3 (verification runs), tiny blocks and a small token budget (chunked
    prefill mixed with decodes) over 12 prompts: token for token what torch_ref gives."""
    target, _ = tiny_dir("llama", False)
    g = torch.Generator().manual_seed(5)
    prompts = []
    for i in range(12):
        base = torch.randint(3, 256, (int(torch.randint(2, 60, (1,), generator=g)),), generator=g).tolist()
        prompts.append(base + base[:5] + base if i % 2 else base)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outs = {}
    for backend in ("torch_ref", "cpu_native"):
        gen = Generator(str(target), max_model_len=256, block_size=4, max_num_batched_tokens=48, speculative=spec,
                        attention_backend=backend)
        assert type(gen.engine.runner.backend).__name__ == {"torch_ref": "TorchRefBackend",
                                                             "cpu_native": "CpuNativeBackend"}[backend]
        outs[backend] = [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)]
        assert gen.engine.num_mixed_steps > 0
    assert outs["cpu_native"] == outs["torch_ref"]
