"""The gemma3-270m pack (a real Gemma 3 270M, llama.cpp's Q4_K_M GGUF; installed by
scripts/setup.sh): it loads, its SentencePiece tokenizer encodes as transformers' does, its greedy
output dequantized equals HF transformers' on the same weights (transformers dequantizes the same
file), and speculative decoding on it as stored (Q4_K / Q6_K / Q8_0 blocks, the default) changes
nothing."""
import os

import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.packs import resolve_pack

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time,  there   was\n\n a tiny", "Größe über 100 km², ça va? 日本語のテキスト 🙂"]
N = 24


@pytest.fixture(scope="module")
def pack():
    return str(resolve_pack("gemma3-270m"))


@pytest.fixture(scope="module")
def hf(pack):
    import transformers

    d, f = os.path.dirname(pack), os.path.basename(pack)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def gen(pack):  # dequantized, as transformers runs it
    return Generator(pack, max_model_len=512, quantization=None)


@pytest.fixture(scope="module")
def stored(pack):  # the default: the file's blocks as stored
    gen = Generator(pack, max_model_len=512)
    assert gen.engine.quantization == "gguf"
    types = {t for layer in gen.engine.loaded.model.layers for t in layer.down_weight.type_names}
    assert types <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} and types & {"Q4_K", "Q6_K"}
    return gen


def test_config_is_gemma3(gen):
    cfg = gen.engine.loaded.config
    assert cfg.architecture == "gemma3_text" and cfg.sliding_window == 512 and cfg.qk_norm
    assert [cfg.layer_window(i) is None for i in range(cfg.num_layers)].count(True) == 3  # layers 5, 11, 17
    assert cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.head_dim == 256


def test_tokenizer_encodes_as_transformers(gen, hf):
    tok, _ = hf
    for text in TEXTS:
        assert gen.engine.tokenizer.encode(text).ids == tok(text).input_ids, text


def test_greedy_equals_transformers(gen, hf):
    tok, model = hf
    for text in TEXTS[:2]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=N, do_sample=False)[0, ids.shape[1]:].tolist()
        got = gen.generate([ids[0].tolist()], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].token_ids
        assert got == want[:len(got)] and len(got) == N, text


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"},
                                  {"method": "layer_skip", "exit_layer": 12, "num_speculative_tokens": 3,
                                   "policy": "fixed"}])
def test_speculation_changes_nothing(pack, stored, spec):
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8,"]
    sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in stored.generate(prompts, sp, use_tqdm=False)]
    spec_gen = Generator(pack, max_model_len=512, speculative=spec)
    assert [o.token_ids for o in spec_gen.generate(prompts, sp, use_tqdm=False)] == want
    assert spec_gen.spec_metrics()["num_draft_tokens"] > 0
