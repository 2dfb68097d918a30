"""Offline batched generation with n-gram (prompt lookup) speculative decoding.

The proposer guesses the next tokens by finding the latest n-gram of each request elsewhere in its
own prompt + output; it needs no extra model and shines when the answer copies from the input
(editing, refactoring, extraction, summaries with quotes).

    python examples/offline_ngram.py --model smollm2-135m -k 5
"""
import argparse

from specinfer import Generator, SamplingParams
from specinfer.chat_template import ChatTemplate

CODE = """def area(width, height):
    result = width * height
    return result
"""
REQUESTS = [
    f"Rename the variable `result` to `area_value` in this code and return the whole code.\n\n{CODE}",
    "Fix the spelling in this sentence: The qick brown fox jumpd over the lazy dog.",
    "Repeat this list in the same order: apples, pears, plums, cherries, grapes.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="pack name, HF directory or .gguf file")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    args = ap.parse_args()

    gen = Generator(args.model, max_model_len=args.max_model_len, speculative={
        "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": 1, "prompt_lookup_max": 4})
    # an instruct model wants its chat format: render each request through the model's template
    template = ChatTemplate.for_model(gen.engine.loaded)
    prompts = [template.encode(gen.tokenizer, [{"role": "user", "content": r}]) for r in REQUESTS]

    outputs = gen.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for request, out in zip(REQUESTS, outputs):
        print(f"### {request.splitlines()[0]}\n{out.text.strip()}")
        print(f"({len(out.token_ids)} tokens, {out.num_accepted_tokens}/{out.num_draft_tokens} draft tokens "
              f"accepted, finish: {out.finish_reason})\n")
    m = gen.spec_metrics()
    print(f"acceptance rate {m['acceptance_rate']:.3f}, mean acceptance length {m['mean_acceptance_length']:.2f}")


if __name__ == "__main__":
    main()
