"""The JSONL batch files of `specinfer generate`: one request per input line, one result per line.

Input line: {"prompt": str} | {"prompt_token_ids": [int, ...]} | {"messages": [{"role", "content"}, ...]},
optionally with "id" (echoed back) and per-request sampling overrides (SAMPLING_KEYS).
A line that cannot become a request gets an error naming its line number; the others still run.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specinfer.cli.errors import CliError

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "min_tokens", "speculate")
KNOWN_KEYS = frozenset(("id",) + PROMPT_KEYS + SAMPLING_KEYS)


@dataclass
class BatchItem:
    line: int | None  # 1-based line in the input file; None for --prompt
    id: object = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list | None = None
    overrides: dict = field(default_factory=dict)
    params: object = None  # SamplingParams, once built
    error: str | None = None  # why this line did not run
    output: object = None  # RequestOutput once finished

    @property
    def done(self) -> bool:
        return self.error is not None or self.output is not None

    def where(self, source: str) -> str:
        return f"{source}:{self.line}" if self.line is not None else "--prompt"

    def result(self) -> dict:
        """The output object written for this item."""
        obj: dict = {}
        if self.line is not None:
            obj["line"] = self.line
        if self.id is not None:
            obj["id"] = self.id
        if self.error is not None:
            obj["error"] = self.error
            return obj
        out = self.output
        obj["prompt"] = self.prompt
        if self.prompt is None:
            obj["prompt_token_ids"] = list(out.prompt_token_ids)
        obj.update(text=out.text, token_ids=list(out.token_ids), finish_reason=out.finish_reason,
                   stop_reason=out.stop_reason, num_prompt_tokens=len(out.prompt_token_ids),
                   num_drafts=out.num_drafts, num_draft_tokens=out.num_draft_tokens,
                   num_accepted_tokens=out.num_accepted_tokens, acceptance_rate=round(out.acceptance_rate, 6))
        return obj


def parse_line(text: str, line: int) -> BatchItem:
    item = BatchItem(line)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        item.error = f"invalid JSON ({e.msg} at column {e.colno})"
        return item
    if not isinstance(obj, dict):
        item.error = f"expected a JSON object, got {type(obj).__name__}"
        return item
    item.id = obj.get("id")
    unknown = sorted(set(obj) - KNOWN_KEYS)
    given = [k for k in PROMPT_KEYS if k in obj]
    if unknown:
        item.error = f"unknown key(s) {unknown}; known: {sorted(KNOWN_KEYS)}"
    elif len(given) != 1:
        item.error = f"needs exactly one of {list(PROMPT_KEYS)} (got {given or 'none'})"
    elif "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        item.error = "prompt must be a non-empty string"
    elif "prompt_token_ids" in obj and not (
            isinstance(obj["prompt_token_ids"], list) and obj["prompt_token_ids"]
            and all(isinstance(t, int) and not isinstance(t, bool) for t in obj["prompt_token_ids"])):
        item.error = "prompt_token_ids must be a non-empty list of integers"
    elif "messages" in obj and (why := _bad_messages(obj["messages"])):
        item.error = why
    else:
        item.prompt = obj.get("prompt")
        item.prompt_token_ids = obj.get("prompt_token_ids")
        item.messages = obj.get("messages")
        item.overrides = {k: obj[k] for k in SAMPLING_KEYS if k in obj}
    return item


def _bad_messages(messages) -> str | None:
    """Why `messages` is not a chat ({"role": str, "content": str} objects), or None."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {\"role\", \"content\"} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with \"role\" and \"content\" (got {type(m).__name__})"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"got {type(m[key]).__name__}"
                return f"messages[{i}].{key} must be a string ({got})"
    return None


def read_batch(path: str) -> list[BatchItem]:
    """Every non-blank line of `path` ("-" = stdin) as a BatchItem (bad lines carry their error)."""
    if path == "-":
        import sys

        lines = sys.stdin.read().splitlines()
    else:
        p = Path(path)
        if not p.is_file():
            raise CliError(f"--input {path!r}: " + ("is a directory" if p.is_dir() else "no such file"))
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise CliError(f"--input {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    items = [parse_line(text, n) for n, text in enumerate(lines, start=1) if text.strip()]
    if not items:
        raise CliError(f"--input {path!r} holds no requests")
    return items


class OrderedWriter:
    """Writes results in input order as they complete, into a temporary file next to `path` that
    replaces `path` when the run ends. A run interrupted (Ctrl-C, a failure) after some requests
    finished keeps them: `salvage` writes every finished result (each names its input line);
    a run that finished nothing leaves no output."""

    def __init__(self, path: str | None):
        self.path = path
        self._next = 0
        if path is None or path == "-":
            import sys

            self._file, self._tmp = sys.stdout, None
            return
        target = Path(path)
        if target.is_dir():
            raise CliError(f"cannot write --out {path!r}: it is a directory")
        if not target.parent.is_dir():
            raise CliError(f"cannot write --out {path!r}: directory {str(target.parent)!r} does not exist")
        try:
            fd, self._tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        except OSError as e:
            raise CliError(f"cannot write --out {path!r}: {e.strerror}") from None
        self._file = os.fdopen(fd, "w", encoding="utf-8")

    def write_ready(self, items: list[BatchItem]) -> None:
        while self._next < len(items) and items[self._next].done:
            self._file.write(json.dumps(items[self._next].result(), ensure_ascii=False) + "\n")
            self._next += 1
        self._file.flush()

    def salvage(self, items: list[BatchItem]) -> int:
        """After an interruption: every finished item not yet written goes out too (out of input
        order: each result names its input `line`), and the file takes its place. -> how many
        results the output holds."""
        written = set(range(self._next))
        for i, item in enumerate(items):
            if i not in written and item.output is not None:
                self._file.write(json.dumps(item.result(), ensure_ascii=False) + "\n")
                written.add(i)
        self._file.flush()
        self.commit()
        return len(written)

    def commit(self) -> None:
        if self._tmp is not None:
            self._file.close()
            os.replace(self._tmp, self.path)
            self._tmp = None

    def discard(self) -> None:
        if self._tmp is not None:
            self._file.close()
            os.unlink(self._tmp)
            self._tmp = None
