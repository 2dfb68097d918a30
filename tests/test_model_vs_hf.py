"""Our decoder, loaded from HF safetensors, equals HF transformers' logits, for every family.

Tiny random Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 / Mixtral / Qwen3-MoE /
Qwen2-MoE models (every family feature on: sliding windows shorter than the sequences,
soft-caps, LongRoPE, a shared expert, a dense layer among MoE layers) are built with transformers (the independent
reference), saved with save_pretrained, loaded with specinfer.loader, and run over a paged KV
cache (block_size 4, scattered block ids) as one prefill, chunked prefill + decodes,
1 + k verification runs with rollback, and mixed batches of several sequences.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import tokenizers
import torch

import transformers  # noqa: E402  the reference; a test extra (installed by scripts/setup.sh)

from specinfer.attention import AttentionMetadata, ForwardContext, get_backend  # noqa: E402
from specinfer.loader import load_model  # noqa: E402
from specinfer.models import LlamaForCausalLM, ModelConfig  # noqa: E402

VOCAB = 96
BLOCK_SIZE = 4
ATOL = 1e-4

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_tied_bias": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, attention_bias=True)),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral_headdim": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # the other families, every feature on, sliding windows (8) shorter than the sequences
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, use_sliding_window=True, sliding_window=8,
                                                             max_window_layers=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=1024, original_max_position_embeddings=256, pad_token_id=0, sliding_window=8,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}


def _tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok


def build_hf(kind: str, seed: int = 0):
    cfg_cls, model_cls, extra = VARIANTS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**_BASE, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # random everything, biases and norms included (HF inits those to 0/1)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    return model


def save_hf(model, directory, **kwargs) -> str:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    _tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": True, "bos_token": "w1", "eos_token": "w2",
                   "chat_template": "{{ messages[0]['content'] }}"}, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 5]}, f)
    return str(directory)


class PagedRunner:
    """Drives one model over a paged cache the way the engine does: runs of query tokens per sequence."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, seed: int = 0):
        self.model = model
        self.backend = get_backend("torch_ref")
        self.caches = [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE)) for _ in range(model.num_layers)]
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()  # scattered block ids
        self.tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def rollback(self, seq: int, num_computed: int) -> None:
        self.num_computed[seq] = num_computed  # rejected slots get overwritten by the next run

    @torch.inference_mode()
    def step(self, runs: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """runs: (sequence id, query token ids) -> per run float32[len, vocab] logits."""
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for seq, toks in runs:
            start = self.num_computed.get(seq, 0)
            end = start + len(toks)
            table = self.tables.setdefault(seq, [])
            while len(table) < math.ceil(end / BLOCK_SIZE):
                table.append(self.free.pop())
            ids += toks
            pos += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qsl.append(qsl[-1] + len(toks))
            lens.append(end)
            self.num_computed[seq] = end
        width = max(len(self.tables[s]) for s, _ in runs)
        bt = torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in runs], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt, block_size=BLOCK_SIZE,
            max_query_len=max(len(t) for _, t in runs), max_seq_len=max(lens))
        ctx = ForwardContext(self.backend, self.backend.prepare(meta), self.caches)
        hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), ctx)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), self.model.config.vocab_size)
        return list(logits.split([len(t) for _, t in runs]))


def _sequences(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (23, 9, 30)]


