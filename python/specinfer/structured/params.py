"""StructuredOutputsParams: what a request's output must match (vLLM's names and semantics).

Exactly one of ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object),
``regex``, ``choice`` (one of these strings) and ``grammar`` (Lark, or llama.cpp's GBNF) is set.
Compiling against a tokenizer happens in the engine (specinfer.structured.grammar), where an
invalid schema, regex or grammar is a ValueError naming the field.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = field(default=None, hash=False)
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # JSON only: no whitespace between tokens (compact output; small models otherwise may pad)
    disable_any_whitespace: bool = False
    # JSON only: objects admit no properties beyond the schema's (OpenAI's strict mode)
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"structured_outputs.choice must be a list of strings (got {self.choice!r})")
            choice = tuple(self.choice)
            if not choice or any(not isinstance(c, str) for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings (got {self.choice!r})")
            object.__setattr__(self, "choice", choice)
        if self.json_object is False:
            object.__setattr__(self, "json_object", None)
        set_ = [k for k in KINDS if getattr(self, k) is not None]
        if len(set_) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar "
                             f"(got {set_ or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                             f"{type(self.json).__name__}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string (got {v!r})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def key(self) -> tuple:
        """A hashable identity of the constraint (compiled grammars are cached by it)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = _json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace, self.disable_additional_properties
