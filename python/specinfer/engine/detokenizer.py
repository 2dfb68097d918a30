"""Incremental detokenization with stop-string detection, one token at a time.

Tokens arrive several per step under speculation; feeding them one by one lets a stop string
end the request exactly at the token that completed it (later tokens are dropped).

Streaming is exact: `stream_text(finished)` is the text safe to show so far. While a request
runs, the last `max stop length - 1` characters are held back, since they may still turn out to
start a stop string that the next tokens complete (vLLM's detokenizer does the same); a finished
request shows all its text. So the pieces a stream hands out always add up to the final text.
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
        self.stop_buffer_length = max(0, self._max_stop_len - 1)  # characters held back while running

    def stream_text(self, finished: bool) -> str:
        """The part of `text` that can no longer change (all of it once the request finished)."""
        if finished or not self.stop_buffer_length:
            return self.text
        return self.text[: max(0, len(self.text) - self.stop_buffer_length)]

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
