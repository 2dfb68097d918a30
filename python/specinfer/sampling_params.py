"""Per-request sampling parameters, validated at construction (errors name the field)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np


SEED_LIMIT = 2**64  # seeds are unsigned 64-bit: [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    # max_tokens: output tokens at most. Like vLLM's offline engine, a request also stops with
    # finish_reason "length" when prompt + output reach the engine's max_model_len, so a larger
    # max_tokens is clamped by that rule rather than refused.
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # in [0, 2**64); a seeded request gives the same tokens in any batch
    stop: tuple[str, ...] | None = None  # stop strings; excluded from the output text
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per emitted token (plus the chosen one); <= engine max_logprobs
    speculate: bool = True  # False: this request decodes normally inside a speculative batch
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            if not hasattr(self.stop, "__iter__") or isinstance(self.stop, bytes):
                raise ValueError(f"SamplingParams.stop must be a string or a list of strings (got {self.stop!r})")
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids (got {ids!r})")
            ids = tuple(ids)
            bad = next((t for t in ids if not is_int(t) or t < 0), None)
            if bad is not None:
                raise ValueError(f"SamplingParams.stop_token_ids must hold integer token ids >= 0 (got {bad!r} "
                                 f"in {list(ids)!r})")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        self._validate()
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs"):  # numpy ints -> int
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why} (got {getattr(self, name)!r})")

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        # each value also in float32, the dtype the step computes in: 1e-300 is > 0 but 0 there
        t = self.temperature
        if not _is_real(t) or math.isnan(t) or t < 0 or t > FLOAT32_MAX:
            raise bad("temperature", "must be a finite number >= 0 (finite in float32)")
        p = self.top_p
        if not _is_real(p) or math.isnan(p) or not 0.0 < p <= 1.0 or not np.float32(p) > 0:
            raise bad("top_p", "must be in (0, 1] (> 0 in float32)")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            raise bad("top_k", "must be an integer in [-1, 2**31) (0 or -1 disables it; values above the "
                      "vocabulary size keep every token)")
        m = self.min_p
        if not _is_real(m) or math.isnan(m) or not 0.0 <= m <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise bad("seed", "must be an integer in [0, 2**64) or None")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        for name in ("ignore_eos", "speculate"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad(name, "must be True or False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (True is not token id 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
