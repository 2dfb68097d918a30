"""The named EAGLE head's held-out-style estimate (greedy chains of 4 against the target's own
continuation) on the bench's prompts (the first 4 of each task, 64 tokens, float32 target), beside
the estimate on the training distribution's held-out sequences: separates "other text" from "the
engine" when the engine's acceptance length falls short of the held-out estimate.

    python benches/eagle_estimate_bench_prompts.py [HEAD_DIR]

HEAD_DIR: default the newest cached smollm2-135m-eagle head. Run alone.
"""
import sys
from pathlib import Path

import torch

from specinfer.bench.prompting import prompt_encoder
from specinfer.generator import Generator
from specinfer.spec_decode import head_training
from specinfer.spec_decode.distill_data import _bench_rows, build_sequences
from specinfer.spec_decode.eagle_training import EagleTrainer, eagle_acceptance_estimate

torch.set_num_threads(2)
head_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else max(
    (Path.home() / ".cache/specinfer/heads").glob("smollm2-135m-eagle-*"), key=lambda p: p.stat().st_mtime)
gen = Generator("smollm2-135m", max_num_seqs=8)
target = gen.engine.loaded
encode = prompt_encoder(target, True)
by_task: dict[str, list] = {}
for row in _bench_rows():
    if len(by_task.setdefault(row["task"], [])) < 4:
        by_task[row["task"]].append(list(encode(row["prompt"])))
lm = head_training._dense_lm_head(target)
for task, prompts in by_task.items():
    seqs = build_sequences(gen, prompts, 64)
    head = EagleTrainer(target, 4, 0, lm, seqs)
    head.load_export(head_dir)
    est = eagle_acceptance_estimate(head, seqs, 4, per_seq=40)
    print(f"{task}: chain acceptance length {est['mean_acceptance_length']:.2f} over {est['positions']} positions, "
          f"per position {[round(a, 2) for a in est['acceptance_per_position']]}")
