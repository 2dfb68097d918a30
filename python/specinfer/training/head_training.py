"""Training draft heads on CPU by self-distillation (`specinfer train-heads`).

The target greedily continues prompts (distill_data); a head learns to predict those continuations
from the target's hidden states; the result is written in the head's public layout, which the
loader reads back (the held-out estimate is measured on the reloaded head, so the export is
checked too). Training resumes from `train_state.pt` in the output directory: every batch is drawn
from a generator seeded by (seed, step), so an interrupted and resumed run equals an unbroken one.

Methods: `medusa` (original layout, legacy heads: one zero-initialised ResBlock per head on the
target's own lm_head, as Medusa-1 trains them) and `mlp_speculator` (IBM layout with tie_weights:
proj.0, proj.1 and ln.0 trained; emb/head start as and stay the target's embedding and lm_head)
and `eagle` (EAGLE-1 layout; eagle_training) and `eagle3` (EAGLE-3 layout with a truncated draft
vocabulary and training-time-test unrolling; eagle3_training).

Labels: Medusa and the MLP speculator learn the continuation tokens (hard labels, as Medusa-1 and
IBM's speculators train); EAGLE the target's next-token distribution at every position, prompts
included (soft labels, as EAGLE trains; benches/experiments/eagle_label_ablation.py compares the choices).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.training.distill_data import DistillSequence, LabelSoftmax

TRAINABLE = ("medusa", "mlp_speculator", "eagle", "eagle3")
TRAIN_DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("wsd", "invsqrt")
EAGLE_SEQS_PER_BATCH = 4
WARMUP_STEPS = 20
DECAY_FROM = 200  # invsqrt: the rate decays from this step on
# EAGLE on SmolLM2-135M, 800 wsd steps: 6e-3 / 3e-3 / 2e-3 / 1.2e-3 gave teacher-forced first-draft
# accuracy 0.39 / 0.49 / 0.51 / 0.51 (benches/experiments/head_recipe_ablation.py; docs/lab/2026-12-notebook.md)
DEFAULT_LR = {"eagle": 2e-3}
# wsd where it was measured to help: EAGLE (above); Medusa 6000 steps wsd / invsqrt held-out 1.54 / 1.56,
# MLP speculator 1.52 / 1.48 (+-0.05: no difference), so they keep invsqrt
DEFAULT_SCHEDULE = {"eagle": "wsd"}
WSD_DECAY_FRACTION = 0.3  # wsd: the rate falls linearly to zero over the last 30 % of the steps
HELD_OUT_EVERY = 10


@dataclass(frozen=True)
class TrainConfig:
    method: str
    num_heads: int = 4  # Medusa heads / MLP speculator n_predict
    steps: int = 1000
    batch_size: int = 64
    lr: float | None = None  # peak learning rate; None: DEFAULT_LR of the method
    seed: int = 0
    max_seconds: float | None = None  # stop (and save) after this much training time
    save_every: int = 50
    max_grad_norm: float = 1.0  # gradients clipped to this norm
    draft_vocab_size: int = 8192  # eagle, eagle3, medusa: the draft vocabulary (most frequent target tokens)
    # "bfloat16": the loss under CPU autocast (bf16 matmuls, fp32 master weights and optimizer state;
    # ~2.5x the steps per second on a CPU with AMX / avx512_bf16), or "float32"
    train_dtype: str = "float32"
    ttt_steps: int = 1  # eagle: chain steps unrolled per training pair (eagle_training; 1: teacher-forced)
    # "wsd" (warm-up, stable, decay to zero at `steps`) or "invsqrt" (no end: a run can be extended); learning_rate;
    # None: DEFAULT_SCHEDULE of the method
    lr_schedule: str | None = None

    def __post_init__(self):
        if self.method not in TRAINABLE:
            raise ValueError(f"train-heads --method must be one of {list(TRAINABLE)} (got {self.method!r})")
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR.get(self.method, 3e-3))
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"train-heads lr must be a positive number (got {self.lr!r})")
        if self.lr_schedule is None:
            object.__setattr__(self, "lr_schedule", DEFAULT_SCHEDULE.get(self.method, "invsqrt"))
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train-heads lr_schedule must be one of {list(LR_SCHEDULES)} (got {self.lr_schedule!r})")
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train-heads train_dtype must be one of {list(TRAIN_DTYPES)} (got {self.train_dtype!r})")
        for name in ("num_heads", "steps", "batch_size", "save_every", "draft_vocab_size", "ttt_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"train-heads {name} must be a positive integer (got {v!r})")


def _examples(seqs: list[DistillSequence], K: int):
    """Rows (state f_t, tokens x_{t+1} .. x_{t+1+K}) for every t whose K labels lie in the continuation."""
    feats, toks = [], []
    for s in seqs:
        n = len(s.tokens)
        t = torch.arange(max(s.prompt_len - 1, 0), n - K - 1)
        if len(t) == 0:
            continue
        feats.append(s.final[t])
        toks.append(s.tokens[t[:, None] + 1 + torch.arange(K + 1)[None]])
    if not feats:
        raise ValueError("train-heads: the continuations are too short for the number of heads; raise max_tokens")
    return torch.cat(feats), torch.cat(toks)  # [n, H], int64[n, K + 1]


class MedusaTrainer:
    def __init__(self, target, K: int, seqs: list[DistillSequence], draft_vocab_size: int | None = None):
        H = target.config.hidden_size
        self.softmax = LabelSoftmax(_dense_lm_head(target), seqs)  # the token loss over the labels' vocabulary
        self.draft_ids = None  # a truncated vocabulary: exported in vLLM's layout with token_map
        if draft_vocab_size is not None and draft_vocab_size < target.config.vocab_size:
            from specinfer.training.eagle3_training import draft_vocabulary

            self.draft_ids = draft_vocabulary(seqs, target.config.vocab_size, draft_vocab_size)
            self.draft_rows = _dense_lm_head(target)[self.draft_ids]
        self.params = {"w": torch.zeros(K, H, H, requires_grad=True), "b": torch.zeros(K, H, requires_grad=True)}
        self.K = K

    def loss(self, f, toks):  # f [B, H], toks int64[B, K + 1]
        total = 0.0
        for k in range(self.K):
            x = f + F.silu(f @ self.params["w"][k].T + self.params["b"][k])
            total = total + self.softmax.loss(x, toks[:, k + 1])
        return total / self.K

    def save(self, out: Path, target) -> None:
        from specinfer.spec_decode.medusa import ORIGINAL, VLLM, MedusaConfig, MedusaHeads

        c = target.config
        w = [[self.params["w"][k].detach()] for k in range(self.K)]
        b = [[self.params["b"][k].detach()] for k in range(self.K)]
        if self.draft_ids is None:  # the original layout, legacy heads on the target's lm_head
            MedusaHeads(MedusaConfig(self.K, 1, c.hidden_size, c.vocab_size, c.vocab_size, ORIGINAL), w, b, None,
                        None, None).save(out)
            return
        # vLLM's layout: one shared lm_head holding the target's rows of the draft vocabulary + token_map
        Vt = len(self.draft_ids)
        MedusaHeads(MedusaConfig(self.K, 1, c.hidden_size, c.vocab_size, Vt, VLLM), w, b,
                    [self.draft_rows] * self.K, self.draft_ids, None).save(out)

    @staticmethod
    def load(out: Path, target):
        from specinfer.spec_decode.medusa import MedusaHeads

        c = target.config
        return MedusaHeads.load(out, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                                target_logits=lambda h: h @ _dense_lm_head(target).T, dtype=torch.float32,
                                device=torch.device("cpu"))


class MLPSpeculatorTrainer:
    def __init__(self, target, K: int, seed: int, seqs: list[DistillSequence]):
        E = target.config.hidden_size
        g = torch.Generator().manual_seed(seed)
        self.emb, self.head = target.model.embed_tokens.detach().float(), _dense_lm_head(target)
        self.softmax = LabelSoftmax(self.head, seqs)  # the token loss over the labels' vocabulary
        self.params = {"proj0": (torch.randn(E, E, generator=g) / math.sqrt(E)).requires_grad_(),
                       "proj1": (torch.randn(E, E, generator=g) / math.sqrt(E)).requires_grad_(),
                       "ln_w": torch.ones(E, requires_grad=True), "ln_b": torch.zeros(E, requires_grad=True)}
        a = 0.5 ** (0.5 / K)
        self.emb_scale = math.sqrt((1 - a * a) * E / 2) / a
        self.K = K

    def loss(self, f, toks):
        p, s, total = self.params, f, 0.0
        for i in range(self.K):
            u = s @ (p["proj0"] if i == 0 else p["proj1"]).T + self.emb_scale * self.emb[toks[:, i]]
            u = p["ln_w"] * u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) + p["ln_b"]
            s = F.gelu(u)
            total = total + self.softmax.loss(s, toks[:, i + 1])
        return total / self.K

    def save(self, out: Path, target) -> None:
        from specinfer.spec_decode.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

        c = target.config
        cfg = MLPSpeculatorConfig(c.vocab_size, c.hidden_size, c.hidden_size, self.K, tie_weights=True,
                                  top_k_tokens_per_head=tuple([1] * self.K))
        p = {k: v.detach() for k, v in self.params.items()}
        n = self.K
        MLPSpeculator(cfg, [self.emb] * n, [p["proj0"]] + [p["proj1"]] * (n - 1), [self.head] * n,
                      [p["ln_w"]] * n, [p["ln_b"]] * n).save(out)

    @staticmethod
    def load(out: Path, target):
        from specinfer.spec_decode.mlp_speculator import MLPSpeculator

        c = target.config
        return MLPSpeculator.load(out, hidden_size=c.hidden_size, vocab_size=c.vocab_size, dtype=torch.float32,
                                  device=torch.device("cpu"))


def _dense_lm_head(target) -> torch.Tensor:
    from specinfer.models.panel_linear import PanelWeight
  # [V, H] float32, also when the CPU platform packed it (oneDNN)
    m = target.model
    w = m.embed_tokens if target.config.tie_word_embeddings else m.lm_head
    if getattr(w, "is_mkldnn", False) or isinstance(w, PanelWeight):
        w = w.to_dense()
    return w.detach().float()


@torch.inference_mode()
def acceptance_estimate(head, seqs: list[DistillSequence], K: int) -> dict:
    """Greedy chain acceptance of the head on held-out continuations: drafts from the head's
    own chain (not teacher-forced) against the target's next tokens."""
    f, toks = _examples(seqs, K)
    drafts = head.draft(f, toks[:, 0], K)  # int64[n, K]
    ok = (drafts == toks[:, 1:]).int()
    accepted = ok.cumprod(1).sum(1)  # leading matches
    at = [(accepted >= i).float().sum().item() for i in range(K + 1)]  # positions with >= i accepted
    alpha = [at[i + 1] / at[i] if at[i] else 0.0 for i in range(K)]
    return {"positions": int(len(accepted)), "acceptance_per_position": alpha,
            "mean_acceptance_length": 1.0 + float(accepted.float().mean()),
            "acceptance_rate": float(accepted.float().sum() / (len(accepted) * K))}