@torch.inference_mode()
def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    return hf(torch.tensor([seq])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    loaded = load_model(save_hf(hf, tmp_path_factory.mktemp(request.param)))
    refs = [_hf_logits(hf, s) for s in _sequences()]
    return request.param, hf, loaded, refs


def test_one_prefill(pair):
    _, _, loaded, refs = pair
    runner = PagedRunner(loaded.model)
    for i, seq in enumerate(_sequences()):
        (got,) = runner.step([(i, seq)])
        torch.testing.assert_close(got, refs[i], atol=ATOL, rtol=1e-4)


def test_chunked_prefill_then_decodes(pair):
    _, _, loaded, refs = pair
    runner = PagedRunner(loaded.model)
    for i, seq in enumerate(_sequences()):
        chunks = [seq[:5], seq[5:8]] + [[t] for t in seq[8:]]
        got, start = [], 0
        for chunk in chunks:
            got += runner.step([(i, chunk)])
        torch.testing.assert_close(torch.cat(got), refs[i], atol=ATOL, rtol=1e-4)


def test_verification_runs_with_rollback(pair):
    _, _, loaded, refs = pair
    runner = PagedRunner(loaded.model)
    seq, ref = _sequences()[2], refs[2]
    (first,) = runner.step([(0, seq[:6])])
    torch.testing.assert_close(first, ref[:6], atol=ATOL, rtol=1e-4)
    n, k = 6, 4
    while n < len(seq):
        # 1 + k tokens: the next true token, then drafts of which only the first two are right
        drafts = seq[n + 1 : n + 3] + [(t + 7) % VOCAB for t in seq[n + 3 : n + 1 + k]]
        run = [seq[n]] + drafts
        (got,) = runner.step([(0, run)])
        ok = min(3, len(run))  # rows whose whole prefix is true: the input token and two drafts
        torch.testing.assert_close(got[:ok], ref[n : n + ok], atol=ATOL, rtol=1e-4)
        n += ok
        runner.rollback(0, n)


def test_mixed_batch(pair):
    _, _, loaded, refs = pair
    a, b, c = _sequences()
    runner = PagedRunner(loaded.model)
    # step 1: first chunks of b and c
    out = runner.step([(1, b[:8]), (2, c[:10])])
    # step 2: a prefill chunk (a), a decode (b) and a 1 + 4 verification run (c) together
    out2 = runner.step([(0, a[:12]), (1, b[8:9]), (2, c[10:15])])
    # step 3: rest of a, nothing more for b, the rest of c
    out3 = runner.step([(2, c[15:]), (0, a[12:])])
    torch.testing.assert_close(torch.cat([out[0], out2[1]]), refs[1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(torch.cat([out[1], out2[2], out3[0]]), refs[2], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(torch.cat([out2[0], out3[1]]), refs[0], atol=ATOL, rtol=1e-4)


def test_loaded_metadata(pair):
    kind, hf, loaded, _ = pair
    cfg = loaded.config
    assert cfg.architecture == hf.config.model_type
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    assert (loaded.model.lm_head is loaded.model.embed_tokens) == cfg.tie_word_embeddings
    assert loaded.bos_token_id == 1 and loaded.eos_token_ids == (2, 5)
    assert loaded.add_bos_token and loaded.tokenizer.encode("w7 w9").ids == [1, 7, 9]
    assert loaded.chat_template == "{{ messages[0]['content'] }}"
    assert loaded.model.kv_cache_shape(10, 4) == (2, 10, 4, cfg.num_kv_heads, cfg.head_dim)


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = build_hf("qwen2", seed=3)
    single = load_model(save_hf(hf, tmp_path / "single"))
    sharded_dir = save_hf(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded_dir, "model.safetensors.index.json"))
    sharded = load_model(sharded_dir)
    for (n1, p1), (n2, p2) in zip(single.model.named_parameters(), sharded.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    seq = _sequences()[0]
    (got,) = PagedRunner(sharded.model).step([(0, seq)])
    torch.testing.assert_close(got, _hf_logits(hf, seq), atol=ATOL, rtol=1e-4)


def test_bf16_load_runs(tmp_path):
    hf = build_hf("llama", seed=4)
    lm = load_model(save_hf(hf, tmp_path / "m"), dtype=torch.bfloat16)
    assert lm.model.embed_tokens.dtype == torch.bfloat16
    model = lm.model
    runner = PagedRunner(model)
    runner.caches = [c.to(torch.bfloat16) for c in runner.caches]
    seq = _sequences()[0]
    (got,) = runner.step([(0, seq)])
    torch.testing.assert_close(got, _hf_logits(hf, seq), atol=0.1, rtol=0.05)


# ---- config and errors ----------------------------------------------------------------------------


def test_config_from_hf_dict_legacy_spelling():
    cfg = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0}, "eos_token_id": [3, 4]})
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfg.eos_token_ids == (3, 4)


@pytest.mark.parametrize("field,value,match", [
    ("num_kv_heads", 3, "multiple of num_kv_heads"),
    ("head_dim", 7, "head_dim must be even"),
    ("hidden_size", 0, "hidden_size must be a positive int"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "lacks"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type"),
    ("architecture", "gpt2", "unsupported architecture 'gpt2'"),
])
def test_config_validation(field, value, match):
    good = dict(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64)
    ModelConfig(**good)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**good, field: value})


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_unsupported_architecture_is_named(tmp_path):
    d = save_hf(build_hf("llama"), tmp_path / "m")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="gpt_neox.*GPTNeoXForCausalLM"):
        load_model(d)


