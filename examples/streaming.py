"""Streaming: print tokens as soon as the engine emits them. With speculative decoding a step can
emit several tokens at once (the accepted drafts plus one); --show-steps marks each step's burst.

    python examples/streaming.py --model smollm2-135m --show-steps
"""
import argparse
import sys

from specinfer import Generator, SamplingParams
from specinfer.chat_template import ChatTemplate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", default="Repeat this sentence, then translate it to French: "
                    "The library opens at nine and closes at five.")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    ap.add_argument("--show-steps", action="store_true", help="print [n] after each step's tokens")
    args = ap.parse_args()

    gen = Generator(args.model, max_model_len=args.max_model_len,
                    speculative={"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens})
    ids = ChatTemplate.for_model(gen.engine.loaded).encode(gen.tokenizer, [{"role": "user", "content": args.prompt}])

    steps = 0
    for out in gen.stream([ids], SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
        steps += 1
        sys.stdout.write(out.new_text + (f"[{len(out.new_token_ids)}]" if args.show_steps else ""))
        sys.stdout.flush()
        if out.finished:
            print(f"\n\n{len(out.token_ids)} tokens in {steps} steps ({len(out.token_ids) / steps:.2f} tokens/step), "
                  f"finish: {out.finish_reason}")


if __name__ == "__main__":
    main()
