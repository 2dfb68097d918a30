"""CPU attention backends side by side (interleaved, medians of per-repeat ratios) on one layer
of SmolLM2-135M's shapes (9 heads, 3 KV heads, head_dim 64): decode at batch 1 and 16, 1 + 4
verification runs at batch 1 and 16, and a 512-token prefill chunk. Each timed call is one
layer's store + attention; torch threads as given.

    python benches/attention_cpu.py --repeats 20 --threads 1 [--json out.json]
    python benches/attention_cpu.py --backends cpu_native,cpu_native+invariant   # the batch-invariant mode
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged_batch import make_batch  # noqa: E402

from specinfer.attention import get_backend  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16
CASES = {
    "decode b1 ctx400": [(400, 1)],
    "decode b16 ctx100-600": [(100 + 33 * i, 1) for i in range(16)],
    "verify1+4 b1 ctx400": [(400, 5)],
    "verify1+4 b16 ctx100-600": [(100 + 33 * i, 5) for i in range(16)],
    "prefill 512": [(0, 512)],
}


def time_call(backend, batch, calls: int) -> float:
    meta, cache, q, k, v, *_ = batch
    prepared = backend.prepare(meta)
    backend.forward(q, k, v, cache, prepared, D ** -0.5)  # warm
    t0 = time.perf_counter()
    for _ in range(calls):
        backend.forward(q, k, v, cache, prepared, D ** -0.5)
    return (time.perf_counter() - t0) / calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls per timing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backends", default="torch_ref,cpu_native")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = args.backends.split(",")
    backends = {}
    for n in names:  # "cpu_native+invariant": the kernel's batch-invariant mode (what w8a8 models run)
        backends[n] = get_backend(n.split("+")[0])
        if n.endswith("+invariant"):
            backends[n].batch_invariant = True
    rows = []
    for case, seqs in CASES.items():
        batch = make_batch(seqs, BS, H, HKV, D, dtype=dtype)
        times = {n: [] for n in names}
        for _ in range(args.repeats):
            for n in names:  # interleaved: A B A B ...
                times[n].append(time_call(backends[n], batch, args.calls))
        base = names[0]
        for n in names:
            ratio = statistics.median(t0 / t for t0, t in zip(times[base], times[n]))
            row = dict(case=case, backend=n, median_us=1e6 * statistics.median(times[n]),
                       min_us=1e6 * min(times[n]), speedup_vs_first=ratio)
            rows.append(row)
            print(f"{case:26s} {n:11s} median {row['median_us']:9.1f} us  min {row['min_us']:9.1f} us  "
                  f"speedup vs {base}: {ratio:5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(threads=args.threads, dtype=args.dtype, rows=rows), indent=1))


if __name__ == "__main__":
    main()
