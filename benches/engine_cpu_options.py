"""End-to-end decode throughput of SmolLM2-135M under CPU engine options, side by side:
attention backend (torch_ref vs cpu_native), weight precision (float32 / bfloat16 / int8) and the
float32 GEMM path (oneDNN-packed, or `few_rows`: SPECINFER_CPU_GEMM=few_rows).
Methods interleaved per repeat; prints tok/s per method and batch, and the median ratio
against the first method.

    python benches/engine_cpu_options.py --repeats 3 --max-tokens 32 --batches 1,16 --threads 1 \\
        --methods torch_ref:float32,cpu_native:float32,cpu_native:bfloat16,cpu_native:float32:int8
    python benches/engine_cpu_options.py --repeats 3 --max-tokens 64 --batches 1,16 --threads 1 \
        --methods cpu_native:float32,cpu_native:float32::few_rows
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specinfer import Generator, SamplingParams
from specinfer.prompt_sets import load_task
GEMM_ENV = "SPECINFER_CPU_GEMM"  # models/few_rows_linear.py (not imported: runs on older builds too)


def make_generator(model, method: str):
    """backend:dtype[:quantization[:gemm]]; gemm "few_rows" sets SPECINFER_CPU_GEMM while loading."""
    backend, dtype, *rest = method.split(":")
    quant, gemm = (rest + ["", ""])[:2]
    kw = {"quantization": quant} if quant else {}
    old = os.environ.get(GEMM_ENV)
    if gemm:
        os.environ[GEMM_ENV] = gemm
    try:
        return Generator(model, dtype=dtype, enable_prefix_caching=False, attention_backend=backend, **kw)
    finally:
        if old is None:
            os.environ.pop(GEMM_ENV, None)
        else:
            os.environ[GEMM_ENV] = old


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="torch_ref:float32,cpu_native:float32")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    gens = {m: make_generator(args.model, m) for m in methods}
    tok = gens[methods[0]].tokenizer
    prompts = [tok.encode(t).ids for t in load_task("mixed").prompts[:64]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for b in (int(x) for x in args.batches.split(",")):
        rates = {m: [] for m in methods}
        for _ in range(args.repeats):
            for m in methods:  # interleaved
                t0 = time.perf_counter()
                outs = gens[m].generate(prompts[:b], params, use_tqdm=False)
                dt = time.perf_counter() - t0
                rates[m].append(sum(len(o.token_ids) for o in outs) / dt)
        for m in methods:
            ratio = statistics.median(r / r0 for r, r0 in zip(rates[m], rates[methods[0]]))
            print(f"batch {b:3d} {m:32s} {statistics.median(rates[m]):7.2f} tok/s "
                  f"[{min(rates[m]):.2f}-{max(rates[m]):.2f}]  x{ratio:.2f} vs {methods[0]}")


if __name__ == "__main__":
    main()
