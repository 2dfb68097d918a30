"""Batch-1 decode on a GGUF file run as stored (quantization="gguf") against the memory bandwidth
of the machine: how many bytes of stored weights a decode step reads per second, next to what
one core (or `--threads` cores) can stream from memory at all.

- bandwidth: the best of `--repeats` reads of a 1 GiB float32 buffer (torch `sum` on the given
  threads: one pass, nothing written), in GB/s;
- decode: the model's forward at one new token over a short context (the engine's ModelRunner,
  logits included), median over `--steps` steps, interleaved repeats; the weights read per step
  are every stored GEMM weight once (q|k|v, o, gate|up, down, the LM head), reported as GB/s
  and as a share of the measured bandwidth (issue 40 asks >= 70 % of one core's).

    python benches/gguf_bandwidth.py --model smollm2-135m --threads 1
    python benches/gguf_bandwidth.py --model qwen2.5-coder-1.5b --threads 1 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specinfer import Generator
from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.attention.kv_cache import allocate_kv_caches
from specinfer.models.model_runner import ModelRunner


def read_bandwidth(threads: int, repeats: int, gib: float = 1.0) -> float:
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        float(buf.sum())
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def gemm_bytes(model) -> int:
    seen, total = set(), 0
    weights = [model.lm_head] + [getattr(layer, n) for layer in model.layers for n in layer.gemm_weight_names()]
    for layer in model.layers:
        if layer.moe is not None:
            weights += layer.moe.gemm_weights()
    for w in weights:
        if id(w) not in seen:
            seen.add(id(w))
            total += w.nbytes
    return total


class DecodeTimer:
    def __init__(self, gen, ctx: int = 64, block_size: int = 16):
        engine = gen.engine
        model = engine.loaded.model
        per_seq = (ctx + 1 + block_size - 1) // block_size
        kv = allocate_kv_caches(model, per_seq, block_size, model.norm.dtype, engine.device)
        self.runner = ModelRunner(model, kv, engine.runner.backend)
        self.table = np.arange(per_seq, dtype=np.int32).reshape(1, per_seq)
        self.ctx, self.block_size, self.device = ctx, block_size, engine.device
        self.step(ctx, prefill=True)

    def step(self, n: int, prefill: bool = False) -> float:
        start = 0 if prefill else self.ctx
        attn, pos = attention_metadata_for_runs(self.table, np.array([start]), np.array([n]), self.block_size,
                                                self.device)
        ids = torch.randint(3, 1000, (n,))
        t = time.perf_counter()
        hidden, _ = self.runner.forward(ids, torch.from_numpy(pos), attn)
        self.runner.logits(hidden[-1:])
        return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, action="append", help="torch threads (repeatable; default 1)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    gen = Generator(a.model, max_model_len=256, quantization="gguf")
    model = gen.engine.loaded.model
    nbytes = gemm_bytes(model)
    timer = DecodeTimer(gen)
    print(f"{a.model}: stored GEMM weights {nbytes / 1e6:.1f} MB read per decode step")
    print("threads | read bandwidth GB/s | decode ms/step | tok/s | weights GB/s | share of bandwidth")
    for threads in a.threads or [1]:
        bw = read_bandwidth(threads, a.repeats)
        torch.set_num_threads(threads)
        times = []
        for _ in range(a.repeats):
            timer.step(1)  # warm
            times += [timer.step(1) for _ in range(a.steps)]
        ms = statistics.median(times) * 1e3
        rate = nbytes / (ms / 1e3) / 1e9
        print(f"{threads} | {bw:.1f} | {ms:.2f} | {1e3 / ms:.1f} | {rate:.1f} | {rate / bw:.0%}")


if __name__ == "__main__":
    main()
