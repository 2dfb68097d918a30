"""GGUF models run as stored (quantization="gguf", the default for a .gguf file on CPU): every
GEMM weight and the embedding stay in the file's block types (views of its memory map, llama
Q/K rows reordered), the model computes its dequantized float32 twin within activation
rounding, and greedy speculative output equals plain output for every proposer, through
chunked prefill, mixed steps and preemption. The real SmolLM2 pack (Q4_1 + Q8_0) runs stored
too: its weights take the file's bytes, not 5x them."""
import os

import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.loader.model_loading import resolve_quantization
from specinfer.loader import load_model
from specinfer.models.gguf_linear import GgufWeight

import head_checkpoints as heads
from gguf_writer import write_gguf
from runner_harness import two_run_logits
from spec_cases import SETTINGS, check_greedy_exact, reference

TYPES = ("q4_0", "q5_1", "q8_0", "q4_1", "q5_0")  # round-robin over the GEMM tensors and the embedding


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(HF dir, its GGUF with block-quantized GEMM weights): a llama (permuted Q/K rows), untied."""
    from tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("gguf_stored")
    build_tiny_model(d / "hf", "llama", layers=3, hidden=64, scale=2.0)
    path = d / "model.gguf"
    write_gguf(d / "hf", path, gemm_types=TYPES)
    return d / "hf", path


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory):
    """A Qwen2 (q/k/v biases, tied embeddings) with block-quantized weights: the draft model."""
    from tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("gguf_stored_qwen")
    build_tiny_model(d / "hf", "qwen2", layers=2, hidden=64, tied=True, seed=3)
    path = d / "draft.gguf"
    write_gguf(d / "hf", path, gemm_types=("q8_0", "q4_1"))
    return d / "hf", path


def test_gguf_files_default_to_stored_weights_on_cpu(tiny_gguf):
    hf, path = tiny_gguf
    assert resolve_quantization("auto", str(path), "cpu") == "gguf"
    assert resolve_quantization("auto", str(path), "cpu", dtype="float32") is None  # a dtype asked: dequantized
    assert resolve_quantization("auto", str(path), "cpu", tensor_parallel_size=2) is None
    assert resolve_quantization("auto", str(hf), "cpu") is None
    assert resolve_quantization(None, str(path), "cpu") is None
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_quantization("gguf", str(hf), "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf", str(path), "cuda")
    gen = Generator(str(path), max_model_len=128)
    assert gen.engine.quantization == "gguf" and gen.engine.runner.backend.batch_invariant
    layer = gen.engine.loaded.model.layers[0]
    assert isinstance(layer.qkv_weight, GgufWeight) and len(layer.qkv_weight.parts) == 3  # q | k | v as stored
    assert set(layer.qkv_weight.type_names) <= {t.upper() for t in TYPES}
    model = gen.engine.loaded.model
    assert isinstance(model.embed_tokens, GgufWeight)
    # an untied table is only looked up: no kernel-layout copy of it (the LM head has its own)
    assert not model.embed_tokens.for_gemm and model.lm_head.for_gemm
    assert Generator(str(path), max_model_len=128, quantization=None).engine.quantization is None


def test_stored_model_computes_its_dequantized_twin(tiny_gguf):
    _, path = tiny_gguf
    stored, dense = load_model(str(path), quantization="gguf"), load_model(str(path))
    m = stored.model
    # weights: the file's bytes (views of its map), except llama's Q and K rows (reordered copies)
    from specinfer.loader.gguf_file import GGUFFile

    f = GGUFFile(str(path))
    gemm = sum(t.data.nbytes for t in f.tensors if len(t.shape) == 2)
    assert m.weight_bytes() < gemm + 4 * sum(t.data.nbytes for t in f.tensors if len(t.shape) == 1) + 1
    v = m.layers[1].qkv_weight.parts[2][1]  # the v rows: not permuted, so a view of the file
    assert not v.data.flags.owndata
    tokens = [list(range(3, 30)), list(range(40, 45))]
    got, ref = two_run_logits(stored, tokens), two_run_logits(dense, tokens)
    # activations rounded to 8 bits per block, through 3 layers of large random activations:
    # 0.069 measured (w8a8 of the same file 0.061; an all-Q8_0 file gives w8a8's 0.0287 to 7 digits)
    assert (got - ref).norm() / ref.norm() < 0.1


SPECS = {
    "ngram": lambda hf, draft: {"method": "ngram", "num_speculative_tokens": 3},
    "suffix": lambda hf, draft: {"method": "suffix", "num_speculative_tokens": 4,
                                 "suffix_decoding_min_token_prob": 0.0},
    "draft_model": lambda hf, draft: {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    "self_draft": lambda hf, draft: {"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 1},
    "mlp_speculator": lambda hf, draft: {"method": "mlp_speculator", "num_speculative_tokens": 3,
                                         "model": str(heads.mlp_speculator(hf.parent / "mlp", hf, n_predict=3))},
    "medusa": lambda hf, draft: {"method": "medusa", "num_speculative_tokens": 3,
                                 "model": str(heads.medusa_vllm(hf.parent / "medusa", hf, num_heads=3))},
    "eagle": lambda hf, draft: {"method": "eagle", "num_speculative_tokens": 3,
                                "model": str(heads.eagle1(hf.parent / "eagle", hf))},
    "eagle3": lambda hf, draft: {"method": "eagle3", "num_speculative_tokens": 3,
                                 "model": str(heads.eagle3(hf.parent / "eagle3", hf))},
}


@pytest.fixture(scope="module")
def stored_ref(tiny_gguf):
    _, path = tiny_gguf
    return reference(path, n=16)


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_speculation_on_stored_weights_equals_plain(tiny_gguf, qwen_gguf, stored_ref, method):
    hf, path = tiny_gguf
    if method == "draft_model":  # a draft sharing the target's vocabulary: the target's own file
        spec = SPECS[method](hf, path)
    else:
        spec = SPECS[method](hf, qwen_gguf[1])
    tot = check_greedy_exact(path, spec, stored_ref, settings=SETTINGS[:2])
    assert tot["num_draft_tokens"] > 0


def test_a_tied_table_is_held_for_the_gemm(qwen_gguf):
    """Tied embeddings are the LM head too: the table is held in the kernels' layout."""
    model = Generator(str(qwen_gguf[1]), max_model_len=64).engine.loaded.model
    assert model.lm_head is model.embed_tokens and model.embed_tokens.for_gemm


