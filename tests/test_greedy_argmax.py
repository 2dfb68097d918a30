"""argmax_last (numpy's argmax or x.max(-1).indices, both faster on CPU) picks the same index as
torch.argmax: the first maximum, with ties anywhere in the row, NaN (the maximum, as torch has it)
and non-contiguous rows, in every float dtype the samplers see."""
from __future__ import annotations

import pytest
import torch

from specinfer.sample.argmax import argmax_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(5))
def test_ties_resolve_to_the_first_maximum_like_argmax(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (64, 49152), generator=g).to(dtype)  # many ties per row
    x[3] = 0  # a row of equal values
    x[5, -1] = 10  # the maximum in the last column
    x[7, :] = float("-inf")
    x[7, 1000] = x[7, 2000] = 1.0
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    assert argmax_last(x)[3] == 0 and argmax_last(x)[5] == 49151 and argmax_last(x)[7] == 1000


def test_any_leading_shape_and_a_single_row():
    x = torch.randn(2, 3, 17)
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    assert argmax_last(torch.tensor([1.0, 3.0, 3.0])).item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_and_strided_rows_like_argmax(dtype):
    x = torch.randn(6, 1000).to(dtype)
    x[1, 500] = float("nan")  # NaN wins, as in torch
    x[2, 10] = x[2, 20] = float("nan")
    x[4] = float("inf")
    for view in (x, x[:, ::3], x.t().contiguous().t(), x[::2]):
        assert torch.equal(argmax_last(view), view.argmax(dim=-1))
        assert argmax_last(view).dtype == torch.int64


def test_a_zero_row_batch():
    assert argmax_last(torch.zeros(0, 7)).shape == (0,)
