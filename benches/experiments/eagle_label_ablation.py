"""EAGLE-1 training labels, side by side on the same distillation data and step count.

    python benches/experiments/eagle_label_ablation.py VARIANT [--steps 800] [--lr LR] [--data heads/eagle/distill_data.pt]

VARIANT: `soft` (what train-heads does: the target's next-token distribution at every position),
`greedy` (the target's greedy token at every position) or `continuation` (the continuation tokens
only, the previous recipe), or `soft-cls1` / `soft-cls3`: soft labels with the token loss weighing 1
or 3 instead of EAGLE's 0.1 beside the feature regression, or `soft-noise`: soft labels with EAGLE's
feature augmentation (uniform noise of +-0.1 x the features' RMS on the input features, in training
only). Prints the held-out estimate of train-heads (every tenth sequence).
Run alone: the step count is fixed, so two variants may share the machine, one thread each.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", choices=("soft", "greedy", "continuation", "soft-cls1", "soft-cls3", "soft-noise"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: train-heads')")
    ap.add_argument("--data", default="heads/eagle/distill_data.pt")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()

    from specinfer.generator import Generator
    from specinfer.training import eagle_training
    from specinfer.training.distill_data import DistillSequence, LabelSoftmax
    from specinfer.training.head_training import TrainConfig, train

    def greedy_loss(self, h, target_states):
        with torch.no_grad():
            y = (target_states @ self.weight.T).argmax(-1)
        return F.cross_entropy(h @ self.weight.T, y)

    def continuation_loss_on(self, seqs):  # labels x_{i+2} at continuation pairs only
        T, B, H = max(len(s.tokens) for s in seqs) - 1, len(seqs), self.cfg.hidden_size
        tokens = torch.zeros(B, T, dtype=torch.int64)
        feats, next_feats = torch.zeros(B, T, H), torch.zeros(B, T, H)
        labels = torch.full((B, T), -1, dtype=torch.int64)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n = len(s.tokens) - 1
            tokens[b, :n], feats[b, :n], next_feats[b, :n] = s.tokens[1:], s.final[:-1], s.final[1:]
            valid[b, : n - 1] = True
            i = torch.arange(max(s.prompt_len - 2, 0), n - 1)
            labels[b, i] = s.tokens[i + 2]
        h = self.forward(tokens, feats)
        reg = F.smooth_l1_loss(h[valid], next_feats[valid])
        keep = labels >= 0
        index = torch.full((self.lm.shape[0],), -1, dtype=torch.int64)
        index[self.label_softmax.ids] = torch.arange(len(self.label_softmax.ids))
        logits = h[keep] @ self.label_softmax.weight.T
        return reg + eagle_training.CLS_WEIGHT * F.cross_entropy(logits, index[labels[keep]])

    if args.variant.startswith("soft-cls"):
        eagle_training.CLS_WEIGHT = float(args.variant[len("soft-cls"):])
    if args.variant == "soft-noise":
        unroll = eagle_training.EagleTrainer.unroll

        def noisy_unroll(self, tokens, feats, *rest):
            if torch.is_grad_enabled():  # training batches only, not the held-out drafts
                rms = feats.pow(2).mean().sqrt()
                feats = feats + (torch.rand_like(feats) * 2 - 1) * 0.1 * rms
            return unroll(self, tokens, feats, *rest)

        eagle_training.EagleTrainer.unroll = noisy_unroll
    if args.variant == "greedy":
        LabelSoftmax.soft_loss = greedy_loss
    elif args.variant == "continuation":
        eagle_training.EagleTrainer.loss_on = continuation_loss_on
    gen = Generator(args.model, max_num_seqs=4)
    seqs = [DistillSequence(**s) for s in torch.load(args.data, weights_only=False)["seqs"]]
    out = Path(tempfile.mkdtemp(prefix="eagle_ablation_"))
    try:
        t = time.monotonic()
        report = train(gen.engine.loaded, seqs, out, TrainConfig("eagle", steps=args.steps, **({} if args.lr is None else {"lr": args.lr})), progress=False)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"variant": args.variant, "lr": args.lr, "steps": report["steps"], "seconds": round(time.monotonic() - t),
                      "held_out": report["held_out"]}))


if __name__ == "__main__":
    main()
