"""Per-request sampling parameters, validated at construction (errors name the field)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request draws from its own generator: same tokens in any batch
    stop: tuple[str, ...] | None = None  # stop strings; excluded from the output text
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per emitted token (plus the chosen one)
    speculate: bool = True  # False: this request decodes normally inside a speculative batch
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why} (got {getattr(self, name)!r})")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise bad("temperature", "must be a finite number >= 0")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        m = self.min_p
        if not isinstance(m, (int, float)) or math.isnan(m) or not 0.0 <= m <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
