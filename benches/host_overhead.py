"""The engine's host cost per step, with the model's compute taken out: a one-layer, 32-wide random
Llama (its forward is ~0.1 ms), a batch of repetitive prompts, greedy, no EOS. What is left is
what a GPU step pays on the host beside its (graph-replayed) forward: scheduling, batch packing,
verification, proposing, the speculation policy, the update and detokenization. On the H200
(docs/lab/2026-12-notebook.md, "Device check") a batch-32 decode step of a 0.85B model takes ~2.5 ms, so
every 0.1 ms here is ~4 % there.

Per method (no speculation, ngram k=4 with the goodput policy, ngram k=4 fixed): ms per engine
step, split as the engine's metrics split it (score = packing + forward, verify, propose =
proposal + policy, overhead = the rest), medians over repeats, methods interleaved.

    python benches/host_overhead.py --batch 32 --repeats 7
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_bench_setup import build_tiny_llama, repetitive_prompts  # noqa: E402
from specinfer import Generator, SamplingParams  # noqa: E402

METHODS = {
    "no-spec": None,
    "ngram-k4-goodput": {"method": "ngram", "num_speculative_tokens": 4, "policy": "goodput"},
    "ngram-k4-fixed": {"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"},
}
PARTS = ("score_s", "verify_s", "propose_s", "overhead_s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp())
    build_tiny_llama(tmp / "m")
    prompts = repetitive_prompts(args.batch, args.prompt_len)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    gens = {name: Generator(str(tmp / "m"), speculative=spec, max_model_len=args.prompt_len + args.new_tokens + 8,
                            num_kv_blocks=args.batch * 16 + 64, enable_prefix_caching=False)
            for name, spec in METHODS.items()}
    rows = {name: [] for name in METHODS}
    for gen in gens.values():
        gen.generate(prompts, params, use_tqdm=False)  # warm
    for _ in range(args.repeats):
        for name, gen in gens.items():
            gen.engine.reset_metrics()
            t = time.perf_counter()
            gen.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            m = gen.spec_metrics() if METHODS[name] else gen.engine.metrics.as_dict()
            steps = m["num_steps"]
            rows[name].append({"wall_ms_per_step": wall / steps * 1e3, "steps": steps,
                               **{p: m[p] / steps * 1e3 for p in PARTS},
                               "mean_acceptance_length": m.get("mean_acceptance_length")})
    print(f"batch {args.batch}, prompts {args.prompt_len}, new tokens {args.new_tokens}; ms per step, median of "
          f"{args.repeats}")
    print("| method | steps | wall / step | score | verify | propose | overhead |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall_ms_per_step", "steps", *PARTS)}
        summary[name] = med
        print(f"| {name} | {med['steps']:.0f} | {med['wall_ms_per_step']:.3f} | "
              + " | ".join(f"{med[p]:.3f}" for p in PARTS) + " |")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
