"""Tiny random HF models (built with transformers, the independent reference) for tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

VOCAB = 256


def _tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 (2 = EOS) of the byte and character tokenizers
BYTE_VOCAB = 260  # the byte-level tokenizer: 3 specials, 256 bytes, one spare


def _byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges (a token per byte, as GPT-2's alphabet writes it): any text."""
    from tokenizers import AddedToken

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(chars)})
    vocab["<extra>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS + ["<extra>"]])
    return tok


def _byte_of(c: str) -> int:
    from specinfer.loader.gguf_tokenizer import _bytes_to_unicode

    return {v: k for k, v in _bytes_to_unicode().items()}[c]


def _char_tokenizer(chars: str) -> Tokenizer:
    """One token per character of `chars` after the 3 specials; decoded by plain concatenation (a
    decoder llguidance does not read: the engine builds its token table from the decoded tokens)."""
    from tokenizers import AddedToken

    vocab = {c: i for i, c in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


FAMILIES = ("qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "qwen2_moe")


def _family_config(tf, arch: str, common: dict, window: int | None, layers: int, experts: int):
    """The HF config and model class of a tiny `arch` model (one of FAMILIES): every family feature
    switched on where the family has it (sliding layers with `window`, soft-caps, a shared expert,
    a dense layer among MoE layers, LongRoPE with a short original length)."""
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=head_dim, rope_theta=10000.0, use_sliding_window=window is not None,
                              sliding_window=window, max_window_layers=1), tf.Qwen3ForCausalLM
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim * 2, sliding_window=window
                               or 4096, layer_types=alternate, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                               hidden_activation="gelu_pytorch_tanh"), tf.Gemma2ForCausalLM
    if arch == "gemma3_text":
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return tf.Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window
                                   or 4096, layer_types=types, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 1000000.0}}), tf.Gemma3ForCausalLM
    if arch == "phi3":
        half = head_dim // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [1.5 + 0.2 * i for i in range(half)]}
        return tf.Phi3Config(**{**common, "max_position_embeddings": 512}, original_max_position_embeddings=128,
                             rope_parameters=rope, sliding_window=window, pad_token_id=0), tf.Phi3ForCausalLM
    if arch == "mixtral":
        return tf.MixtralConfig(**common, head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=2,
                                sliding_window=window, rope_theta=10000.0), tf.MixtralForCausalLM
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=head_dim, num_experts=experts, num_experts_per_tok=2,
                                 moe_intermediate_size=common["hidden_size"], norm_topk_prob=True,
                                 mlp_only_layers=[layers - 1] if layers > 1 else [],
                                 rope_theta=10000.0), tf.Qwen3MoeForCausalLM
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, num_experts=experts, num_experts_per_tok=2,
                                 moe_intermediate_size=common["hidden_size"], shared_expert_intermediate_size=96,
                                 norm_topk_prob=False, rope_theta=10000.0), tf.Qwen2MoeForCausalLM
    raise ValueError(arch)


def build_tiny_model(path: Path, arch: str = "llama", *, tied: bool = False, seed: int = 0, layers: int = 2,
                     hidden: int = 64, heads: int = 4, kv_heads: int = 2, scale: float = 1.0,
                     perturb: float = 0.0, base: Path | None = None, vocab: int = VOCAB, tokenizer: str = "words",
                     window: int | None = None, experts: int = 4):
    """Save a random `arch` model (llama | mistral | qwen2 | one of FAMILIES: its features on,
    sliding layers with `window`, `experts` experts for MoE) with a tokenizer to `path`: "words"
    (t0 .. t{vocab-1}, word-level), "bytes" (byte-level, vocab BYTE_VOCAB) or "chars:<characters>"
    (one token per character after 3 specials; vocab 3 + len(characters)).

    `scale` multiplies every weight matrix's init so logits are well separated (no argmax ties).
    With `base` and `perturb`, the weights are base's plus Gaussian noise of that std: a draft that
    agrees with the target often but not always.
    """
    import transformers as tf

    if tokenizer == "bytes":
        vocab = BYTE_VOCAB
    elif tokenizer.startswith("chars:"):
        vocab = len(SPECIALS) + len(tokenizer[len("chars:"):])
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=window, rope_theta=10000.0)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
        cls = tf.Qwen2ForCausalLM
    else:
        cfg, cls = _family_config(tf, arch, common, window, layers, experts)
    torch.manual_seed(seed)
    model = cls(cfg).eval() if base is None else cls.from_pretrained(base, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is not None:
                p.add_(torch.randn_like(p) * perturb)
            elif p.dim() >= 2:  # matrices, and transformers' stacked [experts, out, in] tensors
                p.normal_(0.0, scale / p.shape[-1] ** 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            elif arch in FAMILIES and "norm" in name:  # norms that are not all ones (Gemma: not all zeros)
                p.add_(torch.randn_like(p) * 0.2)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer == "words":
        _tokenizer(vocab).save(str(path / "tokenizer.json"))
        eos = "t2"
    else:
        tok = _byte_tokenizer() if tokenizer == "bytes" else _char_tokenizer(tokenizer[len("chars:"):])
        tok.save(str(path / "tokenizer.json"))
        eos = SPECIALS[2]
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": eos}))
    return model
