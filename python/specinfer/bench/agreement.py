"""Greedy agreement between methods: the token ids every method generated in the first repeat,
compared sequence by sequence with the baseline's for the same prompts (same batch size and task).

Methods that compute the same fp32 function (specinfer fp32, HF fp32, vLLM fp32, llama.cpp on
the f32 GGUF) should agree token for token; lower precisions (bf16, int8, Q8_0, f16) diverge
somewhere, and how early is the figure worth reporting beside their speed.
"""
from __future__ import annotations

from specinfer.bench.config import BenchConfig


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per-sequence comparison of two methods' outputs for the same prompts, in the same order."""
    if len(reference) != len(other):
        raise ValueError(f"cannot compare {len(other)} sequences with {len(reference)}")
    prefixes = [common_prefix(r, o) for r, o in zip(reference, other)]
    identical = sum(1 for r, o in zip(reference, other) if r == o)
    # a sequence agrees until its first differing token; one that stops early (EOS) is shorter
    diverged_at = [p for p, r, o in zip(prefixes, reference, other) if r != o]
    return {
        "sequences": len(reference),
        "identical": identical,
        "identical_fraction": identical / len(reference) if reference else None,
        "mean_common_prefix": sum(prefixes) / len(prefixes) if prefixes else None,
        "first_divergence": min(diverged_at) if diverged_at else None,
        "reference_tokens": sum(map(len, reference)),
    }


def greedy_agreement(cfg: BenchConfig, runs: list[dict]) -> list[dict]:
    """One row per (method, batch size, task) that has token ids, against the baseline. Empty
    for sampled runs (temperature > 0), whose outputs are not meant to agree."""
    if cfg.temperature > 0:
        return []
    ids = {(r["method"], r["batch_size"], r["task"]): r["token_ids"]
           for r in runs if r.get("repeat") == 0 and r.get("token_ids")}
    base = cfg.baseline.name
    rows = []
    for m in cfg.methods:
        for b in cfg.batch_sizes:
            for task in cfg.tasks:
                ref, other = ids.get((base, b, task)), ids.get((m.name, b, task))
                if ref is None or other is None:
                    continue
                rows.append({"method": m.name, "engine": m.engine, "batch_size": b, "task": task,
                             "reference": base, **compare(ref, other)})
    return rows
