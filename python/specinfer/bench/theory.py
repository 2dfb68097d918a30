"""The speculative-decoding speedup model and small robust statistics."""
from __future__ import annotations

import statistics


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of speculative decoding over plain decoding (Leviathan et al., 2023):

        (1 - alpha^(k+1)) / ((1 - alpha) * (k*c + 1))

    alpha: per-token acceptance rate in [0, 1]; k: draft tokens per verification (>= 1);
    c: cost of one draft forward relative to one target forward (>= 0). At alpha == 1 the
    numerator/denominator limit (k + 1) is used.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha!r})")
    if int(k) != k or k < 1:
        raise ValueError(f"k must be an integer >= 1 (got {k!r})")
    if c < 0:
        raise ValueError(f"c must be >= 0 (got {c!r})")
    expected_tokens = (k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return expected_tokens / (k * c + 1.0)


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def ratio(a, b) -> float | None:
    return (a / b) if (a is not None and b) else None
