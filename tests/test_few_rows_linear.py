"""The few-rows dense linear kernel (models/few_rows_linear.py) computes F.linear, and the CPU
platform serves float32 models through it."""
import pytest
import torch

from specinfer.models.few_rows_linear import GEMM_ENV, few_rows_linear, kernel_preferred
from specinfer.platform import resolve_platform


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 40])
def test_matches_f_linear(dtype, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(70, 96).to(dtype), torch.randn(70).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = few_rows_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 70)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the result
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(few_rows_linear(x.view(1, rows, 96), w).squeeze(0),
                               few_rows_linear(x, w), atol=0, rtol=0)  # leading dims, no bias


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Decode (1 row) and verification (1 + k rows) see the same logits bit for bit."""
    torch.manual_seed(0)
    w, x = torch.randn(50, 64), torch.randn(40, 64)
    together = few_rows_linear(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(few_rows_linear(x[i:i + 1], w), together[i:i + 1])


def test_inputs_the_kernel_cannot_take_fall_back_to_f_linear():
    w = torch.randn(8, 40)  # 40 inputs: not a multiple of 16
    x = torch.randn(3, 40)
    assert torch.equal(few_rows_linear(x, w), torch.nn.functional.linear(x, w))
    w16 = torch.randn(8, 48, dtype=torch.float16)
    x16 = torch.randn(2, 48, dtype=torch.float16)
    assert torch.equal(few_rows_linear(x16, w16), torch.nn.functional.linear(x16, w16))


def test_cpu_platform_serves_float32_through_the_kernel_when_asked(tiny_dir, monkeypatch):
    from specinfer.loader import load_model

    path, _ = tiny_dir("llama", False)
    default = load_model(path)
    resolve_platform("cpu").prepare_model(default.model)
    assert default.model.layers[0].linear is not few_rows_linear  # oneDNN-packed by default
    monkeypatch.setenv(GEMM_ENV, "few_rows")
    asked = load_model(path)
    resolve_platform("cpu").prepare_model(asked.model)
    layer = asked.model.layers[0]
    if kernel_preferred(torch.float32):
        assert layer.linear is few_rows_linear and not getattr(layer.qkv_weight, "is_mkldnn", False)
        assert asked.model.linear is few_rows_linear
    else:  # no AVX2 / AVX-512: oneDNN packing as before
        assert layer.linear is not few_rows_linear


def test_greedy_speculation_is_exact_with_the_kernel(tiny_dir, monkeypatch):
    """Every row count through one arithmetic: n-gram speculation (1 + k rows, mixed batches)
    gives the target-alone greedy output token for token."""
    from specinfer import Generator, SamplingParams

    monkeypatch.setenv(GEMM_ENV, "few_rows")
    path, _ = tiny_dir("llama", False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(10, 40)), [3, 4] * 9]
    alone = Generator(str(path), max_model_len=128).generate(prompts, greedy, use_tqdm=False)
    spec = Generator(str(path), max_model_len=128, speculative={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "policy": "fixed"})
    outs = spec.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert spec.spec_metrics()["num_draft_tokens"] > 0
