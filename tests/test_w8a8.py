"""quantization="w8a8": int8 weights in the kernel's tiled layout times activations rounded to int8
per group of 32 (Q8_0 x Q8_0, as llama.cpp). The kernel computes its documented arithmetic, each
row independently of the others; packed weights read back exactly; a w8a8 model computes its
dequantized float32 twin within activation rounding and runs speculation end to end."""
import pytest
import torch
import torch.nn.functional as F

from specinfer import Generator, SamplingParams
from specinfer.loader import load_model
from specinfer.models.int8_linear import Int8Weight, check_quantization, int8_linear

from runner_harness import int8_twin_dir, two_run_logits


def _w8a8_reference(x, w, b):
    """The kernel's arithmetic, written independently: activations quantized per group of 32
    (Q8_0's rule, C's roundf as in ggml), exact integer group dots, scaled by w_scale * x_scale
    (a float32 product), summed in float64."""
    q, sw = w.q.to(torch.int64), w.scales
    M, K = x.shape
    xs = x.view(M, K // 32, 32)
    sx = xs.abs().amax(-1) / 127.0  # float32, as the kernel computes it
    inv = torch.where(sx > 0, 1.0 / sx, torch.zeros_like(sx))
    v = (xs * inv.unsqueeze(-1)).double()  # the float32 product, rounded half away from zero
    xq = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).to(torch.int64)
    dots = torch.einsum("mge,nge->mng", xq, q.view(q.shape[0], K // 32, 32))  # exact
    scale = (sw.unsqueeze(0) * sx.unsqueeze(1)).double()
    out = (dots.double() * scale).sum(-1)
    return (out if b is None else out + b.double()).float()


def _packed_weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = Int8Weight(n, k)
    w.load(None, torch.randn(n, k, generator=g))
    w.pack()
    return w


@pytest.mark.parametrize("M", [1, 3, 8, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_computes_q8_0_times_q8_0_each_row_alone(M, bias):
    w = _packed_weight(40, 96, M)
    g = torch.Generator().manual_seed(100 + M)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(M, 96, generator=g)
    got = int8_linear(x, w, b)
    torch.testing.assert_close(got, _w8a8_reference(x, w, b), atol=1e-5, rtol=1e-5)
    want = F.linear(x, w.dequantize(), b)  # within activation rounding of the float product
    assert (got - want).norm() / want.norm() < 0.01
    for i in range(M):  # a row's result does not depend on the other rows of the call
        assert torch.equal(int8_linear(x[i:i + 1], w, b), got[i:i + 1])
    out = int8_linear(x.bfloat16(), w, b)  # bf16 activations: float32 inside, bf16 out
    assert out.dtype == torch.bfloat16
    ref = _w8a8_reference(x.bfloat16().float(), w, b)
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), atol=1e-2, rtol=8e-3)  # one bf16 step


def test_packed_weight_reads_back_exactly_and_frees_the_row_major_copy():
    g = torch.Generator().manual_seed(3)
    w = Int8Weight(37, 64)  # 37 rows: the last tile of 16 is padded
    w.load(None, torch.randn(37, 64, generator=g))
    q, s, dense = w.q.clone(), w.scales.clone(), w.dequantize()
    w.pack()
    assert w.packed is not None and w._q is None
    assert w.shape == (37, 64) and torch.equal(w.q, q) and torch.equal(w.scales, s)  # unpacked on demand
    ids = torch.tensor([36, 0, 17, 16, 15])
    assert torch.equal(w.dequantize(ids), dense[ids]) and torch.equal(w.embedding(ids), dense[ids])
    assert torch.equal(w.dequantize(slice(3, 20)), dense[3:20]) and torch.equal(w.dequantize(), dense)
    w.load(slice(0, 2), torch.zeros(2, 64))  # loading after packing goes back to row-major
    assert w.packed is None and not w.q[:2].any() and torch.equal(w.q[2:], q[2:])
    # a row-major weight runs the weight-only kernel: float activations, the dequantized product
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(int8_linear(x, w), F.linear(x, w.dequantize()), atol=1e-4, rtol=1e-4)


def test_w8a8_model_computes_its_float_twin_and_speculates(tiny_dir, tmp_path):
    assert check_quantization("w8a8") == "w8a8"
    path, _ = tiny_dir("llama", False, seed=0, scale=3.0)
    twin = int8_twin_dir(path, tmp_path)
    tokens = [list(range(3, 30)), list(range(40, 45))]
    lm = load_model(str(path), quantization="w8a8")
    from specinfer.platform import resolve_platform

    resolve_platform("cpu").prepare_model(lm.model)
    assert lm.model.layers[0].qkv_weight.packed is not None  # packed by the CPU platform
    got, ref = two_run_logits(lm, tokens), two_run_logits(load_model(str(twin)), tokens)
    assert (got - ref).norm() / ref.norm() < 0.05  # 0.028 measured (random weights x 3: large activations)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    prompts = [p + p[:6] + p for p in prompts]
    gen = Generator(str(path), max_model_len=256, quantization="w8a8", block_size=4,
                    speculative={"method": "ngram", "num_speculative_tokens": 3})
    outs = gen.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert all(len(o.token_ids) == 16 for o in outs) and gen.spec_metrics()["num_accepted_tokens"] > 0


def test_w8a8_greedy_speculation_equals_no_speculation(tiny_dir):
    """W8A8 rounds every GEMM input to a grid, so float noise between a decode and a verification
    run would change tokens; the model runner puts the attention kernel in batch-invariant mode
    (rust/kernels: one path per query row, AVX-512 with head_dim 32/64/128) and the int8 GEMMs
    are row-independent, so speculative greedy output equals non-speculative output bit for bit."""
    # head_dim 32; 6 layers of large activations: without the invariant mode 3 of these 8
    # sequences drift from the non-speculative ones (measured), with it none
    path, _ = tiny_dir("llama", False, seed=2, hidden=128, heads=4, kv_heads=2, layers=6, scale=4.0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 23, 31, 12, 50)]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    base = Generator(str(path), max_model_len=256, quantization="w8a8")
    assert base.engine.runner.backend.batch_invariant
    assert not Generator(str(path), max_model_len=256, quantization="int8").engine.runner.backend.batch_invariant
    want = [o.token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
                 {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, "policy": "fixed"}):
        gen = Generator(str(path), max_model_len=256, quantization="w8a8", block_size=4, speculative=spec,
                        max_num_batched_tokens=32)
        assert [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)] == want, spec["method"]
        m = gen.spec_metrics()  # verification runs happened (the draft model, the target itself, accepts)
        assert m["num_draft_tokens"] > 0 and (spec["method"] == "ngram" or m["num_accepted_tokens"] > 0)
