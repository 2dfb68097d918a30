"""Compiling StructuredOutputsParams into llguidance grammars, and the matcher each constrained
request carries (RequestGrammar): it follows the request's committed tokens, gives the token mask
of each logits row of a step (advancing over the drafts before the row and rolling back), and the
tokens the grammar forces next (proposed as drafts).

Why llguidance (over xgrammar): a Rust core whose masks cost tens of microseconds on 100k+
vocabularies with no per-grammar preprocessing (xgrammar compiles each schema ahead, seconds for
large ones), Earley parsing for full context-free grammars (Lark, GBNF, JSON schema), rollback
and a mask fill over draft tokens made for speculative decoding, forced ("fast-forward") tokens,
and wheels for every platform we ship on, from PyPI (abi3) with no torch version pin.
"""
from __future__ import annotations

import json
import threading

import llguidance
import numpy as np

from specinfer.structured.params import StructuredOutputsParams
from specinfer.structured.tokenizer import build_ll_tokenizer


JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,40}"  # enough for pretty-printed JSON 18 levels deep


def _strict(schema):
    """OpenAI's strict mode: no properties beyond those declared, in every object of the schema."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of the constraint (not yet checked: see GrammarCompiler)."""
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"SamplingParams.structured_outputs.json is not valid JSON: {e}") from None
        if so.disable_additional_properties:
            schema = _strict(schema)
        # whitespace between JSON tokens: none, or at most JSON_WHITESPACE (an unbounded run is how a
        # small model loops forever inside a valid document; llama.cpp's JSON grammars bound it too)
        overrides = ({"whitespace_flexible": False} if so.disable_any_whitespace else
                     {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"SamplingParams.structured_outputs.{kind} is not a usable JSON schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured_outputs.grammar is not a valid grammar: {e}") from None


class GrammarCompiler:
    """One per engine: the llguidance tokenizer (built on first use) and the checked grammars by
    constraint (a server sees the same schema again and again)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self._ll = None
        self._grammars: dict[tuple, str] = {}
        self._lock = threading.Lock()  # validation runs on a server's thread pool
        self.eos_token_ids = self._eos

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = build_ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll

    def compile(self, so: StructuredOutputsParams) -> str:
        """The checked grammar text; ValueError naming the field if the schema/regex/grammar is bad."""
        key = so.key()
        g = self._grammars.get(key)
        if g is not None:
            return g
        g = grammar_text(so)
        err = llguidance.LLMatcher.validate_grammar(g, self.ll_tokenizer)
        if err and not err.startswith("WARNING"):
            raise ValueError(f"SamplingParams.structured_outputs.{so.kind} is invalid: {err.strip()}")
        if len(self._grammars) > 1024:
            self._grammars.clear()
        self._grammars[key] = g
        return g

    def matcher(self, so: StructuredOutputsParams) -> "RequestGrammar":
        m = llguidance.LLMatcher(self.ll_tokenizer, self.compile(so), log_level=0)
        if m.is_error():
            raise ValueError(f"SamplingParams.structured_outputs.{so.kind} is invalid: {m.get_error()}")
        return RequestGrammar(m, self._eos)


class RequestGrammar:
    """One request's matcher, at its committed tokens between steps."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids):
        self.matcher = matcher
        self.eos = frozenset(eos_token_ids)
        self.error: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()

    def consume(self, tokens: list[int]) -> bool:
        """Advance over committed tokens; False (and `error` set) if one is not allowed."""
        if self.error is not None:
            return False
        tokens = list(tokens)
        n = self.matcher.try_consume_tokens(tokens)
        # try_consume stops at EOS; consume_token takes it where the grammar is complete
        if n < len(tokens) and tokens[n] in self.eos and self.matcher.consume_token(tokens[n]):
            n += 1
        if n != len(tokens):
            self.error = (f"token {tokens[n]} is not allowed by the grammar here"
                          + (f" ({self.matcher.get_error()})" if self.matcher.is_error() else ""))
            return False
        return True

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (its fast-forward tokens)."""
        if limit <= 0 or self.error is not None or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def fill_tree(self, bitmask: np.ndarray, first: int, drafts: np.ndarray, parents: np.ndarray) -> None:
        """Masks of a token tree's rows into bitmask[first + slot]: slot 0 the root (this state),
        slot 1 + m node m (after the drafts on its path). Rows past an invalid draft stay as they
        are (they can never be reached: that draft is rejected)."""
        m = self.matcher
        _fill(m, bitmask, first)
        depth_of = {}
        for node in range(len(drafts)):
            path = []
            x = node
            while x >= 0:
                path.append(int(drafts[x]))
                x = int(parents[x])
            path.reverse()
            n = m.try_consume_tokens(path)
            if n == len(path):
                _fill(m, bitmask, first + 1 + node)
            if n:
                m.rollback(n)
            depth_of[node] = len(path)


def _fill(matcher, bitmask: np.ndarray, row: int) -> None:
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
