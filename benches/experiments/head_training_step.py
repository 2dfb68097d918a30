"""Milliseconds per EAGLE training step (4 random sequences, loss + backward + AdamW, bf16 autocast
where native) on the named heads' distillation data, as train-heads runs it.

    python benches/experiments/head_training_step.py [--data PATH] [--steps 20] [--label-rows labels|draft] [--token-loss-stride N]

Compare commits by running it at each (`git checkout e6192d7` for the padded batches, then at
eb8eebc or later for packed ones). Run alone.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    from specinfer.platform.cpu import bf16_matmul_is_native

    native = "bfloat16" if bf16_matmul_is_native() else "float32"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(Path.home() / ".cache/specinfer/heads" /
                                          f"distill-smollm2-135m{'' if native == 'float32' else '-' + native}.pt"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--token-loss-stride", type=int, default=1, help="eagle_training.TOKEN_LOSS_STRIDE")
    ap.add_argument("--label-rows", default="labels", choices=("labels", "draft"),
                    help="the token loss's softmax rows (eagle_training.LABEL_ROWS)")
    args = ap.parse_args()

    from specinfer.generator import Generator
    from specinfer.training import head_training
    from specinfer.training.distill_data import DistillSequence
    from specinfer.training import eagle_training
    from specinfer.training.eagle_training import EagleTrainer

    eagle_training.LABEL_ROWS, eagle_training.TOKEN_LOSS_STRIDE = args.label_rows, args.token_loss_stride

    target = Generator("smollm2-135m", max_num_seqs=4).engine.loaded
    seqs = [DistillSequence(**{**s, "aux": None}) for s in torch.load(args.data, weights_only=False)["seqs"]]
    trainer = EagleTrainer(target, 4, 0, head_training._dense_lm_head(target), seqs, 8192)
    opt = torch.optim.AdamW(list(trainer.params.values()), lr=1e-3)

    def step(i):
        pick = torch.randint(0, len(seqs), (4,), generator=torch.Generator().manual_seed(i))
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=native == "bfloat16"):
            loss = trainer.loss_on([seqs[j] for j in pick.tolist()])
            opt.zero_grad()
            loss.backward()
        opt.step()

    for i in range(5):
        step(i)
    t = time.perf_counter()
    for i in range(args.steps):
        step(i)
    print(f"EAGLE training step ({native}, token-loss rows: {args.label_rows}, stride {args.token_loss_stride}, "
          f"{len(trainer.label_softmax.ids)}): {(time.perf_counter() - t) / args.steps * 1e3:.1f} ms "
          f"({len(seqs)} sequences, mean length {sum(len(s.tokens) for s in seqs) / len(seqs):.0f})")


if __name__ == "__main__":
    main()
