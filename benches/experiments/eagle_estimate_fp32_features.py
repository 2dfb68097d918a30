"""The named EAGLE head's held-out estimate on the bf16 distillation data's features and on the same
sequences' features recomputed by the float32 target (what the engine feeds the head by default).

    python benches/experiments/eagle_estimate_fp32_features.py [HEAD_DIR]

HEAD_DIR: default the newest cached smollm2-135m-eagle head. Run alone.
"""
import sys
import torch
from pathlib import Path
from specinfer.generator import Generator
from specinfer.training import head_training
from specinfer.training.distill_data import DistillSequence, target_states
from specinfer.training.eagle_training import EagleTrainer, eagle_acceptance_estimate
torch.set_num_threads(2)
gen = Generator("smollm2-135m", max_num_seqs=4)
t = gen.engine.loaded
print("engine dtype", gen.engine.dtype)
saved = torch.load(Path.home() / ".cache/specinfer/heads/distill-smollm2-135m-bfloat16.pt", weights_only=False)
seqs = [DistillSequence(**{**s, "aux": None}) for s in saved["seqs"]]
held = [seqs[i] for i in range(9, len(seqs), 10)]
head = EagleTrainer(t, 4, 0, head_training._dense_lm_head(t), held)
head.load_export(Path(sys.argv[1]) if len(sys.argv) > 1 else max((Path.home() / ".cache/specinfer/heads").glob("smollm2-135m-eagle-*"), key=lambda p: p.stat().st_mtime))
print("bf16 features", eagle_acceptance_estimate(head, held, 4)["mean_acceptance_length"])
fp = []
for s in held:
    f, _ = target_states(t.model, gen.engine.runner.backend, s.tokens.tolist())
    fp.append(DistillSequence(s.tokens, s.prompt_len, f, None))
d = torch.cat([(a.final - b.final).norm(dim=-1) / b.final.norm(dim=-1) for a, b in zip(held, fp)])
print("relative feature difference bf16 vs fp32: mean", d.mean().item())
print("fp32 features", eagle_acceptance_estimate(head, fp, 4)["mean_acceptance_length"])