def test_truncated_safetensors_is_named(tmp_path):
    d = save_hf(build_hf("llama"), tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(d)
    with open(path, "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(d)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    d = save_hf(build_hf("llama"), tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj"):
        load_model(d)


def test_config_is_hashable_and_frozen():
    cfg = ModelConfig.from_hf_config({**_BASE, "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    same = ModelConfig.from_hf_config({**_BASE, "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert cfg == same and hash(cfg) == hash(same) and len({cfg, same}) == 1
    with pytest.raises(AttributeError):
        cfg.num_layers = 3


def test_sliding_windows_per_layer_from_every_spelling():
    """Which layers slide: layer_types when given, else the family's rule (transformers 4.x configs)."""
    mistral = ModelConfig.from_hf_config({**_BASE, "model_type": "mistral", "sliding_window": 64})
    assert [mistral.layer_window(i) for i in range(2)] == [64, 64] and mistral.all_layers_slide
    qwen = {**_BASE, "model_type": "qwen2", "sliding_window": 64}
    assert ModelConfig.from_hf_config({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelConfig.from_hf_config({**qwen, "sliding_window": 0}).sliding_window is None  # unused, 0 in some configs
    q = ModelConfig.from_hf_config({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [q.layer_window(i) for i in range(2)] == [None, 64]
    gemma2 = {**_BASE, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 4,
              "sliding_window": 16, "query_pre_attn_scalar": 16}
    g2 = ModelConfig.from_hf_config(gemma2)
    assert [g2.layer_window(i) for i in range(4)] == [16, None, 16, None]
    assert g2.tie_word_embeddings and g2.norm_weight_offset == 1.0 and g2.attn_scale == 0.25
    g3 = ModelConfig.from_hf_config({**gemma2, "model_type": "gemma3_text", "num_hidden_layers": 7,
                                     "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [g3.layer_window(i) is None for i in range(7)] == [False] * 5 + [True, False]
    assert g3.rope_theta == 1e6 and g3.local_rope_theta == 1e4 and g3.rope_scaling["factor"] == 8.0
    assert g3.layer_uses_local_rope(0) and not g3.layer_uses_local_rope(5) and g3.qk_norm
    with pytest.raises(ValueError, match="multimodal"):
        ModelConfig.from_hf_config({"model_type": "gemma3", "text_config": {}})
    with pytest.raises(ValueError, match="hidden activation"):
        ModelConfig.from_hf_config({**_BASE, "model_type": "gemma2"})  # Gemma with SwiGLU: not a Gemma
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config({**_BASE, "model_type": "phi3", "partial_rotary_factor": 0.5})


def test_longrope_switches_factors_at_the_original_length():
    from specinfer.models.rope import rope_table

    cfg = ModelConfig.from_hf_config({**_BASE, "model_type": "phi3", "max_position_embeddings": 1024,
                                      "original_max_position_embeddings": 64, "rope_scaling": {
                                          "type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}})
    assert cfg.rope_type == "longrope"
    cos, sin = rope_table(cfg, 128)
    plain, _ = rope_table(ModelConfig.from_hf_config({**_BASE, "model_type": "llama"}), 128)
    factor = math.sqrt(1 + math.log(1024 / 64) / math.log(64))
    torch.testing.assert_close(cos[:64], plain[:64] * factor)  # short factors 1: plain RoPE, scaled
    assert not torch.allclose(cos[64:], plain[64:] * factor)  # long factors from position 64 on
