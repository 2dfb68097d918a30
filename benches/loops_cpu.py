"""The step loops on the CPU itself, no modeled device (issue 38): a one-layer, 32-wide random
Llama whose forward (~0.1-0.3 ms) runs on the engine's forward thread, so the host's Python and
the "device" share the GIL and two cores. Tokens/s of the serial loop, the overlapped loop with
each step scheduled by the next call (`schedule_ahead=False`) and the default (plain steps
scheduled ahead, n-gram steps launched right after the update; a draft model's proposals launched
on the forward thread in both overlapped loops), methods and loops interleaved, medians over
repeats; every loop's tokens are checked equal. The draft model is the target's weights plus
noise (as large as the target: its forwards cost what the target's do).

    python benches/loops_cpu.py --batch 32 --repeats 7
    python benches/loops_cpu.py --batch 1 --repeats 7
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_bench_setup import add_workload_arguments, build_tiny_llama, repetitive_prompts  # noqa: E402
from specinfer import Generator, SamplingParams  # noqa: E402

LOOPS = {"serial": dict(overlap_steps=False), "next call": dict(schedule_ahead=False), "default": {}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap, repeats=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    models = Path(tempfile.mkdtemp())
    build_tiny_llama(models / "target")
    build_tiny_llama(models / "draft", base=models / "target", perturb=0.02)
    prompts = repetitive_prompts(args.batch, args.prompt_len)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    methods = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "policy": "fixed"},
               "draft_model": {"method": "draft_model", "model": str(models / "draft"),
                               "num_speculative_tokens": args.k, "policy": "fixed"}}
    gens = {(m, loop): Generator(str(models / "target"), speculative=spec, enable_prefix_caching=False,
                                 max_model_len=args.prompt_len + args.new_tokens + 16,
                                 num_kv_blocks=args.batch * 16 + 64, **kw)
            for m, spec in methods.items() for loop, kw in LOOPS.items()}
    outs = {key: [o.token_ids for o in g.generate(prompts, params, use_tqdm=False)] for key, g in gens.items()}
    for m in methods:
        for loop in LOOPS:
            assert outs[(m, loop)] == outs[(m, "serial")], f"{m}: {loop} disagrees with the serial loop"
    walls = {key: [] for key in gens}
    for _ in range(args.repeats):
        for key, g in gens.items():
            t = time.perf_counter()
            g.generate(prompts, params, use_tqdm=False)
            walls[key].append(time.perf_counter() - t)
    tokens = args.batch * args.new_tokens
    print(f"batch {args.batch}, prompts {args.prompt_len}, new tokens {args.new_tokens}, k {args.k}; tokens/s, "
          f"median of {args.repeats}")
    print("| method | " + " | ".join(LOOPS) + " | default / next call |")
    print("|---|" + "---:|" * (len(LOOPS) + 1))
    for m in methods:
        tps = {loop: tokens / statistics.median(walls[(m, loop)]) for loop in LOOPS}
        print(f"| {m} | " + " | ".join(f"{tps[loop]:.0f}" for loop in LOOPS) +
              f" | {tps['default'] / tps['next call']:.3f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
