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


def build_tiny_model(path: Path, arch: str = "llama", *, tied: bool = False, seed: int = 0, layers: int = 2,
                     hidden: int = 64, heads: int = 4, kv_heads: int = 2, scale: float = 1.0,
                     perturb: float = 0.0, base: Path | None = None, vocab: int = VOCAB, tokenizer: str = "words"):
    """Save a random `arch` model (llama | mistral | qwen2) with a tokenizer to `path`: "words"
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
    if tokenizer == "words":
        _tokenizer(vocab).save(str(path / "tokenizer.json"))
        eos = "t2"
    else:
        tok = _byte_tokenizer() if tokenizer == "bytes" else _char_tokenizer(tokenizer[len("chars:"):])
        tok.save(str(path / "tokenizer.json"))
        eos = SPECIALS[2]
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": eos}))
    return model