@torch.no_grad()
def held_out_loss(trainer, held: list[DistillSequence], cfg: TrainConfig) -> float:
    """The training loss over every held-out sequence (float32, no autocast): beside final_loss
    (one training batch's) it tells learning from overfitting."""
    if cfg.method in ("eagle", "eagle3"):
        chunks = [held[i:i + EAGLE_SEQS_PER_BATCH] for i in range(0, len(held), EAGLE_SEQS_PER_BATCH)]
        return float(sum(trainer.loss_on(c) * len(c) for c in chunks) / len(held))
    try:
        f, toks = _examples(held, cfg.num_heads)
    except ValueError:  # held-out continuations too short for the heads: nothing to score
        return float("nan")
    return float(trainer.loss(f, toks))


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over WARMUP_STEPS, then by cfg.lr_schedule:

    - "wsd" (warm-up, stable, decay): constant until the last WSD_DECAY_FRACTION of cfg.steps, then
      linear to zero at cfg.steps. In a fixed budget of steps it trains the better head (EAGLE on
      SmolLM2-135M, 800 steps: teacher-forced first-draft accuracy 0.45 -> 0.49, held-out loss
      0.658 -> 0.635; docs/lab/2026-12-notebook.md); the rate depends on cfg.steps, so a resumed run must
      keep its --steps.
    - "invsqrt": constant to DECAY_FROM, then inverse-square-root decay: a function of the step
      alone, so a run can be resumed with more --steps and equals one that asked for them at once.

    (Constant-rate AdamW diverged after ~3800 EAGLE steps in a CPU run.)"""
    if step < WARMUP_STEPS:
        return cfg.lr * (step + 1) / WARMUP_STEPS
    if cfg.lr_schedule == "invsqrt":
        return cfg.lr * min(1.0, math.sqrt(DECAY_FROM / (step + 1)))
    decay = max(1, round(WSD_DECAY_FRACTION * cfg.steps))
    return cfg.lr * min(1.0, (cfg.steps - step) / decay)


def train(target, seqs: list[DistillSequence], out: Path, cfg: TrainConfig, *, progress: bool = True) -> dict:
    """Train on seqs (every HELD_OUT_EVERY-th held out), write the public layout to out, return the report."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # every tenth sequence held out (the prompts come grouped by kind: bench tasks, chat questions,
    # stdlib chunks; a stride holds out some of each)
    held_ids = set(range(HELD_OUT_EVERY - 1, len(seqs), HELD_OUT_EVERY)) or {len(seqs) - 1}
    held = [seqs[i] for i in sorted(held_ids)]
    train_seqs = [s for i, s in enumerate(seqs) if i not in held_ids] or seqs
    if cfg.method in ("eagle", "eagle3"):
        if cfg.method == "eagle":
            from specinfer.training.eagle_training import EagleTrainer

            trainer = EagleTrainer(target, cfg.num_heads, cfg.seed, _dense_lm_head(target), train_seqs,
                                   cfg.draft_vocab_size, ttt_steps=cfg.ttt_steps)
        else:
            from specinfer.training.eagle3_training import Eagle3Trainer

            if any(s.aux is None for s in train_seqs):
                raise ValueError("eagle3 training needs the aux layers' states (build_sequences(..., aux_layers))")
            trainer = Eagle3Trainer(target, train_seqs, cfg.seed, cfg.draft_vocab_size, _dense_lm_head(target))
        num_positions = sum(len(s.tokens) - 1 for s in train_seqs)

        def batch_loss(g):
            pick = torch.randint(0, len(train_seqs), (min(EAGLE_SEQS_PER_BATCH, len(train_seqs)),), generator=g)
            return trainer.loss_on([train_seqs[i] for i in pick.tolist()])
    else:
        feats, toks = _examples(train_seqs, cfg.num_heads)
        num_positions = len(feats)
        trainer = MedusaTrainer(target, cfg.num_heads, train_seqs, cfg.draft_vocab_size) if cfg.method == "medusa" else \
            MLPSpeculatorTrainer(target, cfg.num_heads, cfg.seed, train_seqs)

        def batch_loss(g):
            idx = torch.randint(0, len(feats), (min(cfg.batch_size, len(feats)),), generator=g)
            return trainer.loss(feats[idx], toks[idx])
    opt = torch.optim.AdamW(list(trainer.params.values()), lr=cfg.lr, weight_decay=0.0)
    state_file, start = out / "train_state.pt", 0
    if state_file.exists():
        state = torch.load(state_file, weights_only=False)
        # invsqrt's rate is the step's alone: such a run may be extended (--steps); wsd's ends at --steps
        same = {k: v for k, v in asdict(cfg).items()
                if k != "max_seconds" and not (k == "steps" and cfg.lr_schedule == "invsqrt")}
        if {k: state["config"].get(k) for k in same} != same:
            raise ValueError(f"{state_file}: a run with other settings ({state['config']}); use another --out")
        with torch.no_grad():
            for k, v in state["params"].items():
                trainer.params[k].copy_(v)
        opt.load_state_dict(state["optim"])
        start = state["step"]

    def checkpoint(step):
        torch.save({"config": asdict(cfg), "step": step, "optim": opt.state_dict(),
                    "params": {k: v.detach().clone() for k, v in trainer.params.items()}}, state_file)

    params = list(trainer.params.values())
    t0, step, loss = time.monotonic(), start, float("nan")
    bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc=f"train {cfg.method}", unit="step")
    while step < cfg.steps:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train_dtype == "bfloat16"):
            value = batch_loss(g)
            opt.zero_grad()
            value.backward()
        if torch.isfinite(value):  # a non-finite batch is skipped, never applied
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
        step, loss = step + 1, float(value.detach())
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if step % cfg.save_every == 0:
            checkpoint(step)
        if cfg.max_seconds is not None and time.monotonic() - t0 >= cfg.max_seconds:
            break
    bar.close()
    checkpoint(step)
    trainer.save(out, target)
    if cfg.method == "eagle":
        from specinfer.spec_decode.eagle import EagleDraft
        from specinfer.training.eagle_training import eagle_acceptance_estimate

        EagleDraft.load(out, target=target, dtype=torch.float32, device=torch.device("cpu"))  # the export loads
        held_out = eagle_acceptance_estimate(trainer, held, cfg.num_heads)
    elif cfg.method == "eagle3":
        from specinfer.spec_decode.eagle3 import Eagle3Draft
        from specinfer.training.eagle_training import eagle_acceptance_estimate

        Eagle3Draft.load(out, target=target, dtype=torch.float32, device=torch.device("cpu"))  # the export loads
        held_out = eagle_acceptance_estimate(trainer, held, cfg.num_heads, feature="aux")
    else:
        held_out = acceptance_estimate(type(trainer).load(out, target), held, cfg.num_heads)
    report = {"method": cfg.method, "steps": step, "final_loss": loss, "train_positions": int(num_positions),
              "held_out_loss": held_out_loss(trainer, held, cfg), "held_out": held_out}
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    return report


