"""Reading the speculation metrics: per engine (`gen.spec_metrics()`) and per request
(`RequestOutput.num_drafts / num_draft_tokens / num_accepted_tokens`), and what they predict.

Vocabulary: a verification checks k draft tokens; the accepted ones are kept and one more token
(recovered at the first rejection, or bonus when all are accepted) is always emitted.
  acceptance rate          accepted / draft tokens
  mean acceptance length   tokens emitted per verification, the extra token included (1..k+1)
  accepted per position    P(draft j accepted), j = 1..k
  system efficiency        emitted / (draft tokens + 1) summed over verifications

    python examples/spec_metrics.py --model smollm2-135m -k 4
"""
import argparse

from specinfer import Generator, SamplingParams
from specinfer.chat_template import ChatTemplate


def theoretical_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.: expected speedup at acceptance rate alpha, k drafts, draft/target cost ratio c."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="a draft model; default: n-gram lookup (cost ratio c = 0)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
    args = ap.parse_args()

    spec = {"method": "draft_model", "model": args.draft} if args.draft else {"method": "ngram"}
    gen = Generator(args.model, max_model_len=args.max_model_len, speculative={**spec, "num_speculative_tokens": args.num_speculative_tokens})
    template = ChatTemplate.for_model(gen.engine.loaded)
    requests = ["Copy this line exactly: alpha beta gamma delta epsilon zeta eta theta.",
                "Write one sentence about the sea."]  # a copying task and an open one
    prompts = [template.encode(gen.tokenizer, [{"role": "user", "content": r}]) for r in requests]
    outputs = gen.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))

    print("per request:")
    for r, o in zip(requests, outputs):
        print(f"  {r[:40]!r:44} {len(o.token_ids):4} tokens  {o.num_drafts:3} verifications  "
              f"{o.num_accepted_tokens}/{o.num_draft_tokens} accepted  rate {o.acceptance_rate:.2f}")

    m = gen.spec_metrics()
    print("\nengine:")
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                "mean_acceptance_length", "system_efficiency"):
        value = m[key]
        print(f"  {key:24} {value:.3f}" if isinstance(value, float) else f"  {key:24} {value}")
    print("  accepted per position   " + "  ".join(f"{p:.2f}" for p in m["accepted_per_position"]))
    total = m["propose_s"] + m["score_s"] + m["verify_s"] + m["overhead_s"]
    print("  time split              " + "  ".join(
        f"{name} {m[f'{name}_s'] / total:.0%}" for name in ("propose", "score", "verify", "overhead")) if total else "")
    c = 0.0 if not args.draft else 0.3  # ngram drafts cost nothing; a draft model costs a fraction of the target
    print(f"\ntheoretical speedup at alpha={m['acceptance_rate']:.2f}, k={m['num_speculative_tokens']}, c={c}: "
          f"{theoretical_speedup(m['acceptance_rate'], m['num_speculative_tokens'], c):.2f}x")


if __name__ == "__main__":
    main()
