"""The named EAGLE head's held-out-style estimate (greedy chains of 4 against the target's own
continuation) on the bench's prompts (the first 4 of each task, 64 tokens, float32 target), beside
the estimate on the training distribution's held-out sequences: separates "other text" from "the
engine" when the engine's acceptance length falls short of the held-out estimate.

    python benches/experiments/eagle_estimate_bench_prompts.py [HEAD_DIR ...] [--prompts 4] [--max-tokens 64] [--per-seq 40] [--walk]

HEAD_DIR: default the newest cached smollm2-135m-eagle head; several are measured on the same
sequences. `--prompts 8 --max-tokens 96 --per-seq 100` uses every prompt the training data leaves
out (distill_data.EVAL_PROMPTS_PER_TASK) and every continuation position: the finer comparison.
`--walk`: chains start where the engine's greedy steps would start them (after each chain's
accepted drafts and bonus token), so the estimate is the engine's mean acceptance length if the
engine drafts as the dense recomputation does.
Run alone.
"""
import argparse
from pathlib import Path

import torch

from specinfer.prompt_sets import prompt_encoder
from specinfer.generator import Generator
from specinfer.training import head_training
from specinfer.training.distill_data import _bench_rows, build_sequences
from specinfer.training.eagle_training import EagleTrainer, eagle_acceptance_estimate

ap = argparse.ArgumentParser()
ap.add_argument("heads", nargs="*")
ap.add_argument("--prompts", type=int, default=4)
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--per-seq", type=int, default=40)
ap.add_argument("--walk", action="store_true",
                help="chains where the engine's greedy steps start them (eagle_acceptance_estimate(walk=True))")
args = ap.parse_args()
torch.set_num_threads(2)
head_dirs = [Path(h) for h in args.heads] or [max(
    (Path.home() / ".cache/specinfer/heads").glob("smollm2-135m-eagle-*"), key=lambda p: p.stat().st_mtime)]
gen = Generator("smollm2-135m", max_num_seqs=8)
target = gen.engine.loaded
encode = prompt_encoder(target, True)
by_task: dict[str, list] = {}
for row in _bench_rows():
    if len(by_task.setdefault(row["task"], [])) < args.prompts:
        by_task[row["task"]].append(list(encode(row["prompt"])))
lm = head_training._dense_lm_head(target)
seqs_by_task = {task: build_sequences(gen, prompts, args.max_tokens) for task, prompts in by_task.items()}
for head_dir in head_dirs:
    lengths, weights = [], []
    for task, seqs in seqs_by_task.items():
        head = EagleTrainer(target, 4, 0, lm, seqs)
        head.load_export(head_dir)
        est = eagle_acceptance_estimate(head, seqs, 4, per_seq=args.per_seq, walk=args.walk)
        lengths.append(est["mean_acceptance_length"])
        weights.append(est["positions"])
        print(f"{head_dir.name} {task}: chain acceptance length {est['mean_acceptance_length']:.2f} over "
              f"{est['positions']} positions, per position {[round(a, 2) for a in est['acceptance_per_position']]}")
    print(f"{head_dir.name} all tasks: chain acceptance length "
          f"{sum(a * w for a, w in zip(lengths, weights)) / sum(weights):.3f} over {sum(weights)} positions")
