"""`specinfer demo`: the README's main job. The same input-grounded prompts on SmolLM2-135M
with and without speculative decoding (n-gram prompt lookup by default); greedy outputs must be
identical; prints the text, the acceptance statistics and the measured speedup."""
from __future__ import annotations

import time

HELP = "speculative vs plain decoding on SmolLM2-135M: identical greedy text, measured speedup"

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

PROMPTS = [
    "<|im_start|>user\nAdd a docstring to this Python function and return the whole function.\n\n"
    + _CODE + "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nRename the variable `total` to `running_sum` in this code and print the result.\n\n"
    + _CODE + "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nCopy this text exactly, then summarize it in one sentence: The quick brown fox jumps "
    "over the lazy dog. The dog does not react, because the dog is asleep in the warm afternoon sun, and "
    "the fox runs on into the forest.<|im_end|>\n<|im_start|>assistant\n",
]


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="target model (pack name, HF directory or .gguf)")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    p.add_argument("--draft", default=None, help="draft model for --method draft_model")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--batch", action="store_true", help="run the prompts as one batch instead of one by one")


def _run(gen, prompts, params, batch: bool):
    t0 = time.perf_counter()
    if batch:
        outs = gen.generate(prompts, params, use_tqdm=False)
    else:
        outs = [gen.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return outs, time.perf_counter() - t0


def run(args) -> int:
    import torch

    from specinfer import Generator, SamplingParams

    torch.set_num_threads(max(1, torch.get_num_threads()))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft_model":
        spec["model"] = args.draft
    print(f"loading {args.model} ...", flush=True)
    plain = Generator(args.model, max_model_len=2048)
    fast = Generator(args.model, max_model_len=2048, speculative=spec)
    _run(plain, PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), False)  # warm-up
    _run(fast, PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0), False)
    fast.engine.metrics.__init__(args.num_speculative_tokens)
    base, t_base = _run(plain, PROMPTS, params, args.batch)
    spec_outs, t_spec = _run(fast, PROMPTS, params, args.batch)
    n_tokens = sum(len(o.token_ids) for o in base)
    for i, (a, b) in enumerate(zip(base, spec_outs)):
        print(f"\n--- prompt {i + 1} ({len(b.token_ids)} tokens, {b.num_accepted_tokens}/{b.num_draft_tokens} "
              f"drafts accepted) ---\n{b.text.strip()}")
    same = all(a.token_ids == b.token_ids for a, b in zip(base, spec_outs))
    m = fast.spec_metrics()
    print("\n=== summary ===")
    print(f"greedy outputs identical with and without speculation: {same}")
    print(f"method={args.method} k={args.num_speculative_tokens}  acceptance rate={m['acceptance_rate']:.3f}  "
          f"mean acceptance length={m['mean_acceptance_length']:.2f}  system efficiency={m['system_efficiency']:.3f}")
    print(f"plain: {n_tokens / t_base:.1f} tok/s   speculative: {n_tokens / t_spec:.1f} tok/s   "
          f"speedup: {t_base / t_spec:.2f}x")
    return 0 if same else 1
