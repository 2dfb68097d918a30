"""Speculative vs non-speculative output on SmolLM2-135M, with and without batch_invariant=True:
are the greedy tokens and every logprob the same bits? (three prompts, ngram k=4, 48 tokens)

    python benches/batch_invariant_check.py --dtype bfloat16
"""
from __future__ import annotations

import argparse

import torch

from specinfer import Generator, SamplingParams

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
           '    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n',
           "The capital of France is", "Once upon a time, there was a"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)
    for invariant in (False, True):
        kw = dict(dtype=args.dtype, batch_invariant=invariant)
        plain = Generator(args.model, **kw).generate(PROMPTS, params, use_tqdm=False)
        spec = Generator(args.model, speculative={"method": "ngram", "num_speculative_tokens": 4},
                         **kw).generate(PROMPTS, params, use_tqdm=False)
        tokens = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
        logprobs = sum(a.logprobs == b.logprobs for a, b in zip(plain, spec))
        print(f"{args.dtype} batch_invariant={invariant}: tokens equal {tokens}/{len(PROMPTS)}, "
              f"logprobs equal {logprobs}/{len(PROMPTS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
