"""Identical no-speculation engines, interleaved: does each one's own weight copy make it faster or
slower than the others (a fixed per-instance effect), and is that gone when they share one copy
(engine/model_loading.shared_models, as the bench runner does)? Prints ms per token per engine and
each engine's median ratio to the first, own copies then a shared copy, per trial.

    python benches/experiments/instance_effect.py [--engines 4] [--repeats 6] [--trials 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specinfer import Generator, SamplingParams
from specinfer.loader.model_loading import shared_models

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
PROMPT = [[1, 2, 3, 4] * 8]


def make(model: str) -> Generator:
    return Generator(model, max_model_len=512, num_kv_blocks=40, enable_prefix_caching=False)


def seconds(gen: Generator) -> float:
    t = time.perf_counter()
    gen.generate(PROMPT, PARAMS, use_tqdm=False)
    return time.perf_counter() - t


def measure(label: str, gens: list[Generator], repeats: int) -> None:
    for g in gens:  # warm-up
        seconds(g)
    times = [[] for _ in gens]
    for _ in range(repeats):
        for i, g in enumerate(gens):
            times[i].append(seconds(g))
    per_token = " ".join(f"{statistics.median(t) / PARAMS.max_tokens * 1e3:.2f}" for t in times)
    ratios = " ".join(f"{statistics.median(a / b for a, b in zip(times[0], t)):.3f}" for t in times[1:])
    print(f"{label}: {per_token} ms/token; speed vs the first engine: {ratios}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for _ in range(args.trials):
        own = [make(args.model) for _ in range(args.engines)]
        measure("own weights   ", own, args.repeats)
        del own
        with shared_models():
            shared = [make(args.model) for _ in range(args.engines)]
        measure("shared weights", shared, args.repeats)
        del shared
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
