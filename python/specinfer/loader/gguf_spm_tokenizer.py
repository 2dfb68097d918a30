"""The SentencePiece tokenizer a GGUF file describes with `tokenizer.ggml.model = "llama"` (Gemma,
Llama 2, Mistral, Phi-3): pieces spelled with "▁" for spaces, a score per piece, byte-fallback
pieces <0xNN>, control and user-defined pieces.

Built with `tokenizers` as the model's own tokenizer.json is (transformers' SentencePiece
converter): a BPE over the pieces whose merges are recovered from the scores — every piece that
splits into two pieces of the vocabulary is a merge of those two, ranked by the piece's score
(SentencePiece's BPE merges the best-scoring pair first) — with byte fallback, spaces replaced
by "▁" (and one prepended when the file says `add_space_prefix`), and the decoder undoing both.
"""
from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, normalizers, processors

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    ranked = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(meta: dict, source: str) -> tuple[tokenizers.Tokenizer, bool]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{source}: missing or empty GGUF tokenizer array tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ValueError(f"{source}: GGUF tokenizer.ggml.scores / token_type do not have one entry per token")
    # every piece is in the BPE's vocabulary (so added tokens keep the file's ids); merges come
    # from normal pieces only, control and user-defined pieces are matched whole as added tokens
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    if unk is not None:
        vocab.setdefault(unk, unk_id)
    bpe = tokenizers.models.BPE(vocab, _merges({t: i for t, i in vocab.items() if types[i] == _NORMAL}, scores),
                                unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    steps = ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos and isinstance(bos_id, int) and 0 <= bos_id < len(tokens):
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        return tok, True
    return tok, False
