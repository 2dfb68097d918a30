"""A draft with another tokenizer: SmolLM2-135M (49k vocabulary) drafting for Qwen2.5-Coder-1.5B
(152k), against Qwen2.5-Coder-0.5B (the target's own tokenizer) and no speculation. Batch 1,
greedy, code-completion prompts through the target's chat template, k = 4, policy fixed (the
acceptance per position is the question). One engine at a time (memory), --repeats runs each;
speedup = median tok/s over the median without speculation.

    python benches/cross_vocab_draft.py --prompts 4 --max-tokens 64 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from specinfer import Generator, SamplingParams
from specinfer.prompt_sets import prompt_encoder
from specinfer.prompt_sets import load_prompt_set

TARGET = "qwen2.5-coder-1.5b"
DRAFTS = {"none": None, "qwen-0.5b (same tokenizer)": "qwen2.5-coder-0.5b",
          "smollm2-135m (other tokenizer)": "smollm2-135m"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args(argv)
    import gc

    rates, metrics, outputs = {}, {}, {}
    prompts = None
    for name, draft in DRAFTS.items():  # one engine at a time: three 1.5B targets do not fit in 24 GB
        spec = None if draft is None else {"method": "draft_model", "model": draft,
                                           "num_speculative_tokens": args.k, "policy": "fixed"}
        g = Generator(TARGET, max_model_len=1024, speculative=spec)
        if prompts is None:
            encode = prompt_encoder(g.engine.loaded, True)
            prompts = [encode(p) for p in load_prompt_set("code_completion").prompts[:args.prompts]]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        g.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm up
        rates[name] = []
        for _ in range(args.repeats):
            g.reset_metrics()
            t0, tokens, outs = time.perf_counter(), 0, []
            for p in prompts:
                o = g.generate([p], params, use_tqdm=False)[0]
                tokens += len(o.token_ids)
                outs.append(o.token_ids)
            rates[name].append(tokens / (time.perf_counter() - t0))
            metrics[name], outputs[name] = g.spec_metrics(), outs
        g.close()
        del g
        gc.collect()
    gens = DRAFTS
    base = rates["none"]
    for name in gens:
        m = metrics[name]
        row = {"draft": name, "tok_s": round(statistics.median(rates[name]), 2),
               "speedup": round(statistics.median(rates[name]) / statistics.median(base), 3),
               "same_output_as_none": outputs[name] == outputs["none"]}
        if name != "none":
            row.update(mean_acceptance_length=round(m["mean_acceptance_length"], 3),
                       acceptance_rate=round(m["acceptance_rate"], 3),
                       accepted_per_position=[round(x, 3) for x in m["accepted_per_position"]])
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
