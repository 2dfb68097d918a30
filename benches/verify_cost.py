"""A verification run of 1 + k tokens against a decode step, isolated: the target's forward plus
its logits over T query rows per sequence (T = 1: a decode; T = 1 + k: a verification), at a fixed
context, per CPU engine option (backend:dtype[:quantization[:gemm]], as in engine_cpu_options.py).
Row counts are interleaved per repeat; prints the median ms per step and its ratio to T = 1.

The end-to-end bench's `verify/step` column divides whole runs (prefill steps included), so it
overstates a verification's cost; this measures the step itself, as the speculation policy's cost
model S(T) does.

    python benches/verify_cost.py --threads 1 --repeats 9 --rows 1 2 3 5 9 \\
        --methods cpu_native:float32,cpu_native:bfloat16,cpu_native:float32:int8,cpu_native:float32::few_rows
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.attention.kv_cache import allocate_kv_caches
from specinfer.models.model_runner import ModelRunner

from engine_cpu_options import make_generator


class StepTimer:
    """One method's model with its own KV over `batch` sequences of `ctx` tokens (prefilled once)."""

    def __init__(self, gen, batch: int, ctx: int, max_rows: int, block_size: int = 16):
        engine = gen.engine
        model = engine.loaded.model
        self.per_seq = math.ceil((ctx + max_rows) / block_size)
        kv = allocate_kv_caches(model, batch * self.per_seq, block_size, model.norm.dtype, engine.device)
        self.runner = ModelRunner(model, kv, engine.runner.backend)
        self.table = np.arange(batch * self.per_seq, dtype=np.int32).reshape(batch, self.per_seq)
        self.batch, self.ctx, self.block_size, self.device = batch, ctx, block_size, engine.device
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        self.tokens = torch.randint(0, vocab, (batch, ctx + max_rows), generator=g)
        for s in range(batch):  # prefill each sequence's context (one run each: bounded memory)
            self._step(self.table[s:s + 1], np.array([0]), np.array([ctx]), self.tokens[s, :ctx], all_logits=False)

    def _step(self, table, starts, lens, ids, all_logits: bool) -> None:
        attn, pos = attention_metadata_for_runs(table, starts, lens, self.block_size, self.device)
        hidden, _ = self.runner.forward(ids, torch.from_numpy(pos), attn)
        if all_logits:  # a verification scores every row
            self.runner.logits(hidden)
        else:  # a prefill samples its last row only
            self.runner.logits(hidden[-1:])

    def time(self, rows: int) -> float:
        """Seconds of one step of `rows` query tokens per sequence after the context."""
        ids = self.tokens[:, self.ctx:self.ctx + rows].reshape(-1)
        starts = np.full(self.batch, self.ctx)
        lens = np.full(self.batch, rows)
        t0 = time.perf_counter()
        self._step(self.table, starts, lens, ids, all_logits=True)
        return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="cpu_native:float32,cpu_native:bfloat16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = sorted(set(args.rows) | {1})
    print(f"batch {args.batch}, context {args.ctx}, {args.threads} thread(s), median of {args.repeats}")
    print("| method | " + " | ".join(f"T={r} ms" for r in rows) + " | " +
          " | ".join(f"T={r} / T=1" for r in rows if r > 1) + " |")
    print("|---" * (2 * len(rows)) + "|")
    for m in args.methods.split(","):
        timer = StepTimer(make_generator(args.model, m), args.batch, args.ctx, max(rows))
        for r in rows:  # warm-up: oneDNN primitives, kernel dispatch
            timer.time(r)
        times = {r: [] for r in rows}
        for _ in range(args.repeats):
            for r in rows:  # interleaved
                times[r].append(timer.time(r))
        med = {r: statistics.median(v) * 1e3 for r, v in times.items()}
        ratio = {r: statistics.median(a / b for a, b in zip(times[r], times[1])) for r in rows}
        print(f"| {m} | " + " | ".join(f"{med[r]:.2f}" for r in rows) + " | " +
              " | ".join(f"{ratio[r]:.3f}" for r in rows if r > 1) + " |", flush=True)
        del timer


if __name__ == "__main__":
    main()
