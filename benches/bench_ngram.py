"""`SchedulerCore.propose_ngram` (Rust, O(len) Z-function scan with early exit)
against a straightforward numpy prompt-lookup on 32k-token histories.

    pytest benches/bench_ngram.py --benchmark-only --benchmark-group-by=param:case
"""
from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from specinfer._core import SchedulerCore

HISTORY = 32_768
K, MIN_N, MAX_N = 4, 1, 4


def propose_numpy(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Longest suffix n-gram (max_n down to min_n) with an earlier occurrence; the
    tokens after its most recent earlier occurrence, up to k."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        windows = sliding_window_view(tokens[:-1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return tokens[start : start + k]
    return tokens[:0]


def history(case: str, rng: np.random.Generator) -> np.ndarray:
    if case == "random":  # a large vocabulary: long suffixes rarely recur, full scan
        return rng.integers(0, 32_000, HISTORY)
    if case == "repetitive":  # code-like: a 200-token block repeats with edits
        block = rng.integers(0, 32_000, 200)
        t = np.tile(block, HISTORY // 200 + 1)[:HISTORY].copy()
        edits = rng.integers(0, HISTORY, HISTORY // 50)
        t[edits] = rng.integers(0, 32_000, edits.size)
        return t
    raise ValueError(case)


@pytest.fixture(params=["random", "repetitive"])
def case(request):
    rng = np.random.default_rng(0)
    core = SchedulerCore(num_blocks=HISTORY // 16 + 16, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=HISTORY, max_model_len=HISTORY + 64)
    tokens = history(request.param, rng)
    core.add_request(0, tokens, max_tokens=8)
    return request.param, core, tokens


def test_ngram_rust(benchmark, case):
    name, core, tokens = case
    ids = np.array([0], dtype=np.uint64)
    cu, drafts = benchmark(core.propose_ngram, ids, K, MIN_N, MAX_N)
    assert drafts.tolist() == propose_numpy(tokens, K, MIN_N, MAX_N).tolist()


def test_ngram_numpy(benchmark, case):
    name, core, tokens = case
    drafts = benchmark(propose_numpy, tokens, K, MIN_N, MAX_N)
    assert len(drafts) <= K
