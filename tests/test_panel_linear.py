"""The panel kernel (models/panel_linear.py) computes F.linear with one arithmetic for every row
count: a row's output is the same bits alone or among any other rows; batch_invariant=True serves
every float GEMM through it."""
import pytest
import torch

from specinfer.models.panel_linear import PanelWeight, panel_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(49, 33), (64, 96), (5, 7)])
def test_matches_f_linear_and_round_trips(dtype, n, k):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(3, 7, k, generator=g).to(dtype)
    pw = PanelWeight(w)
    assert torch.equal(pw.to_dense(), w) and pw.shape == (n, k)
    got = panel_linear(x, pw, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert got.dtype == dtype and got.shape == (3, 7, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * k ** 0.5, rtol=tol)
    torch.testing.assert_close(panel_linear(x, pw), panel_linear(x, pw, torch.zeros(n, dtype=dtype)),
                               atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_batch(dtype):
    g = torch.Generator().manual_seed(0)
    w = PanelWeight(torch.randn(200, 575, generator=g).to(dtype))
    x = torch.randn(70, 575, generator=g).to(dtype)
    together = panel_linear(x, w)
    for start, rows in [(0, 1), (3, 5), (10, 9), (20, 50)]:
        assert torch.equal(panel_linear(x[start:start + rows], w), together[start:start + rows])


def test_bf16_rounds_the_activations_and_sums_in_f32():
    # the bf16 form computes with x rounded to bf16 and an f32 chain (no bf16 rounding inside)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 161, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 161, generator=g)
    got = panel_linear(x, PanelWeight(w))
    want = torch.nn.functional.linear(x.to(torch.bfloat16).double(), w.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bf16_activations_give_the_f32_result_rounded_once():
    # bf16 x and out go through the kernel as bf16 (no f32 copies): the same bits as the f32 call
    g = torch.Generator().manual_seed(4)
    w = PanelWeight(torch.randn(130, 97, generator=g).to(torch.bfloat16))
    b = torch.randn(130, generator=g).to(torch.bfloat16)
    x = torch.randn(6, 97, generator=g).to(torch.bfloat16)
    got = panel_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, panel_linear(x.float(), w, b).to(torch.bfloat16))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32/bfloat16"):
        PanelWeight(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="features"):
        panel_linear(torch.zeros(2, 5), PanelWeight(torch.zeros(3, 4)))
    with pytest.raises(ValueError, match="bias shape"):
        panel_linear(torch.zeros(2, 4), PanelWeight(torch.zeros(3, 4)), torch.zeros(2))


def test_batch_invariant_engine_runs_every_gemm_through_the_panel_kernel(tiny_dir):
    from specinfer import Generator

    path, _ = tiny_dir("llama")
    gen = Generator(str(path), batch_invariant=True, max_model_len=64)
    model = gen.engine.loaded.model
    assert model.linear is panel_linear and isinstance(model.lm_head, PanelWeight)
    for layer in model.layers:
        assert layer.linear is panel_linear and isinstance(layer.gate_up_weight, PanelWeight)
    assert model.weight_bytes() > 0
