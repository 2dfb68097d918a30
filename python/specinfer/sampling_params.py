"""Per-request sampling parameters, validated at construction (errors name the field)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from specinfer.structured.params import StructuredOutputsParams


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
    # vLLM's / OpenAI's penalties (sample/penalties.py): presence and frequency over the output so
    # far, repetition over prompt and output (1 = off); logit_bias {token id: bias in [-100, 100]}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = field(default=None, hash=False)
    # the output must match a JSON schema / regex / choice / grammar (specinfer.structured)
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)
    n: int = 1  # parallel samples of the prompt (Generator / server fan them out; seeds seed + i)
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
        self._normalize_logit_bias()
        self._validate()
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "n"):  # numpy ints -> int
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or math.isnan(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        r = self.repetition_penalty
        if not _is_real(r) or math.isnan(r) or not 0.0 < r <= 2.0 or not np.float32(r) > 0:
            raise bad("repetition_penalty", "must be in (0, 2] (1 = off)")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if isinstance(so, dict):  # {"json": schema} and the like
                object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**so))
            else:
                raise bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")
        if not is_int(self.n) or not 1 <= self.n <= 128:
            raise bad("n", "must be an integer in [1, 128]")

    def _normalize_logit_bias(self) -> None:
        """{token id (int, or its decimal string as JSON sends it): bias} -> {int: float}, biases
        clamped to [-100, 100] (OpenAI's range, vLLM's clamp); cached as arrays for the step."""
        lb = self.logit_bias
        ids, vals = np.zeros(0, np.int64), np.zeros(0, np.float64)
        if lb is not None:
            if not isinstance(lb, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}} (got {lb!r})")
            norm = {}
            for k, v in lb.items():
                key = int(k) if isinstance(k, str) and k.strip().isdigit() else k
                if not is_int(key) or key < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0 (got {k!r})")
                if not _is_real(v) or math.isnan(v):
                    raise ValueError(f"SamplingParams.logit_bias[{k!r}] must be a number (got {v!r})")
                norm[int(key)] = min(100.0, max(-100.0, float(v)))
            object.__setattr__(self, "logit_bias", norm)
            ids = np.fromiter(norm.keys(), np.int64, len(norm))
            vals = np.fromiter(norm.values(), np.float64, len(norm))
        object.__setattr__(self, "_bias_arrays", (ids, vals))

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64[B], biases float64[B]) of logit_bias."""
        return self._bias_arrays

    @property
    def penalized(self) -> bool:
        """Any of logit_bias and the three penalties is on: the step rewrites this request's logits."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0

    def sample_params(self, j: int) -> "SamplingParams":
        """The parameters of parallel sample j of n (vLLM's rule): n = 1, and seed + j when seeded,
        so the n samples differ yet a seeded request repeats."""
        seed = None if self.seed is None else (self.seed + j) % SEED_LIMIT
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (True is not token id 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
