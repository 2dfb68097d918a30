"""`specinfer bench CONFIG_OR_PRESET --out DIR` (also `python -m specinfer.bench`)."""
from __future__ import annotations

import argparse
import sys

HELP = "run a benchmark config or preset and write results.json plus PNG plots"
EPILOG = """presets: {presets}; serving load (concurrent streaming clients against `specinfer serve`):
{load_presets}

A config is a JSON object with the keys of specinfer.bench.config.BenchConfig: model, methods
(engine specinfer / hf / vllm / llama_cpp; speculative dict, dtype, quantization, gguf_type,
...), tasks (prompt sets: code_completion, code_editing, summarization, qa, chat, or mixed),
num_prompts, batch_sizes, max_tokens, repeats, dtype, threads. Methods are measured
interleaved over repeats; speedups are medians of ratios against the no-speculation baseline of
the same run; greedy runs also print each method's agreement with the baseline's tokens."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specinfer.bench.config import PRESETS
    from specinfer.bench.load_config import LOAD_PRESETS

    p.epilog = EPILOG.format(presets=", ".join(sorted(PRESETS)), load_presets=", ".join(sorted(LOAD_PRESETS)))
    p.add_argument("config", metavar="CONFIG_OR_PRESET", help="a preset name or a JSON config file")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for results.json and the PNG plots")
    p.add_argument("--model", help="override the config's target model")
    p.add_argument("--repeats", type=int, help="override the number of repeats")
    p.add_argument("--max-tokens", type=int, help="override max_tokens")
    p.add_argument("--num-prompts", type=int, help="override prompts per task")
    p.add_argument("--threads", type=int, help="override torch threads")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="override dtype")
    p.add_argument("--no-plots", action="store_true", help="write results.json only")
    p.add_argument("--concurrency", help="load benchmarks (serve-load): override the client counts, e.g. 1,8,32")
    p.add_argument("--quiet", action="store_true", help="no per-run log lines")


def run(args) -> int:
    from specinfer.bench.load_config import is_load_config

    if is_load_config(args.config):
        return _run_load(args)
    from pathlib import Path

    from specinfer.bench.config import load_config
    from specinfer.bench.runner import run_benchmark
    from specinfer.bench.table import format_agreement, format_table

    try:
        cfg = load_config(args.config, model=args.model, repeats=args.repeats, max_tokens=args.max_tokens,
                          num_prompts=args.num_prompts, threads=args.threads, dtype=args.dtype,
                          plots=False if args.no_plots else None)
    except (ValueError, TypeError) as e:
        print(f"specinfer bench: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        print(f"specinfer bench: error: cannot write to {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = run_benchmark(cfg, out, log=log)
    print(format_table(results))
    agreement = format_agreement(results)
    if agreement:
        print("\n" + agreement)
    print(f"\nmachine: {results['machine']['cpu_model']}, {results['machine']['cpu_count']} cores, "
          f"torch {results['machine']['torch']} ({results['machine']['torch_threads']} threads), "
          f"load {results['machine']['load_average_start']} -> {results['machine']['load_average_end']}")
    print(f"wrote {out / 'results.json'}" + "".join(f", {p}" for p in results.get("plots", [])))
    if results.get("plots_error"):
        print(f"plots not written: {results['plots_error']}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specinfer.bench", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def _run_load(args) -> int:
    """A serving load benchmark (a LOAD_PRESETS name or a JSON config with "kind": "serve_load")."""
    from pathlib import Path

    from specinfer.bench.load_config import load_load_config
    from specinfer.bench.load_runner import format_load_table, run_load_benchmark

    try:
        concurrency = None
        if args.concurrency:
            concurrency = [int(c) for c in args.concurrency.split(",")]
        cfg = load_load_config(args.config, model=args.model, repeats=args.repeats, max_tokens=args.max_tokens,
                               threads=args.threads, dtype=args.dtype, concurrency=concurrency)
    except (ValueError, TypeError) as e:
        print(f"specinfer bench: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"specinfer bench: error: cannot write to {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = run_load_benchmark(cfg, out, log=log)
    print(format_load_table(results))
    print(f"wrote {out / 'results.json'}")
    bad = [r for r in results["rows"] if r["lost"] or r["leaked_blocks"]]
    return 1 if bad else 0
