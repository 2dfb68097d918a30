"""An EAGLE head's acceptance on the bench's own prompts: train-heads' held-out estimator beside
what the engine measures, per task (is a gap between the held-out estimate and the bench the
prompts' or the engine's?).

    python benches/experiments/head_estimate_vs_engine.py HEAD_DIR_OR_NAME [--prompts 4] [--max-tokens 64]

For each task: the target's greedy continuations of the bench's first prompts (what the bench
measures), the estimator's chain acceptance at 12 positions per sequence (eagle_acceptance_estimate,
teacher-forced history, as train-heads reports), and the engine's mean acceptance length with
k = 4 on the same prompts. One thread; run alone.
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from specinfer import Generator, SamplingParams
    from specinfer.prompt_sets import prompt_encoder
    from specinfer.prompt_sets import load_prompt_sets
    from specinfer.training.distill_data import build_sequences
    from specinfer.training.eagle_training import EagleTrainer, eagle_acceptance_estimate
    from specinfer.training.head_training import _dense_lm_head
    from specinfer.training.trained_heads import resolve_head

    head = resolve_head(args.head, "eagle", args.model)
    gen = Generator(args.model, max_num_seqs=8)
    eng = Generator(args.model, max_num_seqs=8, speculative={"method": "eagle", "model": head,
                                                             "num_speculative_tokens": 4, "policy": "fixed"})
    target = gen.engine.loaded
    enc = prompt_encoder(target, True)
    rows = []
    for task, ps in load_prompt_sets(limit=args.prompts).items():
        prompts = [enc(p) for p in ps.prompts]
        seqs = build_sequences(gen, prompts, args.max_tokens)
        trainer = EagleTrainer(target, 4, 0, _dense_lm_head(target), seqs)
        trainer.load_export(head)
        est = eagle_acceptance_estimate(trainer, seqs, 4, per_seq=12)
        before = eng.spec_metrics()
        eng.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
        after = eng.spec_metrics()
        steps = after["num_drafts"] - before["num_drafts"]
        emitted = (after["num_accepted_tokens"] - before["num_accepted_tokens"]) + steps
        rows.append({"task": task, "estimate": round(est["mean_acceptance_length"], 3),
                     "engine": round(emitted / max(steps, 1), 3), "positions": est["positions"]})
        print(json.dumps(rows[-1]), flush=True)
    n = len(rows)
    print(json.dumps({"task": "all", "estimate": round(sum(r["estimate"] for r in rows) / n, 3),
                      "engine": round(sum(r["engine"] for r in rows) / n, 3)}))


if __name__ == "__main__":
    main()
