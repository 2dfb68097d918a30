"""Decode-only speed on the same GGUF file: specinfer (quantization="gguf", the blocks as stored)
against llama.cpp (llama-cpp-python, the same file), as shared/PEERS.md compares decode with
decode: per prompt, the time of a 1 + N token greedy run minus that of a 1-token run (the
prompt's prefill cancels), so N / (t(1 + N) - t(1)) tokens per second. Engines interleaved per
repeat, the same prompt token ids, one torch / llama.cpp thread count per row; the median of
the repeats and of their paired ratios are printed.

    python benches/gguf_decode_vs_llama_cpp.py --model smollm2-135m --threads 1 --threads 2
    python benches/gguf_decode_vs_llama_cpp.py --model qwen2.5-coder-1.5b --tokens 32 --repeats 3

Needs llama-cpp-python (docs/benchmarking.md); refuses to run without it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specinfer import Generator, SamplingParams
from specinfer.packs import resolve_pack

PROMPT = "def parse_config(path):\n    \"\"\"Read a TOML file and return a dict.\"\"\"\n"


def specinfer_run(gen, ids: list[int], n: int) -> float:
    t = time.perf_counter()
    gen.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def llama_run(llm, ids: list[int], n: int) -> float:
    llm.reset()
    t = time.perf_counter()
    out = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=False):
        out += 1
        if out >= n:
            break
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, action="append")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    import llama_cpp

    path = str(resolve_pack(a.model))
    print(f"{a.model} ({path}): decode-only tok/s, {a.tokens} tokens after a 1-token run, median of {a.repeats}")
    print("threads | specinfer gguf | llama.cpp | ratio (median of paired)")
    for threads in a.threads or [1]:
        torch.set_num_threads(threads)
        gen = Generator(path, max_model_len=1024, quantization="gguf")
        ids = gen.engine.tokenizer.encode(PROMPT).ids
        llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                              n_batch=512, seed=0, verbose=False)
        ours, theirs = [], []
        for _ in range(a.repeats + 1):  # the first round warms both
            s = a.tokens / (specinfer_run(gen, ids, a.tokens + 1) - specinfer_run(gen, ids, 1))
            l_ = a.tokens / (llama_run(llm, ids, a.tokens + 1) - llama_run(llm, ids, 1))
            ours.append(s)
            theirs.append(l_)
        ours, theirs = ours[1:], theirs[1:]
        ratio = statistics.median(o / t for o, t in zip(ours, theirs))
        print(f"{threads} | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | {ratio:.2f}x")
        llm.close()
        gen.close()


if __name__ == "__main__":
    main()