def test_a_stored_draft_model_with_its_own_file(qwen_gguf):
    """A Qwen2 GGUF target drafting with a different stored GGUF of its family and vocabulary."""
    hf, path = qwen_gguf
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ps = [list(range(5, 25)), [7, 8, 9] * 5]
    want = [o.token_ids for o in Generator(str(path), max_model_len=128).generate(ps, params, use_tqdm=False)]
    gen = Generator(str(path), max_model_len=128,
                    speculative={"method": "draft_model", "model": str(path), "num_speculative_tokens": 4,
                                 "policy": "fixed"})
    assert gen.engine.proposer.loaded.model.quantization == "gguf"  # the draft's file as stored too
    assert [o.token_ids for o in gen.generate(ps, params, use_tqdm=False)] == want
    assert gen.spec_metrics()["num_accepted_tokens"] > 0


def test_the_smollm2_pack_runs_as_stored():
    from specinfer.packs import resolve_pack

    path = str(resolve_pack("smollm2-135m"))
    gen = Generator(path, max_model_len=256)
    m = gen.engine.loaded.model
    assert gen.engine.quantization == "gguf"
    types = {t for layer in m.layers for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                                               layer.down_weight) for t in w.type_names}
    assert types == {"Q4_1"} and m.embed_tokens.type_names == ["Q8_0"]
    assert m.weight_bytes() < os.path.getsize(path)  # 98 MB as stored, not 540 MB of float32
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" \
             "def fibonacci_list(n):\n"
    plain = gen.generate([prompt], params, use_tqdm=False)[0]
    spec = Generator(path, max_model_len=256, speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                          "policy": "fixed"})
    out = spec.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == plain.token_ids and spec.spec_metrics()["num_accepted_tokens"] > 0
    assert "fibonacci" in plain.text  # coherent code, not noise


def test_moe_experts_run_as_stored(tmp_path):
    """Qwen3-MoE: each expert's gate | up | down rows are views of the stacked tensors as stored."""
    from tiny_models import build_tiny_model

    build_tiny_model(tmp_path / "hf", "qwen3_moe", layers=1)
    path = tmp_path / "moe.gguf"
    write_gguf(tmp_path / "hf", path, gemm_types=("q8_0", "q4_0"))
    stored, dense = load_model(str(path), quantization="gguf"), load_model(str(path))
    moe = stored.model.layers[0].moe
    assert isinstance(moe.gate_up[0], GgufWeight) and moe.gate_up[0].type_names == ["Q8_0", "Q4_0"]
    tokens = [list(range(3, 30)), list(range(40, 45))]
    got, ref = two_run_logits(stored, tokens), two_run_logits(dense, tokens)
    assert (got - ref).norm() / ref.norm() < 0.05  # 0.016 measured
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ps = [list(range(5, 25)), [7, 8, 9] * 5]
    want = [o.token_ids for o in Generator(str(path), max_model_len=128).generate(ps, params, use_tqdm=False)]
    gen = Generator(str(path), max_model_len=128, block_size=4,
                    speculative={"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"})
    assert [o.token_ids for o in gen.generate(ps, params, use_tqdm=False)] == want
