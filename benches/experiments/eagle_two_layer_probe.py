"""Does a second draft layer help an EAGLE head at a fixed step count? (a capacity probe; the
public EAGLE-1 layout and the engine hold one layer, so the two-layer head is measured here only,
in training, never exported.)

    python benches/experiments/eagle_two_layer_probe.py --layers 1|2 [--steps 800] [--lr 2e-3]

Layer 2 is a standard pre-norm Llama decoder layer (input RMSNorm, attention, post-attention
RMSNorm, MLP) over layer 1's output, its o and down projections zero at the start (so it starts
as the one-layer head). Same data (the named head's cache), recipe and seed as the named head;
reports the held-out chain estimate (train-heads') and the teacher-forced first-draft accuracy
over every held-out continuation position (benches/experiments/head_recipe_ablation.py's measure). Run alone.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def two_layer_trainer(base):
    from specinfer.training.draft_layer_unroll import UnrolledDraftLayer, rms

    class TwoLayerEagleTrainer(base):
        instance = None
        LAYER2 = ("q", "k", "v", "o", "gate", "up", "down", "post_ln")

        def __init__(self, target, *a, **k):
            super().__init__(target, *a, **k)
            c = self.cfg
            H, nh, nkv, d, inter = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
            g = torch.Generator().manual_seed(12345)

            def rnd(*shape):
                return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).requires_grad_()

            self.params.update({"q2": rnd(nh * d, H), "k2": rnd(nkv * d, H), "v2": rnd(nkv * d, H),
                                "o2": torch.zeros(H, nh * d, requires_grad=True),
                                "gate2": rnd(inter, H), "up2": rnd(inter, H),
                                "down2": torch.zeros(H, inter, requires_grad=True),
                                "post_ln2": torch.ones(H, requires_grad=True),
                                "in_ln2": torch.ones(H, requires_grad=True)})
            self._second = False
            type(self).instance = self

        def _inputs(self, tokens, g):
            if not self._second:
                return super()._inputs(tokens, g)
            return g, rms(g, self.params["in_ln2"], self.cfg.rms_norm_eps).to(g.dtype)

        def _on_layer2(self, fn):
            full = self.params
            self.params = {**full, **{n: full[n + "2"] for n in self.LAYER2}}
            self._second = True
            try:
                return fn()
            finally:
                self.params, self._second = full, False

        def packed(self, tokens, first, lengths):
            h = UnrolledDraftLayer.packed(self, tokens, first, lengths)
            return self._on_layer2(lambda: UnrolledDraftLayer.packed(self, tokens, h, lengths))

        def forward(self, tokens, feats):
            h = self.unroll(tokens, feats, 1)[0]
            return self._on_layer2(lambda: self.unroll(tokens, h, 1)[0])

    return TwoLayerEagleTrainer


@torch.no_grad()
def first_draft_accuracy(head, held, lm) -> float:
    rows = lm if head.draft_ids is None else lm[head.draft_ids]
    ok = total = 0
    for s in held:  # pair i = (x_{i+1}, f_i) drafts x_{i+2}
        h = head.forward(s.tokens[1:][None], s.final[:-1][None])[0]
        d = (h.float() @ rows.T).argmax(-1)
        d = d if head.draft_ids is None else head.draft_ids[d]
        ok += int((d[s.prompt_len - 2:len(s.tokens) - 2] == s.tokens[s.prompt_len:]).sum())
        total += len(s.tokens) - s.prompt_len
    return round(ok / total, 4)


def main() -> None:
    from specinfer.platform.cpu import bf16_matmul_is_native

    native = "bfloat16" if bf16_matmul_is_native() else "float32"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, choices=(1, 2), default=2)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--data", default=str(Path.home() / ".cache/specinfer/heads" /
                                          f"distill-smollm2-135m{'' if native == 'float32' else '-' + native}.pt"))
    args = ap.parse_args()

    from specinfer.generator import Generator
    from specinfer.training import eagle_training, head_training
    from specinfer.training.distill_data import DistillSequence

    cls = eagle_training.EagleTrainer if args.layers == 1 else two_layer_trainer(eagle_training.EagleTrainer)
    if args.layers == 1:  # keep the instance for the accuracy below
        class One(cls):
            instance = None

            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                type(self).instance = self
        cls = One
    eagle_training.EagleTrainer = cls
    target = Generator("smollm2-135m", max_num_seqs=4).engine.loaded
    seqs = [DistillSequence(**{**s, "aux": None}) for s in torch.load(args.data, weights_only=False)["seqs"]]
    cfg = head_training.TrainConfig("eagle", steps=args.steps, lr=args.lr, seed=0, draft_vocab_size=8192,
                                    train_dtype=native, save_every=10 ** 9)
    out = Path(f"/tmp/eagle_two_layer_probe/layers{args.layers}-{args.steps}")
    t0 = time.monotonic()
    report = head_training.train(target, seqs, out, cfg, progress=False)
    seconds = time.monotonic() - t0
    every = head_training.HELD_OUT_EVERY
    held = [seqs[i] for i in range(every - 1, len(seqs), every)]
    acc = first_draft_accuracy(cls.instance, held, head_training._dense_lm_head(target))
    h = report["held_out"]
    print(json.dumps({"layers": args.layers, "train_seconds_with_estimate": round(seconds),
                      "first_draft_accuracy": acc, **report}))
    print(f"layers {args.layers}, {args.steps} steps: held-out chain {h['mean_acceptance_length']:.3f} (per position "
          f"{[round(a, 3) for a in h['acceptance_per_position']]}), held-out loss {report['held_out_loss']:.4f}, "
          f"first-draft accuracy {acc}, {seconds:.0f} s")


if __name__ == "__main__":
    main()
