"""The one-pass RMSNorm kernel equals torch's F.rms_norm: bf16 rows rounded once from the same
f32 expression (at most one bf16 ulp apart, from the order of the f32 sum), every thread count,
and inputs the kernel does not take fall back to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specinfer.models.rms_norm import rms_norm


@pytest.mark.parametrize("rows,dim,threads", [(1, 576, 1), (7, 64, 2), (300, 96, 2), (33, 17, 1)])
def test_bf16_kernel_equals_torch_within_one_ulp(rows, dim, threads):
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    w = torch.randn(dim, generator=g).bfloat16()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = rms_norm(x, (dim,), w, 1e-5)
    finally:
        torch.set_num_threads(old)
    want = F.rms_norm(x, (dim,), w, 1e-5)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3
    ref = (x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-5) * w.double())
    assert torch.allclose(got.double(), ref, rtol=1e-2, atol=1e-2)


def test_three_dimensional_input_and_grad_and_float32_fall_back_or_match():
    x = torch.randn(2, 5, 32).bfloat16()
    w = torch.randn(32).bfloat16()
    ulps = (rms_norm(x, (32,), w, 1e-6).view(torch.int16).int()
            - F.rms_norm(x, (32,), w, 1e-6).view(torch.int16).int()).abs()
    assert ulps.max() <= 1
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    y = rms_norm(xf, (32,), wf, 1e-6)  # float32 with autograd: torch's kernel, gradients flow
    y.sum().backward()
    assert xf.grad is not None and torch.equal(y, F.rms_norm(xf, (32,), wf, 1e-6))
    strided = torch.randn(32, 4).bfloat16().t()  # not contiguous: torch
    assert torch.equal(rms_norm(strided, (32,), w, 1e-6), F.rms_norm(strided, (32,), w, 1e-6))


def test_a_bad_dtype_reaching_the_kernel_is_a_value_error():
    from specinfer._core import rms_norm as kernel

    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="dtype"):
        kernel(x.data_ptr(), 2, 4, x.data_ptr(), 1e-5, x.data_ptr(), "float16", 1)


def test_float32_inference_takes_the_kernel_within_a_few_ulps_of_torch():
    """Float32 without autograd runs the one-pass kernel (torch's CPU rms_norm takes several
    passes): within a few float32 ulps of torch, across shapes and thread counts."""
    from unittest import mock

    import specinfer.models.rms_norm as mod

    g = torch.Generator().manual_seed(0)
    for rows, dim in ((1, 576), (16, 576), (300, 64), (7, 17)):
        x = torch.randn(rows, dim, generator=g) * 3
        w = torch.randn(dim, generator=g)
        with mock.patch.object(mod, "_torch_rms_norm", side_effect=AssertionError("torch path taken")):
            got = rms_norm(x, (dim,), w, 1e-5)
        want = F.rms_norm(x, (dim,), w, 1e-5)
        assert got.dtype == torch.float32
        assert torch.allclose(got, want, rtol=4e-6, atol=1e-6), (rows, dim, (got - want).abs().max())
