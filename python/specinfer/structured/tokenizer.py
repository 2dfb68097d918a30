"""The llguidance view of a model's tokenizer: each token id's bytes, EOS, and how text
tokenizes (for forced tokens). Built once per engine (about a second for a 150k vocabulary)."""
from __future__ import annotations

import llguidance
import tokenizers


def build_ll_tokenizer(tok: tokenizers.Tokenizer, vocab_size: int, eos_token_ids) -> llguidance.LLTokenizer:
    """From the tokenizer's JSON where llguidance reads it (byte-level BPE, SentencePiece-style
    metaspace: the models people run); else from each token's decoded bytes (word or character
    vocabularies whose decoder llguidance does not know)."""
    eos = list(eos_token_ids)
    if not eos:
        raise ValueError("structured outputs need the model's EOS token (the model declares none)")
    try:
        return llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError):
        return llguidance.LLTokenizer(_Wrapper(tok, vocab_size, eos), n_vocab=vocab_size, eos_token=eos)


class _Wrapper(llguidance.TokenizerWrapper):
    def __init__(self, tok: tokenizers.Tokenizer, vocab_size: int, eos: list[int]):
        special = set(eos) | {t for t, added in tok.get_added_tokens_decoder().items() if added.special}
        n = max(vocab_size, tok.get_vocab_size(with_added_tokens=True))
        tokens = [b"" if i in special else tok.decode([i], skip_special_tokens=False).encode("utf-8")
                  for i in range(n)]
        self._tok = tok
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.tokens = tokens
        self.special_token_ids = sorted(t for t in special if t < n)
        self.is_tokenizer_wrapper = True
        self._accepts_bytes = False
        self._gtokenizer = self._encode

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids
