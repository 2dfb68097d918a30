"""The byte-level BPE tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata.

Built with the `tokenizers` library the way the model's own tokenizer.json would be: the vocab
(in the GPT-2 byte alphabet), the merges, control tokens as special added tokens, user-defined
tokens as plain added tokens, and the pre-tokenizer that matches `tokenizer.ggml.pre` (the
regexes of llama.cpp's `llama-vocab.cpp` and of the models' tokenizer.json files).
"""
from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

# Token types of llama.cpp's vocab (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: every digit alone, then the GPT-2 split (llama.cpp: "\p{N}" + GPT-2 regex)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# tokenizer.ggml.pre -> (pre-tokenizer factory, NFC normalizer?, ignore_merges?)
PRE_TOKENIZERS = {
    "default": (_gpt2, False, False),
    "gpt-2": (_gpt2, False, False),
    "smollm": (_digits_then_gpt2, False, False),
    "starcoder": (_digits_then_gpt2, False, False),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), True, False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2_SPLIT), True, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "llama-v3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
    "smaug-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False, True),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_gguf_tokenizer(meta: dict, source: str) -> tuple[tokenizers.Tokenizer, bool]:
    """meta: the `tokenizer.*` fields (plain Python values) -> (tokenizer, add_bos_token).

    `tokenizer.encode(text)` prepends BOS iff the file's `tokenizer.ggml.add_bos_token` is true.
    """
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":  # SentencePiece (Gemma, Llama 2, Mistral, Phi-3)
        from specinfer.loader.gguf_spm_tokenizer import build_spm_tokenizer

        return build_spm_tokenizer(meta, source)
    if model != "gpt2":
        raise ValueError(f"{source}: unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2' "
                         "and SentencePiece 'llama')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{source}: unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
    make_pre, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{source}: missing or empty GGUF tokenizer array tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        got = len(types) if isinstance(types, list) else repr(types)
        raise ValueError(f"{source}: GGUF tokenizer.ggml.token_type has {got} entries for {len(tokens)} tokens")
    raw_merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(raw_merges, list) or any(not isinstance(m, str) or " " not in m for m in raw_merges):
        raise ValueError(f"{source}: GGUF tokenizer.ggml.merges must be a list of \"left right\" strings")
    merges = [tuple(m.split(" ", 1)) for m in raw_merges]

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alphabet:  # stored as raw text: respell its UTF-8 bytes
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    bpe = tokenizers.models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    tok = tokenizers.Tokenizer(bpe)
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, <|endoftext|>) stay whole and are special; a "control" token
    # outside the byte alphabet is a llama.cpp mislabel and is left alone (as transformers does).
    tok.add_special_tokens([
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet
    ])
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab
    ])

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    steps = [processors.ByteLevel(trim_offsets=False)]
    if bos_id is not None and not (isinstance(bos_id, int) and 0 <= bos_id < len(tokens)):
        raise ValueError(f"{source}: GGUF tokenizer.ggml.bos_token_id = {bos_id!r} is outside the vocabulary "
                         f"[0, {len(tokens)})")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        steps.append(processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]))
    tok.post_processor = processors.Sequence(steps)
    return tok, add_bos and bos_id is not None
