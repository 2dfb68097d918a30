"""Offline batched generation with a draft model: a small LM proposes k tokens, the target
verifies them all in one forward pass (lossless rejection sampling: the output distribution is
the target's, and greedy output is token for token the target's own).

The draft must share the target's tokenizer, e.g. Qwen2.5-Coder 0.5B drafting for 1.5B:

    python examples/offline_draft_model.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b -k 4
"""
import argparse
import time

from specinfer import Generator, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="target: pack name, HF directory or .gguf")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft: pack name, HF directory or .gguf")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (still lossless)")
    args = ap.parse_args()

    gen = Generator(args.model, max_model_len=args.max_model_len, speculative={
        "method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)

    t0 = time.perf_counter()
    outputs = gen.generate(PROMPTS, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(PROMPTS, outputs):
        print(f"{prompt}{out.text}\n# ({len(out.token_ids)} tokens, acceptance rate {out.acceptance_rate:.2f})\n")
    m = gen.spec_metrics()
    n = sum(len(o.token_ids) for o in outputs)
    print(f"{n} tokens in {elapsed:.1f} s ({n / elapsed:.1f} tokens/s); acceptance rate {m['acceptance_rate']:.3f}, "
          f"mean acceptance length {m['mean_acceptance_length']:.2f} (k={args.num_speculative_tokens})")


if __name__ == "__main__":
    main()
