"""Incremental detokenization with stop-string detection, one token at a time.

Tokens arrive several per step under speculation; feeding them one by one lets a stop string
end the request exactly at the token that completed it (later tokens are dropped).
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | None):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop or ()
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self.text = ""

    def push(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is cut before it), or None."""
        piece = self._stream.step(self._tokenizer, int(token_id))
        if not piece:
            return None
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        for s in self._stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at]
                return s
        return None
