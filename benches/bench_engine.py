"""Engine decode throughput on SmolLM2-135M (fp32, no speculation): batch 1 / 16 / 64, and at
batch 1 and 16 the ratio against HF transformers `generate` on the same GGUF file and prompt
tokens, measured interleaved (ours, HF, ours, HF, ...). Numbers go to extra_info.

    python -m pytest benches/bench_engine.py -p no:cacheprovider --benchmark-only -s
"""
from __future__ import annotations

import statistics
import time

import pytest

from specinfer.bench.config import load_config
from specinfer.bench.peers.hf import HFEngine, SpecinferEngine
from specinfer.bench.prompting import batches_for
from specinfer.prompt_sets import load_task, prompt_encoder

MAX_TOKENS = 32
ROUNDS = 3


@pytest.fixture(scope="module")
def setup(bench_threads):
    cfg = load_config("engine-throughput", max_tokens=MAX_TOKENS, threads=bench_threads, ignore_eos=True)
    base = cfg.baseline
    from specinfer.loader.model_loading import load_any
    import torch

    loaded = load_any(cfg.model, dtype=torch.float32, device=torch.device("cpu"))
    encode = prompt_encoder(loaded, True)
    prompts = [encode(p) for p in load_task("mixed").prompts[:64]]
    ours = SpecinferEngine(cfg, base, max(len(p) for p in prompts), int(loaded.config.max_position_embeddings))
    return cfg, ours, prompts, tuple(loaded.eos_token_ids)


def _calls(prompts, b):
    return batches_for(prompts, b, 2)


def _time(engine, calls, cfg):
    t0 = time.perf_counter()
    tokens = sum(engine.run(c, cfg)[0] for c in calls)
    return tokens / (time.perf_counter() - t0)


@pytest.mark.parametrize("batch_size", [1, 16, 64])
def bench_decode_throughput(benchmark, setup, batch_size):
    cfg, ours, prompts, _ = setup
    calls = _calls(prompts, batch_size)
    ours.run(calls[0][:1], cfg)  # warm up
    tokens = []
    benchmark.pedantic(lambda: tokens.append(sum(ours.run(c, cfg)[0] for c in calls)), rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(batch_size=batch_size, tokens_per_round=tokens[0],
                                tokens_per_s_median=tokens[0] / benchmark.stats.stats.median)


@pytest.mark.parametrize("batch_size", [1, 16])
def bench_decode_vs_hf(benchmark, setup, batch_size):
    cfg, ours, prompts, eos = setup
    hf = HFEngine(cfg, cfg.methods[1], eos)
    calls = _calls(prompts, batch_size)
    ours.run(calls[0][:1], cfg)
    hf.run(calls[0][:1], cfg)
    ratios = []

    def paired_round():  # one interleaved pair: ours then HF, same prompts and dtype
        t_ours = _time(ours, calls, cfg)
        t_hf = _time(hf, calls, cfg)
        ratios.append(t_ours / t_hf)

    benchmark.pedantic(paired_round, rounds=ROUNDS, iterations=1)
    ratio = statistics.median(ratios)
    benchmark.extra_info.update(batch_size=batch_size, ratio_vs_hf_median=ratio, ratios=ratios)
    print(f"\nbatch {batch_size}: specinfer / HF generate tokens/s = {ratio:.2f}x (per round {ratios})")
    hf.close()
