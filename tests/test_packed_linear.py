"""CPU weight packing (oneDNN) computes the same model as the dense weights."""
import pytest
import torch

from specinfer.loader import load_model
from specinfer.models.packed_linear import mkldnn_packing_available, pack_weight, packed_linear
from specinfer.platform import resolve_platform

from runner_harness import two_run_logits


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_packed_model_matches_dense(tiny_dir, arch, tied):
    assert mkldnn_packing_available(), "this torch build lacks oneDNN linear packing"
    path, _ = tiny_dir(arch, tied)
    tokens = [list(range(3, 40)), list(range(50, 55))]
    dense = load_model(path)
    packed = load_model(path)
    resolve_platform("cpu").prepare_model(packed.model)
    assert packed.model.packed and not dense.model.packed
    torch.testing.assert_close(two_run_logits(packed, tokens), two_run_logits(dense, tokens), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="pack"):
        packed.model.load_weights([], source="x")


def test_packed_linear_contract():
    w, b = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(5, 16)
    torch.testing.assert_close(packed_linear(x, pack_weight(w), b), torch.nn.functional.linear(x, w, b),
                               atol=1e-5, rtol=1e-5)
