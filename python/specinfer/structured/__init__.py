"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) that constrain what a
request may emit, through llguidance's matchers (docs/structured_outputs.md)."""
from specinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
