"""A multi-turn chat in a few lines: the model's own chat template, speculative decoding, streamed
tokens. Type a message per line; /exit or end of input (Ctrl-D) leaves. Works through a pipe:

    printf 'Hi!\\nWhat is 2 + 2?\\n' | python examples/chat.py --model smollm2-135m
"""
import argparse
import sys

from specinfer import Generator, SamplingParams
from specinfer.chat_template import ChatTemplate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="a draft model (same tokenizer); default: n-gram lookup")
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    spec = {"method": "draft_model", "model": args.draft} if args.draft else {"method": "ngram"}
    gen = Generator(args.model, max_model_len=args.max_model_len, speculative={**spec, "num_speculative_tokens": 4})
    template = ChatTemplate.for_model(gen.engine.loaded)  # ChatML if the model ships no template
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    for line in sys.stdin:
        if line.strip() == "/exit":
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        prompt_ids = template.encode(gen.tokenizer, messages)  # add_generation_prompt=True
        reply = ""
        for out in gen.stream([prompt_ids], params):
            print(out.new_text, end="", flush=True)
            reply = out.text
        print()
        messages.append({"role": "assistant", "content": reply.strip()})


if __name__ == "__main__":
    main()
