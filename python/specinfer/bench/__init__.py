"""specinfer's benchmark suite: configs and presets, shipped prompt sets, the interleaved
runner (specinfer methods and optional peers), results.json, plots and a printed table.

    specinfer bench smollm2-ngram --out bench_out/ngram
    python -m specinfer.bench smoke --out bench_out/smoke

Peers (HF transformers, vLLM) are optional: imported only when a config asks for them.
"""
from specinfer.bench.config import PRESETS, BenchConfig, MethodConfig, load_config
from specinfer.prompt_sets import PromptSet, load_prompt_sets
from specinfer.bench.theory import theoretical_speedup

__all__ = ["BenchConfig", "MethodConfig", "PRESETS", "PromptSet", "load_config", "load_prompt_sets",
           "theoretical_speedup", "run_benchmark"]


def run_benchmark(config, out_dir, **kw):
    from specinfer.bench.runner import run_benchmark as _run

    return _run(config, out_dir, **kw)