def train_head(target_model: str, out: Path, cfg: TrainConfig, prompts: int, max_tokens: int, *,
               progress: bool = True, data_path: Path | None = None, data_dtype: str = "float32",
               task_shaped_per_task: int = 0, self_instruct: int = 0) -> dict:
    """The whole `specinfer train-heads` pipeline: load the target, build (or reuse, from data_path,
    default out/distill_data.pt) the distillation data of `prompts` greedy continuations of
    `max_tokens` tokens, train, write the head to out; returns the report. `data_dtype` is the
    precision the target runs in while it builds the data ("bfloat16": ~3x faster where the CPU
    multiplies bf16 natively; the head still trains on, and is exported for, the target as loaded).
    `task_shaped_per_task`: that many task-shaped prompts per bench task added to the prompts
    (distill_data.task_shaped_texts). `self_instruct`: that many questions the target writes itself
    take the templated everyday questions' place (distill_data.self_instruct_questions)."""
    import sys

    from specinfer.generator import Generator
    from specinfer.training.distill_data import (build_sequences, cached_sequences, self_instruct_questions,
                                                   training_prompts)

    if data_dtype not in TRAIN_DTYPES:
        raise ValueError(f"train-heads data_dtype must be one of {list(TRAIN_DTYPES)} (got {data_dtype!r})")
    gen = Generator(target_model, max_num_seqs=64)
    aux = ()
    if cfg.method == "eagle3":  # the three target layers an EAGLE-3 head reads
        from specinfer.training.eagle3_training import training_aux_layers

        aux = training_aux_layers(gen.engine.loaded.config.num_layers)

    def sequences(g):
        questions = self_instruct_questions(g, self_instruct) if self_instruct else None
        return build_sequences(g, training_prompts(g.engine.loaded, prompts, task_shaped_per_task, questions),
                               max_tokens, aux)

    def build():
        if gen.engine.dtype == getattr(torch, data_dtype):
            return sequences(gen)
        with Generator(target_model, max_num_seqs=64, dtype=data_dtype) as data_gen:
            return sequences(data_gen)

    print(f"distillation data: {prompts} continuations (+ {task_shaped_per_task} task-shaped per task; "
          f"{self_instruct} self-instructed questions) of {max_tokens} tokens with the target ({data_dtype}) ...",
          file=sys.stderr)
    key = {"model": target_model, "prompts": prompts, "max_tokens": max_tokens, "aux": list(aux)}
    if data_dtype != "float32":  # float32 data keeps the key it always had (caches built before stay valid)
        key["dtype"] = data_dtype
    if task_shaped_per_task:  # likewise: only data with task-shaped prompts names them
        key["task_shaped"] = task_shaped_per_task
    if self_instruct:
        key["self_instruct"] = self_instruct
    seqs = cached_sequences(Path(data_path) if data_path is not None else Path(out) / "distill_data.pt", key, build)
    return train(gen.engine.loaded, seqs, out, cfg, progress=progress)
