"""`specinfer demo`: the README's main job.

The same input-grounded editing prompts (rendered through SmolLM2-135M-Instruct's own chat
template) are decoded greedily with and without speculative decoding (n-gram prompt lookup by
default). The greedy outputs must be identical token for token; the demo prints the text, the
acceptance statistics and the measured speedup, and exits 1 if any output differs.

With the model-free n-gram proposer the plain run uses the same engine with
`SamplingParams(speculate=False)` (one model load instead of two; a non-speculating request is a
plain decode); with a draft model the plain run gets its own engine without speculation.
"""
from __future__ import annotations

import time

from specinfer.cli.errors import CliError

HELP = "speculative vs plain decoding on SmolLM2-135M: identical greedy text, measured speedup"
DESCRIPTION = __doc__

_CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

_PASSAGE = ("The Rust scheduler keeps every reqest's state: the tokns it has, the blocks of the paged KV "
            "cache it owns, and the draft tokns waiting for verification. Each step it hands the Python "
            "engine one flat batch, and after the forward pass it appends the accepted tokns and rolls "
            "back the rejected ones.")

_EMAIL = ("Hi Sam,\n\nThe team meeting moved to Tuesday at 10am. Please bring the slides for Tuesday, and "
          "send the agenda by Monday evening. If Tuesday does not work for you, tell me today.\n\nThanks,\nAlex")

# user messages: editing tasks grounded in their input, so the answer copies long spans of it
MESSAGES = [
    "Rename the variable `total` to `running_sum` in this Python code and return the whole code.\n\n"
    f"```python\n{_CODE}```",
    f"Fix the spelling mistakes in this text and return the corrected text:\n\n{_PASSAGE}",
    f"Replace every 'Tuesday' with 'Thursday' in this email and return the whole email.\n\n{_EMAIL}",
]


# a fixed KV pool (128 blocks of 16 tokens: one 1024-token request, or the three prompts at once)
# rather than one sized from free memory, so the demo runs the same on a busy machine
_ENGINE = dict(max_model_len=1024, num_kv_blocks=128)


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="target model (pack name, HF directory or .gguf; "
                   "default: smollm2-135m)")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model"], help="proposer (default: ngram)")
    p.add_argument("--draft-model", dest="draft", default=None, metavar="MODEL",
                   help="draft model for --method draft_model")
    from specinfer.cli.options import add_renamed_flag

    add_renamed_flag(p, "--draft", "--draft-model MODEL (llama.cpp's --draft is a token count: -k here)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=5, metavar="K",
                   help="draft tokens per verification (default: 5)")
    p.add_argument("--max-tokens", type=int, default=160, metavar="N", help="tokens per prompt at most "
                   "(default: 160)")
    p.add_argument("--batch", action="store_true", help="run the prompts as one batch instead of one by one")
    p.add_argument("--threads", default="auto", metavar="N|auto", help="torch CPU threads; auto (default) uses "
                   "the cores the load average leaves idle, since busy cores make OpenMP threads wait on each other")


def _threads(value: str, default: int) -> int:
    if value == "auto":
        import os

        try:
            idle = (os.cpu_count() or 1) - round(os.getloadavg()[0])
        except OSError:  # no load average on this platform
            return default
        return max(1, min(default, idle))
    if not value.isdigit() or int(value) < 1:
        raise CliError(f"--threads must be 'auto' or an integer >= 1 (got {value!r})")
    return int(value)


def _timed(gen, prompts, params):
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - t0


def _side_by_side(plain, plain_params, fast, params, prompts, batch: bool):
    """Plain and speculative runs interleaved prompt by prompt (or one batch each), so that a
    noisy machine slows both alike: (plain outputs, plain seconds, spec outputs, spec seconds)."""
    groups = [prompts] if batch else [[p] for p in prompts]
    base, spec, t_base, t_spec = [], [], 0.0, 0.0
    for group in groups:
        outs, dt = _timed(plain, group, plain_params)
        base += outs
        t_base += dt
        outs, dt = _timed(fast, group, params)
        spec += outs
        t_spec += dt
    return base, t_base, spec, t_spec


def run(args) -> int:
    import dataclasses

    from specinfer.cli.options import check_model
    from specinfer.spec_decode.config import SpeculativeConfig

    check_model(args.model)
    check_model(args.draft, "draft model")
    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                             model=args.draft if args.method == "draft_model" else None)
    if args.draft and args.method != "draft_model":
        raise CliError("--draft-model is only used by --method draft_model")
    if args.threads != "auto":
        _threads(args.threads, 1)
    import torch

    from specinfer import Generator, SamplingParams
    from specinfer.chat_template import ChatTemplate

    torch.set_num_threads(_threads(args.threads, torch.get_num_threads()))

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    print(f"loading {args.model} ...", flush=True)
    fast = Generator(args.model, speculative=spec, **_ENGINE)
    if spec.method == "ngram":
        plain, plain_params = fast, dataclasses.replace(params, speculate=False)
    else:
        plain, plain_params = Generator(args.model, **_ENGINE), params
    template = ChatTemplate.for_model(fast.engine.loaded)
    prompts = [template.encode(fast.tokenizer, [{"role": "user", "content": m}]) for m in MESSAGES]
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {len(prompts)} prompts, greedy, max {args.max_tokens} "
          f"tokens each, {torch.get_num_threads()} torch thread(s)", flush=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    _side_by_side(plain, dataclasses.replace(warm, speculate=plain_params.speculate), fast, warm, prompts[:1], False)

    base, t_base, spec_outs, t_spec = _side_by_side(plain, plain_params, fast, params, prompts, args.batch)
    for i, (a, b) in enumerate(zip(base, spec_outs)):
        print(f"\n--- prompt {i + 1}: {MESSAGES[i].splitlines()[0]}\n--- answer ({len(b.token_ids)} tokens, "
              f"{b.num_accepted_tokens}/{b.num_draft_tokens} draft tokens accepted"
              f"{'' if a.token_ids == b.token_ids else ', DIFFERS from plain decoding'}):\n{b.text.strip()}")
    same = all(a.token_ids == b.token_ids for a, b in zip(base, spec_outs))
    n_tokens = sum(len(o.token_ids) for o in base)
    drafts = sum(o.num_drafts for o in spec_outs)
    draft_tokens = sum(o.num_draft_tokens for o in spec_outs)
    accepted = sum(o.num_accepted_tokens for o in spec_outs)
    rate = accepted / draft_tokens if draft_tokens else 0.0
    mean_len = (accepted + drafts) / drafts if drafts else 0.0  # emitted per verification, bonus included
    print("\n=== summary ===")
    print(f"greedy outputs identical with and without speculation: {same}")
    print(f"method={spec.method} k={spec.num_speculative_tokens}  acceptance rate={rate:.3f}  "
          f"mean acceptance length={mean_len:.2f}  ({accepted}/{draft_tokens} draft tokens in {drafts} verifications)")
    print(f"plain: {n_tokens} tokens in {t_base:.1f} s = {n_tokens / t_base:.1f} tok/s   "
          f"speculative: {t_spec:.1f} s = {n_tokens / t_spec:.1f} tok/s   speedup: {t_base / t_spec:.2f}x")
    print(f"total time {time.perf_counter() - t0:.1f} s (after imports)")
    return 0 if same else 1
