"""The body of a `stream: true` response: one SSE chunk per engine step that produced something,
per choice, then (when asked with stream_options.include_usage) OpenAI's usage chunk, then
`[DONE]`. A failure mid-stream is an `{"error": ...}` event followed by `[DONE]`. When the client
goes away, the ASGI server cancels this generator and its `finally` aborts the requests."""
from __future__ import annotations

from collections.abc import AsyncIterator

from specinfer.outputs import RequestOutput
from specinfer.serve import sse
from specinfer.serve.generation import Generation


class TextCursor:
    """How much of one choice's cumulative text the stream has sent.

    While a request runs, the last `holdback` characters (longest stop string - 1) stay unsent: a
    stop string completed by a later token cuts the text back to before it, and text that was
    already sent cannot be taken back. Deltas therefore always concatenate to the final text.
    """

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent = 0

    def advance(self, out: RequestOutput) -> str:
        text = out.text
        upto = len(text) if out.finished else max(self.sent, len(text) - self.holdback)
        delta = text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return delta


async def sse_stream(gen: Generation, fmt, *, holdback: int, include_usage_chunk: bool,
                     role_chunks: bool) -> AsyncIterator[bytes]:
    cursors = [TextCursor(holdback) for _ in gen.subs]
    try:
        if role_chunks:
            for i in range(len(gen.subs)):
                yield sse.event(fmt.role_chunk(i))
        async for ev in gen.events():
            if ev.kind == "failed":
                gen.abort()
                yield sse.event(ev.error.body())
                break
            out = ev.output
            text = cursors[ev.index].advance(out)
            if not (text or out.finished or (fmt.num_top is not None and out.new_token_ids)):
                continue  # nothing a client could see (tokens still inside an incomplete character)
            usage_of = [out] if out.finished and not include_usage_chunk else None
            yield sse.event(fmt.chunk(ev.index, text, out, usage_of))
        else:
            if include_usage_chunk:
                yield sse.event(fmt.usage_chunk(list(gen.finals)))
        yield sse.DONE
    finally:
        gen.abort()  # a no-op unless the client left mid-stream
