"""Each proposer's speedup against no speculation, measured side by side (interleaved) by the
benchmark runner: ngram on SmolLM2-135M (input-grounded prompts), draft_model on the
Qwen2.5-Coder 1.5B / 0.5B pair (bf16, short outputs: it is slow on a CPU), and
disable_by_batch_size at batch 32. Speedup, acceptance rate, k, c and the theoretical speedup
go to extra_info (and a results.json under bench_out/benches/).

    python -m pytest benches/bench_proposers.py -p no:cacheprovider --benchmark-only -s
"""
from __future__ import annotations

from pathlib import Path

import pytest

from specinfer.bench.config import load_config
from specinfer.bench.runner import run_benchmark
from specinfer.bench.table import format_table

OUT = Path(__file__).resolve().parent.parent / "bench_out" / "benches"

CASES = {
    "ngram-smollm2": ("smollm2-ngram", dict(num_prompts=1, max_tokens=64, repeats=2,
                                            methods=[{"name": "no-spec"}, {"name": "ngram-k4", "speculative": {
                                                "method": "ngram", "num_speculative_tokens": 4}}])),
    "draft-qwen": ("qwen-draft", dict(num_prompts=1, max_tokens=16, repeats=2,
                                      methods=[{"name": "no-spec"},
                                               {"name": "draft-k4", "speculative": {
                                                   "method": "draft_model", "model": "qwen2.5-coder-0.5b",
                                                   "num_speculative_tokens": 4}},
                                               {"name": "draft-alone", "model": "qwen2.5-coder-0.5b",
                                                "role": "cost"}])),
    "ngram-disabled-batch32": ("batch32", dict(max_tokens=32, repeats=2, methods=[
        {"name": "no-spec"}, {"name": "ngram-k4-disable16", "speculative": {
            "method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}}])),
}


@pytest.mark.parametrize("case", list(CASES))
def bench_proposer_speedup(benchmark, case, bench_threads):
    preset, overrides = CASES[case]
    cfg = load_config(preset, threads=bench_threads, plots=False, **overrides)
    box = {}
    benchmark.pedantic(lambda: box.update(r=run_benchmark(cfg, OUT / case, log=lambda *_: None)), rounds=1,
                       iterations=1)
    results = box["r"]
    print("\n" + format_table(results))
    tasks = cfg.tasks
    want = "all" if len(tasks) > 1 else tasks[0]
    for row in results["rows"]:
        if row["task"] == want and row.get("k"):
            benchmark.extra_info[row["method"]] = {key: row.get(key) for key in (
                "speedup", "acceptance_rate", "mean_acceptance_length", "k", "c", "theoretical_speedup",
                "achieved_over_theoretical", "batch_size")}
    assert results["rows"], "the runner produced no rows"
