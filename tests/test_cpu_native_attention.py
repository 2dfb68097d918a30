"""The native CPU attention backend (Rust kernel, rust/kernels) equals the torch reference and a
dense fp32 oracle on the attention matrix (mixed batches, block sizes 1..32, GQA 1..8, head dims
8..128) for every instruction set this CPU has; and end to end, a tiny model's logits and greedy
generation through the engine (speculative, chunked prefill, tiny blocks) equal torch_ref's."""
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer._core import cpu_kernel_isa
from specinfer.attention import get_backend
from specinfer.attention.cpu_native import CpuNativeBackend

from paged_batch import MIXED, dense_oracle, make_batch, run_backend
from test_hpu_attention import model_logits

DECODES = [(7, 1), (30, 1), (0, 1), (12, 1)]
VERIFY = [(7, 4), (20, 4), (3, 4)]
SPREAD = [(5, 1), (300, 1), (40, 5), (700, 1), (90, 1), (12, 3)]
LONG = [(70, 90), (5, 200)]  # several query tiles per sequence
ISAS = cpu_kernel_isa()[1]  # every instruction set this CPU supports (scalar always)


def _check(seqs, block_size, H, hkv, D, *, isa=None, threads=1, dtype=torch.float32, tol=1e-5):
    meta, cache, q, k, v, fk, fv = make_batch(seqs, block_size, H, hkv, D, dtype=dtype)
    cache_ref = cache.clone()
    out = run_backend(CpuNativeBackend(num_threads=threads, isa=isa), meta, cache, q, k, v, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = run_backend(get_backend("torch_ref"), meta, cache_ref, q, k, v, D ** -0.5)
    torch.testing.assert_close(cache, cache_ref, atol=0, rtol=0)  # the KV store wrote exactly the slots
    want = dense_oracle(q, fk, fv, seqs, meta.query_start_loc.tolist(), D ** -0.5)
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
