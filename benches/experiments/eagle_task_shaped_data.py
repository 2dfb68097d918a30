"""The named EAGLE recipe trained on its distillation data plus task-shaped prompts (the bench's task
formats on standard-library modules the bench does not use: distill_data.task_shaped_texts),
written to OUT for `benches/experiments/eagle_estimate_bench_prompts.py --walk` and the engine bench.

    python benches/experiments/eagle_task_shaped_data.py OUT [--per-task 150] [--steps 3600]

The extra sequences (the float32-or-bf16 target's greedy continuations, as the named data) are
cached in OUT/task_shaped_data.pt. Run alone.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    from specinfer.platform.cpu import bf16_matmul_is_native

    native = "bfloat16" if bf16_matmul_is_native() else "float32"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--per-task", type=int, default=150)
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--data", default=str(Path.home() / ".cache/specinfer/heads" /
                                          f"distill-smollm2-135m{'' if native == 'float32' else '-' + native}.pt"))
    args = ap.parse_args()

    from specinfer.prompt_sets import prompt_encoder
    from specinfer.generator import Generator
    from specinfer.training import head_training
    from specinfer.training.distill_data import (DistillSequence, build_sequences, cached_sequences,
                                                   held_out_modules, task_shaped_texts)
    from specinfer.training.trained_heads import TRAINED_HEADS

    recipe = TRAINED_HEADS["smollm2-135m-eagle"]
    out = Path(args.out)
    seqs = [DistillSequence(**{**s, "aux": None}) for s in torch.load(args.data, weights_only=False)["seqs"]]
    texts = task_shaped_texts(held_out_modules(), args.per_task)
    t0 = time.monotonic()
    with Generator("smollm2-135m", max_num_seqs=64, dtype=native) as gen:
        enc = prompt_encoder(gen.engine.loaded, True)
        extra = cached_sequences(out / "task_shaped_data.pt",
                                 {"model": "smollm2-135m", "task_shaped": args.per_task, "aux": [], "dtype": native},
                                 lambda: build_sequences(gen, [list(enc(t)) for t, _ in texts], recipe.max_tokens))
    built = time.monotonic() - t0
    target = Generator("smollm2-135m", max_num_seqs=4).engine.loaded
    cfg = head_training.TrainConfig("eagle", steps=args.steps, seed=recipe.seed, draft_vocab_size=recipe.draft_vocab_size,
                                    ttt_steps=recipe.ttt_steps, lr_schedule=recipe.lr_schedule, train_dtype=native)
    t0 = time.monotonic()
    report = head_training.train(target, seqs + extra, out, cfg, progress=False)
    (out / "train_state.pt").unlink(missing_ok=True)
    print(json.dumps({"extra_sequences": len(extra), "data_seconds": round(built),
                      "train_seconds_with_estimate": round(time.monotonic() - t0), **report}))


if __name__ == "__main__":
    main()
