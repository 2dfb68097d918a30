"""GGUF dequantization through the Rust kernel (specinfer.loader.gguf_dequant) equals the `gguf`
package's numpy dequantizers bit for bit, for every block format the kernel reads, at row counts
and widths that split over threads; other types fall back to gguf's; bad sizes are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from specinfer.loader.gguf_dequant import dequantize

# byte offsets of each block's f16 fields (random bytes there could be inf / NaN)
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(kind, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, row bytes]: random quants with finite, realistic f16 scales."""
    per, nbytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        scale = (rng.standard_normal((rows, cols // per)) * 0.02).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(F16_FIELDS), ids=lambda k: k.name)
@pytest.mark.parametrize("rows,cols", [(1, 256), (3, 512), (67, 768)])
def test_block_formats_equal_gguf_bit_for_bit(kind, rows, cols):
    rng = np.random.default_rng(int(kind) * 1000 + rows)
    data = random_blocks(kind, rows, cols, rng)
    want = gguf_dequantize(data, kind).reshape(rows, cols)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got = dequantize(data, int(kind), (rows, cols))
        finally:
            torch.set_num_threads(1)
        assert got.dtype == np.float32 and got.shape == (rows, cols)
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("kind,dtype", [(T.F32, np.float32), (T.F16, np.float16)])
def test_float_tensors_and_vectors(kind, dtype):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((5, 33)).astype(dtype)
    np.testing.assert_array_equal(dequantize(data, int(kind), (5, 33)), data.astype(np.float32))
    vec = rng.standard_normal(7).astype(dtype)  # a norm weight: one dimension
    np.testing.assert_array_equal(dequantize(vec, int(kind), (7,)), vec.astype(np.float32))


def test_bf16_is_the_upper_half_of_f32():
    x = torch.randn(4, 64).to(torch.bfloat16)
    raw = x.view(torch.int16).numpy().view(np.uint8).reshape(4, 128)
    np.testing.assert_array_equal(dequantize(raw, int(T.BF16), (4, 64)), x.float().numpy())


def test_other_types_fall_back_to_gguf():
    rng = np.random.default_rng(1)
    per, nbytes = GGML_QUANT_SIZES[T.Q2_K]
    data = rng.integers(0, 256, size=(2, nbytes), dtype=np.uint8)
    data[:, -4:] = np.array([0.01, 0.002], np.float16).view(np.uint8)  # d, dmin end a Q2_K block
    want = gguf_dequantize(data, T.Q2_K).reshape(2, per)
    np.testing.assert_array_equal(dequantize(data, int(T.Q2_K), (2, per)), want)


def test_wrong_sizes_are_refused():
    data = random_blocks(T.Q8_0, 2, 64, np.random.default_rng(2))
    with pytest.raises(ValueError, match="bytes of data"):
        dequantize(data[:, :-1], int(T.Q8_0), (2, 64))  # truncated
    with pytest.raises(ValueError, match="whole number"):
        dequantize(data, int(T.Q8_0), (4, 33))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_loads_dequantize_straight_into_the_parameters(tmp_path, monkeypatch, arch):
    """Every tensor but llama's row-permuted q/k is written in place (no temporary, no copy);
    the loaded model still equals transformers (test_gguf.py checks the values)."""
    import specinfer.loader.gguf_dequant as gd
    from gguf_writer import write_synthetic_gguf

    from specinfer.loader import load_model

    path = str(tmp_path / f"tiny-{arch}.gguf")
    hf = write_synthetic_gguf(path, arch)
    via_temp, in_place = [], []
    temp, into = gd.dequantize, gd.dequantize_into
    monkeypatch.setattr(gd, "dequantize", lambda data, kind, shape: via_temp.append(shape) or temp(data, kind, shape))
    monkeypatch.setattr(gd, "dequantize_into", lambda data, kind, out: in_place.append(out.shape) or into(data, kind, out))
    lm = load_model(path)
    layers = hf.config.num_hidden_layers
    assert len(via_temp) == (2 * layers if arch == "llama" else 0)
    assert len(in_place) > 5 * layers
    torch.testing.assert_close(lm.model.layers[0].gate_up_weight[: hf.config.intermediate_size],
                               hf.model.layers[0].mlp.gate_proj.weight, atol=0, rtol=0)
