"""Server-sent events as OpenAI streams them: `data: <json>\n\n` per chunk, `data: [DONE]` last."""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream
MEDIA_TYPE = "text/event-stream"


def event(payload: dict) -> bytes:
    """One SSE event carrying `payload` as compact JSON (JSON never holds a raw newline)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parse(body: bytes) -> list[dict | str]:
    """The payloads of an SSE body (JSON objects, or the string "[DONE]"): for tests and the load
    benchmark's raw checks."""
    out: list[dict | str] = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out
