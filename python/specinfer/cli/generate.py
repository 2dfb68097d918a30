"""`specinfer generate`: offline generation from --prompt or a JSONL batch, optionally speculative."""
from __future__ import annotations

import argparse
import sys
import time

from specinfer.cli import options
from specinfer.cli.batch_file import BatchItem, OrderedWriter, read_batch
from specinfer.cli.errors import CliError

HELP = "generate text for prompts (--prompt or a JSONL --input), optionally with speculative decoding"
DESCRIPTION = HELP + """

Input JSONL (--input): one request per line,
  {"prompt": "text"} | {"prompt_token_ids": [1, 2, 3]} | {"messages": [{"role": "user", "content": "hi"}]}
with an optional "id" and per-request overrides of the sampling flags:
  max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, min_tokens, speculate.
Output JSONL (--out, or stdout): one object per input line, in order, with line, prompt, text,
token_ids, finish_reason, stop_reason and the acceptance counts (num_drafts, num_draft_tokens,
num_accepted_tokens, acceptance_rate); a line that could not run gets {"line": N, "error": ...}
and the exit status is 1. A single --prompt without --out streams its text to stdout.

Examples:
  specinfer generate smollm2-135m --chat --prompt "Fix the typo: teh cat" --method ngram -k 4
  specinfer generate qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --input prompts.jsonl --out out.jsonl
"""


def add_arguments(p) -> None:
    options.add_model_argument(p)
    g = p.add_argument_group("input and output")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    src.add_argument("--input", metavar="FILE", help="JSONL requests, one per line ('-' = stdin)")
    g.add_argument("--out", "--output", dest="output", metavar="FILE",
                   help="write JSONL results here (default: stdout); --output is the same flag")
    g.add_argument("--json", action="store_true", help="print JSONL even for a single --prompt")
    g.add_argument("--chat", action="store_true", help="wrap each text prompt as a user message in the "
                   "model's chat template")
    g.add_argument("--system", metavar="TEXT", help="system message for --chat prompts")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal and there are several prompts)")
    options.add_sampling_arguments(p)
    options.add_speculative_arguments(p)
    options.add_engine_arguments(p)


def run(args) -> int:
    # every check that needs no model comes first
    options.check_model(args.model)
    spec = options.speculative_config(args)
    base = options.sampling_params(args)
    engine_config = options.engine_config(args, spec)
    if args.system and not args.chat:
        raise CliError("--system needs --chat")
    source = args.input if args.input is not None else "--prompt"
    stream_text = args.input is None and len(args.prompt) == 1 and args.output is None and not args.json
    writer = None if stream_text else OrderedWriter(args.output)  # an unwritable path fails here
    items = []
    try:
        items = read_batch(args.input) if args.input is not None else [BatchItem(None, prompt=p) for p in args.prompt]
        for item in items:
            if item.error is None:
                _build_params(item, base)
            if item.error is not None:
                _report(source, item)
        gen = options.load_generator(engine_config)
        _tokenize_all(gen, items, args, source)
        elapsed = _generate(gen, items, writer, stream_text, _want_progress(args, items))
        if writer is not None:
            writer.commit()
    except BaseException as e:
        if writer is not None:
            if any(item.output is not None for item in items if isinstance(item, BatchItem)):
                n = writer.salvage(items)  # nothing finished is lost
                if writer.path not in (None, "-"):
                    print(f"specinfer generate: {type(e).__name__}: {n} of {len(items)} results written to "
                          f"{writer.path} (each names its input line); the rest did not finish", file=sys.stderr)
            else:
                writer.discard()
        raise
    _print_summary(items, elapsed, gen.spec_metrics() if spec is not None else None, spec)
    return 1 if any(item.error for item in items) else 0


def _build_params(item: BatchItem, base) -> None:
    import dataclasses

    overrides = dict(item.overrides)
    if isinstance(overrides.get("stop"), str):
        overrides["stop"] = (overrides["stop"],)
    try:
        item.params = dataclasses.replace(base, **overrides) if overrides else base
    except (ValueError, TypeError) as e:
        item.error = " ".join(str(e).split())


def _tokenize_all(gen, items: list[BatchItem], args, source: str) -> None:
    from specinfer.chat_template import ChatTemplate

    template = None
    for item in items:
        if item.error is not None:
            continue
        try:
            if item.messages is not None or args.chat and item.prompt is not None:
                template = template or ChatTemplate.for_model(gen.engine.loaded)
                messages = item.messages or ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": item.prompt}]
                item.prompt = template.render(messages)
                ids = template.encode(gen.tokenizer, messages)
                item.prompt_token_ids = gen.engine.validate(ids, item.params)
            else:
                item.prompt_token_ids = gen.engine.validate(
                    item.prompt if item.prompt is not None else item.prompt_token_ids, item.params)
        except ValueError as e:
            item.error = " ".join(str(e).split())
            _report(source, item)


def _generate(gen, items: list[BatchItem], writer, stream_text: bool, progress: bool) -> float:
    engine = gen.engine
    pending: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        if item.error is None:
            name = f"cli-{i}"
            engine.add_request(name, item.prompt, item.params, prompt_token_ids=item.prompt_token_ids)
            pending[name] = i
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(pending), desc="generate", unit="req", file=sys.stderr, dynamic_ncols=True)
    try:
        if writer is not None:
            writer.write_ready(items)
        while pending:
            for out in engine.step():
                i = pending.get(out.request_id)
                if i is None:
                    continue
                if stream_text and out.new_text:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
                if out.finished:
                    del pending[out.request_id]
                    items[i].output = out
                    if bar is not None:
                        bar.update(1)
            if writer is not None:
                writer.write_ready(items)
    except BaseException:
        for name in pending:
            engine.abort(name)
        raise
    finally:
        if bar is not None:
            bar.close()
    if stream_text:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return time.perf_counter() - t0


def _want_progress(args, items) -> bool:
    if args.progress is not None:
        return args.progress
    return len(items) > 1 and sys.stderr.isatty()


def _report(source: str, item: BatchItem) -> None:
    print(f"specinfer generate: error: {item.where(source)}: {item.error}", file=sys.stderr, flush=True)


def _print_summary(items: list[BatchItem], elapsed: float, metrics: dict | None, spec) -> None:
    done = [it.output for it in items if it.output is not None]
    failed = sum(1 for it in items if it.error is not None)
    n_gen = sum(len(o.token_ids) for o in done)
    n_prompt = sum(len(o.prompt_token_ids) for o in done)
    rate = n_gen / elapsed if elapsed > 0 else 0.0
    spec_text = options.format_spec_summary(metrics)
    if spec is not None:
        spec_text += f"  ({spec.method}, k={spec.num_speculative_tokens})"
    print(f"summary: {len(done)} request{'s' if len(done) != 1 else ''}" + (f" ({failed} failed)" if failed else "") +
          f", {n_prompt} prompt tokens, {n_gen} generated tokens in {elapsed:.2f} s = {rate:.1f} tokens/s; "
          f"{spec_text}", file=sys.stderr, flush=True)
