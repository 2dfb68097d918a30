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


def build_tiny_model(path: Path, arch: str = "llama", *, tied: bool = False, seed: int = 0, layers: int = 2,
                     hidden: int = 64, heads: int = 4, kv_heads: int = 2, scale: float = 1.0,
                     perturb: float = 0.0, base: Path | None = None, vocab: int = VOCAB):
    """Save a random `arch` model (llama | mistral | qwen2) with a word-level tokenizer to `path`.

    `scale` multiplies every weight matrix's init so logits are well separated (no argmax ties).
    With `base` and `perturb`, the weights are base's plus Gaussian noise of that std: a draft that
    agrees with the target often but not always.
    """
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None, rope_theta=10000.0)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=10000.0, use_sliding_window=False)
        cls = tf.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval() if base is None else cls.from_pretrained(base, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if base is not None:
                p.add_(torch.randn_like(p) * perturb)
            elif p.dim() == 2:
                p.normal_(0.0, scale / p.shape[1] ** 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(vocab).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "t2"}))
    return model
