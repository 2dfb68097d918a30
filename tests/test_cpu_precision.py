"""Lower-precision weights on CPU: the int8 kernel equals a float linear over the dequantized
weights; GGUF Q8_0 tensors load as stored (no float copy); an int8 model generates exactly what
its dequantized float32 twin generates, speculative or not; bf16 runs end to end (oneDNN packing,
bf16 KV cache, cpu_native attention) and computes the float32 model within bf16 rounding."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gguf

from specinfer import Generator, SamplingParams
from specinfer.attention import get_backend
from specinfer.loader import load_model
from specinfer.models.int8_linear import Int8Weight, QuantizedTensor, int8_linear, quantize_rows
from specinfer.platform import resolve_platform

from gguf_writer import write_synthetic_gguf
from runner_harness import int8_twin_dir, two_run_logits


@pytest.mark.parametrize("M", [1, 3, 8, 17, 40])  # 40: past KERNEL_MAX_ROWS, the dequantized GEMM
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_linear_over_dequantized_weights(M, bias):
    g = torch.Generator().manual_seed(M)
    w = Int8Weight(40, 96)
    w.load(None, torch.randn(40, 96, generator=g))
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(M, 96, generator=g)
    want = F.linear(x, w.dequantize(), b)
    torch.testing.assert_close(int8_linear(x, w, b), want, atol=1e-4, rtol=1e-4)
    # bf16 activations: computed in float32, returned in bf16
    out = int8_linear(x.bfloat16(), w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.bfloat16().float(), w.dequantize(), b), atol=3e-2, rtol=2e-2)


def test_quantize_rows_follows_q8_0_and_loads_row_slices():
    x = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    ours = quantize_rows(torch.from_numpy(x))
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    from specinfer.loader.gguf_weights import q8_0_blocks

    theirs = q8_0_blocks(raw, (6, 64))
    assert torch.equal(ours.q, theirs.q)
    torch.testing.assert_close(ours.scales, theirs.scales, rtol=1e-3, atol=0)  # theirs went through float16
    w = Int8Weight(10, 64)
    w.load(slice(2, 8), theirs)  # a QuantizedTensor is copied as is into the row slice
    assert torch.equal(w.q[2:8], theirs.q) and torch.equal(w.scales[2:8], theirs.scales)
    assert not w.q[:2].any() and not w.q[8:].any()
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(w.dequantize()[2:8], torch.from_numpy(deq))  # bit for bit llama.cpp's values
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Weight(4, 48)


def test_gguf_q8_0_tensors_stay_int8(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_synthetic_gguf(path, "llama")  # layer 0's ffn_up is Q8_0, the rest F32/F16
    dense = load_model(path)
    lm = load_model(path, quantization="int8")
    layer, inter = lm.model.layers[0], lm.config.intermediate_size
    assert isinstance(layer.gate_up_weight, Int8Weight) and layer.gate_up_weight.q.dtype == torch.int8
    # the Q8_0 rows are exactly the file's values (dequantizing them gives the float loader's tensor)
    assert torch.equal(layer.gate_up_weight.dequantize()[inter:], dense.model.layers[0].gate_up_weight[inter:])
    assert lm.model.weight_bytes() < 0.35 * dense.model.weight_bytes()
    # the model computes what the float one does, within int8 rounding of the non-Q8_0 weights
    tokens = [list(range(3, 30)), list(range(40, 45))]
    got, want = two_run_logits(lm, tokens), two_run_logits(dense, tokens)
    assert (got - want).norm() / want.norm() < 0.05


def test_int8_generation_equals_its_float_twin(tiny_dir, tmp_path):
    path, _ = tiny_dir("llama", False, seed=0, scale=3.0)
    twin = int8_twin_dir(path, tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    prompts = [p + p[:6] + p for p in prompts]  # repeats: n-gram drafts get accepted
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [o.token_ids for o in Generator(str(twin), max_model_len=256).generate(prompts, params, use_tqdm=False)]
    int8 = Generator(str(path), max_model_len=256, quantization="int8")
    assert int8.engine.loaded.model.quantization == "int8"
    assert [o.token_ids for o in int8.generate(prompts, params, use_tqdm=False)] == want
    spec = Generator(str(path), max_model_len=256, quantization="int8", block_size=4,
                     speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.spec_metrics()["num_accepted_tokens"] > 0


def test_bfloat16_end_to_end(tiny_dir):
    path, _ = tiny_dir("llama", False)
    tokens = [list(range(3, 40)), list(range(50, 55))]
    ref = two_run_logits(load_model(path), tokens)
    lm = load_model(path, dtype=torch.bfloat16)
    resolve_platform("cpu").prepare_model(lm.model)
    from specinfer.models.packed_linear import packing_supported

    # oneDNN packs bf16 GEMM weights too where the CPU has its bf16 path (AVX-512 BW/VL/DQ)
    assert lm.model.packed == packing_supported(torch.bfloat16)
    m = lm.model
    from specinfer.attention.batch_metadata import attention_metadata_for_runs
    from specinfer.models.model_runner import ModelRunner

    caches = [torch.zeros(m.kv_cache_shape(8, 16), dtype=torch.bfloat16) for _ in range(m.num_layers)]
    runner = ModelRunner(m, caches, get_backend("cpu_native"))
    rows = np.arange(8, dtype=np.int32).reshape(2, 4)
    attn, pos = attention_metadata_for_runs(rows, np.array([0, 0]), np.array([37, 5]), 16, torch.device("cpu"))
    hidden, _ = runner.forward(torch.tensor(tokens[0] + tokens[1]), torch.from_numpy(pos), attn)
    got = runner.logits(hidden)
    assert (got - ref).norm() / ref.norm() < 0.03
    out = Generator(str(path), dtype="bfloat16", max_model_len=128).generate([tokens[0]], SamplingParams(
        max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    assert len(out.token_ids) == 8


def test_quantization_option_is_validated_and_reaches_the_cli():
    with pytest.raises(ValueError, match="quantization"):
        Generator("smollm2-135m", quantization="int4")
    from specinfer.cli import build_parser
    from specinfer.cli.options import engine_config

    args = build_parser().parse_args(["generate", "smollm2-135m", "--prompt", "hi", "--quantization", "int8"])
    assert engine_config(args, None).model.quantization == "int8"
    args = build_parser().parse_args(["generate", "smollm2-135m", "--prompt", "hi"])
    assert engine_config(args, None).model.quantization == "auto"  # a .gguf model on CPU: as stored
    args = build_parser().parse_args(["generate", "smollm2-135m", "--prompt", "hi", "--quantization", "none"])
    assert engine_config(args, None).model.quantization is None
    args = build_parser().parse_args(["generate", "smollm2-135m", "--prompt", "hi", "--quantization", "gguf"])
    assert engine_config(args, None).model.quantization == "gguf"
