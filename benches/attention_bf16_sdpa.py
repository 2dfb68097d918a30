"""bf16 long query runs: torch SDPA (the route cpu_native takes on AMX CPUs, SDPA_ROUTE) against
our kernel, one layer of SmolLM2-135M's shapes (9 heads, 3 KV heads, head_dim 64), one thread,
store + attention per call, median of --repeats calls, us. Decides attention/cpu_native.py's
SDPA_ROUTE on a new CPU kind.

    python benches/attention_bf16_sdpa.py --repeats 15
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged_batch import make_batch  # noqa: E402

import specinfer.attention.cpu_native as cpu_native  # noqa: E402
from specinfer.attention import get_backend  # noqa: E402

H, HKV, D, BS = 9, 3, 64, 16
CASES = {
    "prefill 512": [(0, 512)],
    "prefill 128 at context 384": [(384, 128)],
    "prefill 64 at context 64": [(64, 64)],
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"AMX bf16: {cpu_native.has_amx_bf16()}; cpu_native routes to SDPA: {cpu_native.SDPA_ROUTE}")
    for case, seqs in CASES.items():
        meta, cache, q, k, v, *_ = make_batch(seqs, BS, H, HKV, D, dtype=torch.bfloat16)
        res = {}
        for name, route in (("torch SDPA", True), ("kernel", False)):
            cpu_native.SDPA_ROUTE = route
            backend = get_backend("cpu_native")
            prepared = backend.prepare(meta)
            for _ in range(3):
                backend.forward(q, k, v, cache, prepared, D ** -0.5)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                backend.forward(q, k, v, cache, prepared, D ** -0.5)
                times.append(time.perf_counter() - t0)
            res[name] = statistics.median(times) * 1e6
        print(f"{case:28s} torch SDPA {res['torch SDPA']:8.1f} us   kernel {res['kernel']:8.1f} us   "
              f"SDPA / kernel {res['torch SDPA'] / res['kernel']:.2f}")


if __name__ == "__main__":
    main()
