"""GEMM weights streamed cold, as a decode step reads them: every linear of SmolLM2-135M's 30 layers
(q|k|v 576->960, o 576->576, gate|up 576->3072, down 1536->576; 106 M weights, more than the L2
holds) run back to back at M activation rows, per weight form: int8 and w8a8 (our kernels), oneDNN-packed
fp32 and bf16, plain bf16 and fp32 through our few-rows kernel (models/few_rows_linear.py), and
bf16 / fp32 panels through our batch-invariant panel kernel (models/panel_linear.py). Forms are interleaved per repeat; prints
each form's median time per pass over all layers and the weight bytes streamed per second.

    python benches/linear_cold.py --rows 1 5 16 --repeats 7 --threads 1 [--forms int8 bf16 ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specinfer.models.few_rows_linear import few_rows_linear
from specinfer.models.int8_linear import Int8Weight, int8_linear
from specinfer.models.panel_linear import PanelWeight, panel_linear
from specinfer.models.packed_linear import pack_weight, packed_linear, packing_supported

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's GEMMs
LAYERS = 30
FORMS = ["int8", "w8a8", "bf16", "fp32", "bf16-kernel", "fp32-kernel", "bf16-panel", "fp32-panel"]


def build(form: str):
    """-> (list of (weight, in_features), linear fn, bytes, activation dtype)."""
    torch.manual_seed(0)
    weights, nbytes = [], 0
    for _ in range(LAYERS):
        for n, k in SHAPES:
            dense = torch.randn(n, k) * 0.05
            if form in ("int8", "w8a8"):
                w = Int8Weight(n, k)
                w.load(None, dense)
                if form == "w8a8":  # the tiled layout the W8A8 kernel reads
                    w.pack()
                nbytes += w.nbytes
            elif form.endswith("-panel"):  # our batch-invariant panel kernel
                w = PanelWeight(dense.to(torch.bfloat16 if form.startswith("bf16") else torch.float32))
                nbytes += w.nbytes
            elif form.endswith("-kernel"):  # plain dense weights through our few-rows kernel
                dtype = torch.bfloat16 if form.startswith("bf16") else torch.float32
                w = dense.to(dtype).contiguous()
                nbytes += w.numel() * w.element_size()
            else:
                dtype = torch.bfloat16 if form == "bf16" else torch.float32
                if not packing_supported(dtype):
                    raise SystemExit(f"oneDNN cannot pack {dtype} on this CPU")
                w = pack_weight(dense.to(dtype))
                nbytes += n * k * (2 if form == "bf16" else 4)
            weights.append((w, k))
    if form in ("int8", "w8a8"):
        return weights, int8_linear, nbytes, torch.float32
    if form.endswith("-panel"):
        return weights, panel_linear, nbytes, torch.bfloat16 if form.startswith("bf16") else torch.float32
    if form.endswith("-kernel"):
        return weights, few_rows_linear, nbytes, torch.bfloat16 if form.startswith("bf16") else torch.float32
    return weights, packed_linear, nbytes, torch.bfloat16 if form == "bf16" else torch.float32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16])
    ap.add_argument("--forms", nargs="+", default=FORMS, choices=FORMS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    built = {f: build(f) for f in args.forms}
    for m in args.rows:
        times = {f: [] for f in args.forms}
        for _ in range(args.repeats):
            for f, (weights, linear, _, dtype) in built.items():
                xs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
                t = time.perf_counter()
                for w, k in weights:
                    linear(xs[k], w)
                times[f].append(time.perf_counter() - t)
        for f in args.forms:
            med = statistics.median(times[f])
            print(f"rows {m:3d}  {f:11s}  {med * 1e3:7.2f} ms per pass  {built[f][2] / med / 1e9:6.2f} GB/s "
                  f"[{min(times[f]) * 1e3:.2f}-{max(times[f]) * 1e3:.2f} ms]")


if __name__ == "__main__":
    main()
