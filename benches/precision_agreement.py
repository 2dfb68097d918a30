"""Greedy agreement of lower-precision weights with float32 on a real model (default SmolLM2-135M):
each variant decodes the same chat-templated prompts greedily; against the float32 run it reports
how many outputs are identical, the token agreement up to the first divergence, the mean first
divergence position, the weight bytes and the wall time (one run, not a benchmark).

    python benches/precision_agreement.py --prompts 8 --max-tokens 48 \\
        --variants float32,bfloat16,float32+int8,bfloat16+int8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specinfer import Generator, SamplingParams
from specinfer.prompt_sets import load_task, prompt_encoder


def run(model: str, variant: str, prompts, params):
    dtype, _, quant = variant.partition("+")
    t0 = time.perf_counter()
    gen = Generator(model, dtype=dtype, quantization=quant or None, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    enc = prompt_encoder(gen.engine.loaded, True)
    ids = [enc(p) for p in prompts]
    t0 = time.perf_counter()
    outs = [o.token_ids for o in gen.generate(ids, params, use_tqdm=False)]
    return dict(outputs=outs, load_s=load_s, generate_s=time.perf_counter() - t0,
                weight_mb=gen.engine.loaded.model.weight_bytes() / 1e6)


def first_divergence(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) == len(b) else min(len(a), len(b))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", default="float32,bfloat16,float32+int8,bfloat16+int8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = list(load_task("mixed").prompts[: args.prompts])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    variants = args.variants.split(",")
    results = {v: run(args.model, v, prompts, params) for v in variants}
    base = results[variants[0]]["outputs"]
    rows = []
    for v in variants:
        r = results[v]
        div = [first_divergence(a, b) for a, b in zip(r["outputs"], base)]
        same = sum(a == b for a, b in zip(r["outputs"], base))
        agree = sum(div) / sum(len(b) for b in base)
        rows.append(dict(variant=v, identical=f"{same}/{len(base)}", tokens_before_divergence=agree,
                         mean_first_divergence=statistics.mean(div), weight_mb=round(r["weight_mb"], 1),
                         load_s=round(r["load_s"], 1), generate_s=round(r["generate_s"], 1)))
        print(f"{v:16s} identical {same}/{len(base)}  tokens before first divergence {100 * agree:5.1f}%  "
              f"mean first divergence {statistics.mean(div):5.1f}/{args.max_tokens}  weights {r['weight_mb']:6.1f} MB  "
              f"load {r['load_s']:.1f}s  generate {r['generate_s']:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, max_tokens=args.max_tokens, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
