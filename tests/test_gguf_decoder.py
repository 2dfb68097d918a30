"""The fused GGUF decoder layers (models/gguf_decoder.py: one Rust call per forward) give the very
bits of the unfused layers — hidden states, KV caches, logprobs, speculative output — on llama
(permuted Q/K, untied) and Qwen2 (q/k/v biases, tied) files of several block types, over prefill
chunks of two sequences and then decodes; where a layer has a feature they do not cover, the
model keeps the unfused layers. Their MLP activation (`silu_mul`, Rust) is silu(gate) * up to
float32 rounding, and the unfused layers of a GGUF model use it too."""
import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer._core import GgufDecoder
from specinfer.attention import get_backend
from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.loader import load_model
from specinfer.models.gguf_decoder import build_decoder, silu_mul
from specinfer.models.model_runner import ModelRunner

from gguf_writer import write_gguf


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_file(request, tmp_path_factory):
    from tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp(f"gguf_decoder_{request.param}")
    build_tiny_model(d / "hf", request.param, layers=3, hidden=64, tied=request.param == "qwen2", scale=2.0)
    path = d / "model.gguf"
    write_gguf(d / "hf", path, gemm_types=("q4_0", "q5_1", "q8_0", "q4_1", "q5_0"))
    return path


def _forwards(model, fused: bool):
    """Hidden states of a prefill of two sequences (5 and 3 tokens) then a decode of each, and the
    caches after: through the fused layers or the unfused ones."""
    model._gguf_decoder = None if fused else False  # None: built at the next forward
    model.batch_invariant = True  # as the CPU platform prepares a gguf model
    caches = [torch.zeros(model.kv_cache_shape(8, 16)) for _ in range(model.num_layers)]
    backend = get_backend("cpu_native")
    runner = ModelRunner(model, caches, backend)
    assert backend.batch_invariant  # gguf models: the attention's batch-invariant mode
    rows = np.arange(8, dtype=np.int32).reshape(2, 4)
    g = torch.Generator().manual_seed(0)
    outs = []
    for starts, lens in (([0, 0], [5, 3]), ([5, 3], [1, 1])):
        attn, pos = attention_metadata_for_runs(rows, np.array(starts), np.array(lens), 16, torch.device("cpu"))
        ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=g)
        hidden, _ = runner.forward(ids, torch.from_numpy(pos), attn)
        outs.append(runner.logits(hidden))
    return outs, caches


def test_fused_layers_give_the_unfused_bits(gguf_file):
    model = load_model(str(gguf_file), quantization="gguf").model
    unfused, caches0 = _forwards(model, fused=False)
    fused, caches1 = _forwards(model, fused=True)
    assert isinstance(model._gguf_decoder, GgufDecoder) and model._gguf_decoder.num_layers == model.num_layers
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)
    for a, b in zip(caches1, caches0):
        assert torch.equal(a, b)
    assert fused[0].abs().sum() > 0


def test_engines_with_and_without_the_fused_layers_agree_bit_for_bit(gguf_file, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [[5, 9, 14, 9, 14, 9], [7, 3, 3, 7, 3, 3, 7, 3], [11]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}

    import specinfer.models.llama as llama

    taken = []
    real = llama.fused_forward
    monkeypatch.setattr(llama, "fused_forward", lambda *a: taken.append(real(*a)) or taken[-1])

    def run():
        with Generator(str(gguf_file), max_model_len=96, max_num_batched_tokens=8, speculative=spec) as gen:
            outs = gen.generate(prompts, params, use_tqdm=False)
            return gen.engine.loaded.model._gguf_decoder, [(o.token_ids, o.logprobs) for o in outs]

    decoder, fused = run()
    assert taken and all(taken)  # every forward of the engine took the fused layers
    monkeypatch.setenv("SPECINFER_GGUF_FUSED", "0")
    off, unfused = run()
    assert isinstance(decoder, GgufDecoder) and off is False
    assert fused == unfused


def test_layers_the_fused_path_does_not_cover_stay_unfused(gguf_file):
    model = load_model(str(gguf_file), quantization="gguf").model
    assert isinstance(build_decoder(model), GgufDecoder)
    model.layers[1].window = 4  # a sliding layer
    assert build_decoder(model) is None
    model.layers[1].window = None
    assert build_decoder(load_model(str(gguf_file)).model) is None  # dequantized: the dense layers


def test_silu_mul_is_silu_times_up_and_the_unfused_gguf_layers_use_it(gguf_file, monkeypatch):
    g = torch.Generator().manual_seed(1)
    for t, inter in ((1, 1536), (5, 37), (0, 8)):
        gate_up = torch.randn(t, 2 * inter, generator=g) * 6
        want = torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
        got = silu_mul(gate_up)
        assert got.shape == (t, inter) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)
    model = load_model(str(gguf_file), quantization="gguf").model
    assert all(layer.gguf_silu for layer in model.layers)
    assert not any(layer.gguf_silu for layer in load_model(str(gguf_file)).model.layers)  # dequantized: torch's
    import specinfer.models.llama as llama

    calls = []
    monkeypatch.setattr(llama, "silu_mul", lambda gu: calls.append(gu.shape) or silu_mul(gu))
    _forwards(model, fused=False)
    assert len(calls) == 2 * model.num_layers  # the prefill and the decode, every layer


def test_the_fused_forward_refuses_a_wrong_number_of_caches(gguf_file):
    model = load_model(str(gguf_file), quantization="gguf").model
    decoder = build_decoder(model)
    x = torch.zeros(1, model.config.hidden_size)
    cos = torch.ones(1, model.layers[0].head_dim)
    attn, _ = attention_metadata_for_runs(np.zeros((1, 1), np.int32), np.array([0]), np.array([1]), 16,
                                          torch.device("cpu"))
    prepared = get_backend("cpu_native").prepare(attn)
    with pytest.raises(ValueError, match="cache pointers"):
        decoder.forward(x.data_ptr(), 1, cos.data_ptr(), cos.data_ptr(), prepared.batch, [1], 1, 16, 1)
