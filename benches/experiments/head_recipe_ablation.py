"""Draft-head training recipes side by side on the same distillation data and step count.

    python benches/experiments/head_recipe_ablation.py [--method eagle] [--steps 800] [--lr-schedule wsd|invsqrt]
        [--lr LR] [--cls-weight W] [--noise A] [--prompt-weight W] [--label-rows labels|draft] [--token-loss-stride N] [--minutes M] [--init random|last-layer] [--data PATH]

Trains one head with train-heads' own pipeline (head_training.train, bf16 autocast where native)
on a distillation-data file (default: the named heads' cache, which `specinfer train-heads` or the
first use of "smollm2-135m-eagle" builds) and prints the held-out estimate (every tenth sequence)
and, for EAGLE, the teacher-forced first-draft accuracy over every held-out continuation position
(a sample ~40x larger than the chain estimate's 600 positions, so finer differences show).
`--cls-weight`: EAGLE's token-loss weight beside the feature regression (train-heads: 0.1);
`--init last-layer`: EAGLE's q/k/v/gate/up/post-norm copied from the target's last layer (o/down
stay zero), instead of random. Run alone: steps are fixed, the timings are the machine's.
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
    ap.add_argument("--method", default="eagle", choices=("eagle", "medusa", "mlp_speculator"))
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr-schedule", default="wsd", choices=("wsd", "invsqrt"))
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--cls-weight", type=float, default=None)
    ap.add_argument("--noise", type=float, default=0.0, help="EAGLE: uniform input-feature noise U(-a, a)")
    ap.add_argument("--prompt-weight", type=float, default=1.0,
                    help="EAGLE: weight of the pairs whose next token is in the prompt (continuation: 1)")
    ap.add_argument("--label-rows", default="labels", choices=("labels", "draft"),
                    help="EAGLE: the token loss's softmax over the label vocabulary or the draft vocabulary")
    ap.add_argument("--token-loss-stride", type=int, default=1,
                    help="EAGLE: the token loss at every n-th pair only (eagle_training.TOKEN_LOSS_STRIDE)")
    ap.add_argument("--minutes", type=float, default=None, help="stop training after this long (steps: the schedule's length)")
    ap.add_argument("--init", default="random", choices=("random", "last-layer"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=str(Path.home() / ".cache/specinfer/heads" /
                                          f"distill-smollm2-135m{'' if native == 'float32' else '-' + native}.pt"))
    ap.add_argument("--out", default=None, help="where the head is written (default: a name under /tmp)")
    args = ap.parse_args()

    from specinfer.generator import Generator
    from specinfer.training import eagle_training, head_training
    from specinfer.training.distill_data import DistillSequence

    if args.cls_weight is not None:
        eagle_training.CLS_WEIGHT = args.cls_weight
    eagle_training.FEATURE_NOISE, eagle_training.PROMPT_WEIGHT = args.noise, args.prompt_weight
    eagle_training.LABEL_ROWS, eagle_training.TOKEN_LOSS_STRIDE = args.label_rows, args.token_loss_stride
    target = Generator(args.model, max_num_seqs=4).engine.loaded
    saved = torch.load(args.data, weights_only=False)
    seqs = [DistillSequence(**{**s, "aux": None}) for s in saved["seqs"]]
    if args.init == "last-layer":
        _init_from_last_layer(eagle_training.EagleTrainer, target)
    cfg = head_training.TrainConfig(args.method, num_heads=4, steps=args.steps, lr=args.lr, seed=0,
                                    draft_vocab_size=8192, train_dtype=native, lr_schedule=args.lr_schedule,
                                    save_every=10 ** 9, max_seconds=None if args.minutes is None else args.minutes * 60)
    name = f"{args.method}-{args.steps}-{args.lr_schedule}-{args.lr:g}-cls{args.cls_weight}-{args.init}-noise{args.noise:g}-pw{args.prompt_weight:g}-{args.label_rows}-tls{args.token_loss_stride}{'' if args.minutes is None else f'-{args.minutes:g}min'}"
    out = Path(args.out or f"/tmp/head_recipe_ablation/{name}")
    t0 = time.monotonic()
    report = head_training.train(target, seqs, out, cfg, progress=False)
    seconds = time.monotonic() - t0
    if args.method == "eagle":
        report["teacher_forced_first_draft_accuracy"] = _first_draft_accuracy(target, seqs, out)
    h = report["held_out"]
    print(json.dumps({"recipe": name, "train_seconds_with_estimate": round(seconds), **report}))
    print(f"{name}: held-out mean acceptance length {h['mean_acceptance_length']:.3f} "
          f"(per position {[round(a, 3) for a in h['acceptance_per_position']]}), held-out loss "
          f"{report['held_out_loss']:.4f}, first-draft accuracy {report.get('teacher_forced_first_draft_accuracy')}")


def _init_from_last_layer(cls, target) -> None:
    base = cls.__init__
    layer, c = target.model.layers[-1], target.config

    def dense(w):
        return (w.to_dense() if hasattr(w, "to_dense") else w).detach().float()

    def init(self, *a, **k):
        base(self, *a, **k)
        qkv, gu = dense(layer.qkv_weight), dense(layer.gate_up_weight)
        qs, ks, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        with torch.no_grad():
            for name, w in (("q", qkv[:qs]), ("k", qkv[qs:qs + ks]), ("v", qkv[qs + ks:]), ("gate", gu[:inter]),
                            ("up", gu[inter:]), ("post_ln", layer.post_attention_norm.detach().float())):
                self.params[name].copy_(w)

    cls.__init__ = init


@torch.no_grad()
def _first_draft_accuracy(target, seqs, out: Path) -> float:
    """The reloaded head's argmax draft from each held-out pair (the target's own features: teacher
    forced) against the target's next token, over every continuation position."""
    from specinfer.training import head_training
    from specinfer.training.eagle_training import EagleTrainer

    every = head_training.HELD_OUT_EVERY
    held = [seqs[i] for i in range(every - 1, len(seqs), every)]
    lm = head_training._dense_lm_head(target)
    head = EagleTrainer(target, 4, 0, lm, held)
    head.load_export(out)
    rows = lm if head.draft_ids is None else lm[head.draft_ids]
    ok = total = 0
    for s in held:  # pair i = (x_{i+1}, f_i) drafts x_{i+2}
        h = head.forward(s.tokens[1:][None], s.final[:-1][None])[0]
        d = (h @ rows.T).argmax(-1)
        d = d if head.draft_ids is None else head.draft_ids[d]
        ok += int((d[s.prompt_len - 2:len(s.tokens) - 2] == s.tokens[s.prompt_len:]).sum())
        total += len(s.tokens) - s.prompt_len
    return round(ok / total, 4)


if __name__ == "__main__":
    main()
