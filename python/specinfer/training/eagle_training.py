"""EAGLE-1 head training by self-distillation (used by head_training.train for method "eagle").

One draft layer over (x_{i+1}, f_i) pairs, trained as EAGLE trains it: regress the target's next
feature f_{i+1} (smooth L1) plus CLS_WEIGHT x cross-entropy of the target's lm_head over the draft
feature against the target's own next-token distribution read off f_{i+1} (soft labels, at every
pair: prompt positions teach too, their labels being what the target would say there; the
softmax over the labels' vocabulary, distill_data.LabelSoftmax). With ttt_steps > 1 the layer is
unrolled as the engine drafts (draft_layer_unroll: step s feeds the head's own step s-1 feature at
the same pair; its losses weigh STEP_WEIGHT^(s-1)), so the chain's later drafts are trained on the
head's own features rather than only teacher-forced (HASS / EAGLE-3's training-time test). Steps
past the first run at every TTT_PAIR_STRIDE-th pair only (a chain step at a pair reads step 1's keys
and its own chain's, nothing of the other pairs' chains, so this is exact for those pairs), since
with every pair each step cost another pass and in a fixed CPU budget the fewer steps trained a
weaker head (docs/lab/2026-12-notebook.md). With a draft
vocabulary size below the target's, the export carries `d2t` (the most frequent training tokens;
spec_decode/eagle.py). Dense attention over right-padded batches (padding never precedes a real
position, so it is never attended). Initialisation: fc passes the feature through, o_proj and
down_proj start at zero, so the untrained head drafts what the target's lm_head reads off f_i.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.models.rope import rope_table
from specinfer.training.distill_data import LabelSoftmax
from specinfer.training.draft_layer_unroll import UnrolledDraftLayer
from specinfer.spec_decode.head_checkpoint import write_checkpoint

# the token loss's weight beside the feature regression: EAGLE's is 0.1; on SmolLM2-135M (800 wsd steps,
# lr 2e-3) 0.1 / 0.03 / 0.01 gave held-out chain acceptance length 1.83 / 1.91 / 1.89 and first-draft
# accuracy 0.510 / 0.510 / 0.492: the regression carries the chain's later drafts (docs/lab/2026-12-notebook.md)
CLS_WEIGHT = 0.03
TTT_STEPS = 1  # unrolled steps per training pair by default (1: teacher-forced only, EAGLE-1's own recipe)
STEP_WEIGHT = 0.8  # step s's losses weigh STEP_WEIGHT^(s-1) (EAGLE-3's)
TTT_PAIR_STRIDE = 4  # steps past the first run at every 4th pair
# FEATURE_NOISE, PROMPT_WEIGHT, TOKEN_LOSS_STRIDE, LABEL_ROWS: ablation knobs for teacher-forced training
# (ttt_steps 1; benches/experiments/head_recipe_ablation.py), left at what measured best (docs/lab/2026-12-notebook.md).
# Uniform noise U(-a, a) added to the input features f_i while training (EAGLE's data noise: the
# chain's later drafts read the head's own, inexact features); 0: none
FEATURE_NOISE = 0.0
# the losses of pairs whose next token lies in the prompt weigh this much against the continuation's
# (the target's own output, which drafting meets); 1.0: every pair alike
PROMPT_WEIGHT = 1.0
# the token loss is taken at every TOKEN_LOSS_STRIDE-th pair of a batch (an offset the batch picks): its
# softmax over the label vocabulary (~5800 rows on SmolLM2's data) is ~1/4 of a training step
TOKEN_LOSS_STRIDE = 1
# the token loss's softmax rows: "labels" (every continuation token of the data) or "draft" (the draft
# vocabulary the head's drafts are argmaxed over; fewer rows, so a cheaper step)
LABEL_ROWS = "labels"


class EagleTrainer(UnrolledDraftLayer):
    def __init__(self, target, K: int, seed: int, lm_head: torch.Tensor, seqs, draft_vocab_size: int | None = None,
                 ttt_steps: int = TTT_STEPS):
        c = target.config
        self.cfg, self.K, self.ttt_steps = c, K, ttt_steps
        H, nh, nkv, d, inter = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).requires_grad_()

        self.params = {
            "fc_w": torch.cat([torch.zeros(H, H), torch.eye(H)], 1).requires_grad_(),
            "fc_b": torch.zeros(H, requires_grad=True),
            "q": rnd(nh * d, H), "k": rnd(nkv * d, H), "v": rnd(nkv * d, H),
            "o": torch.zeros(H, nh * d, requires_grad=True),
            "gate": rnd(inter, H), "up": rnd(inter, H), "down": torch.zeros(H, inter, requires_grad=True),
            "post_ln": torch.ones(H, requires_grad=True)}
        self.embed = target.model.embed_tokens.detach().float()
        self.lm = lm_head
        # the draft vocabulary written into the checkpoint (d2t): the most frequent training tokens
        self.draft_ids = None
        if draft_vocab_size is not None and draft_vocab_size < c.vocab_size:
            from specinfer.training.eagle3_training import draft_vocabulary

            self.draft_ids = draft_vocabulary(seqs, c.vocab_size, draft_vocab_size)
        # the token loss is a softmax over the training labels' vocabulary (distill_data.LabelSoftmax),
        # or over the draft vocabulary (LABEL_ROWS)
        self.label_softmax = LabelSoftmax(lm_head, seqs, self.draft_ids if LABEL_ROWS == "draft" else None)
        self.rope_cos, self.rope_sin = rope_table(c, c.max_position_embeddings)

    def _inputs(self, tokens, g):  # EAGLE-1: fc(cat(embed(x_{i+1}), f_i)), which is also the residual
        x = F.linear(torch.cat([self.embed[tokens], g.to(self.embed.dtype)], -1), self.params["fc_w"],
                     self.params["fc_b"])
        return x, x

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """tokens int64[B, T] (x_{i+1}), feats [B, T, H] (f_i) -> [B, T, H] draft features (causal)."""
        return self.unroll(tokens, feats, 1)[0]

    def loss_on(self, seqs) -> torch.Tensor:
        steps = self.ttt_steps
        if steps == 1:  # teacher-forced only: the sequences packed end to end, no padding computed
            lengths = [len(s.tokens) - 1 for s in seqs]  # pairs i = 0 .. n-1 of each sequence
            tokens, feats = torch.cat([s.tokens[1:] for s in seqs]), torch.cat([s.final[:-1] for s in seqs])
            if FEATURE_NOISE:  # seeded by the batch itself: a resumed run draws the same noise
                g = torch.Generator().manual_seed(int(tokens.sum()))
                feats = feats + (torch.rand(feats.shape, generator=g) * 2 - 1).to(feats.dtype) * FEATURE_NOISE
            h = self.packed(tokens, feats, lengths)
            # pair i predicts f_{i+1}; the last pair of each sequence is left out, as in the unrolled path
            keep = torch.cat([torch.arange(n) < n - 1 for n in lengths])
            nxt = torch.cat([s.final[1:] for s in seqs])[keep]
            h = h[keep].float()
            at = slice(int(tokens.sum()) % TOKEN_LOSS_STRIDE, None, TOKEN_LOSS_STRIDE)  # the token loss's pairs
            if PROMPT_WEIGHT == 1.0:
                return F.smooth_l1_loss(h, nxt) + CLS_WEIGHT * self.label_softmax.soft_loss(h[at], nxt[at])
            # pair i's next token is x_{i+2}: in the continuation when i + 2 >= prompt_len
            w = torch.cat([torch.where(torch.arange(n - 1) + 2 >= s.prompt_len, 1.0, PROMPT_WEIGHT)
                           for s, n in zip(seqs, lengths)])
            reg = (F.smooth_l1_loss(h, nxt, reduction="none").mean(-1) * w).sum() / w.sum()
            cls = (self.label_softmax.soft_loss(h[at], nxt[at], reduction="none") * w[at]).sum() / w[at].sum()
            return reg + CLS_WEIGHT * cls
        T = max(len(s.tokens) for s in seqs) - 1
        B, H = len(seqs), self.cfg.hidden_size
        tokens = torch.zeros(B, T + steps - 1, dtype=torch.int64)
        feats, states = torch.zeros(B, T, H), torch.zeros(B, T + steps, H)
        valid = torch.zeros(steps, B, T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            n = len(s.tokens) - 1  # pairs i = 0 .. n-1
            tokens[b, :n], feats[b, :n], states[b, :n + 1] = s.tokens[1:], s.final[:-1], s.final
            for j in range(steps):  # step j + 1 at pair i predicts f_{i+1+j}, kept for i + 1 + j <= n - 1
                valid[j, b, : n - 1 - j] = True
        # the unrolled steps run at every TTT_PAIR_STRIDE-th pair (an offset the batch picks), so a
        # step past the first costs about 1/stride of a pass
        pairs = torch.arange(int(tokens.sum()) % TTT_PAIR_STRIDE, T, TTT_PAIR_STRIDE)
        loss = 0.0
        for j, h in enumerate(self.unroll(tokens, feats, steps, pairs if steps > 1 else None)):
            at = torch.arange(T) if j == 0 else pairs
            nxt, v = states[:, at + 1 + j], valid[j][:, at]
            h = h[v].float()
            # soft labels at every pair: the target's own next-token distribution read off f_{i+1+j}
            loss = loss + STEP_WEIGHT ** j * (F.smooth_l1_loss(h, nxt[v])
                                              + CLS_WEIGHT * self.label_softmax.soft_loss(h, nxt[v]))
        return loss

    @torch.no_grad()
    def drafts(self, tokens: torch.Tensor, feats: torch.Tensor, k: int) -> list[int]:
        """Greedy chain from pairs (tokens int64[T], feats [T, H]), recomputed densely per draft."""
        toks, f, out = tokens, feats, []
        for _ in range(k):
            h = self.forward(toks[None], f[None])[0, -1]
            d = int((h @ self.lm.T).argmax()) if self.draft_ids is None else \
                int(self.draft_ids[(h @ self.lm[self.draft_ids].T).argmax()])
            out.append(d)
            toks, f = torch.cat([toks, torch.tensor([d])]), torch.cat([f, h[None]])
        return out

    _EXPORT_NAMES = {"fc_w": "fc.weight", "fc_b": "fc.bias", "q": "layers.0.self_attn.q_proj.weight",
                     "k": "layers.0.self_attn.k_proj.weight", "v": "layers.0.self_attn.v_proj.weight",
                     "o": "layers.0.self_attn.o_proj.weight", "gate": "layers.0.mlp.gate_proj.weight",
                     "up": "layers.0.mlp.up_proj.weight", "down": "layers.0.mlp.down_proj.weight",
                     "post_ln": "layers.0.post_attention_layernorm.weight"}

    def load_export(self, out: Path) -> None:
        """Take the parameters (and draft vocabulary) of a head this trainer's save() wrote."""
        from safetensors.torch import load_file

        t = load_file(str(Path(out) / "model.safetensors"))
        with torch.no_grad():
            for name, key in self._EXPORT_NAMES.items():
                self.params[name].copy_(t[key])
        self.draft_ids = None if "d2t" not in t else torch.arange(len(t["d2t"])) + t["d2t"]

    def save(self, out: Path, target) -> None:
        c, p = self.cfg, {k: v.detach() for k, v in self.params.items()}
        inter = c.intermediate_size
        hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": inter, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
              "head_dim": c.head_dim, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
              "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "hidden_act": "silu", "bias": True, "torch_dtype": "float32"}
        if c.rope_scaling is not None:
            hf["rope_scaling"] = dict(c.rope_scaling)
        t = {key: p[name] for name, key in self._EXPORT_NAMES.items()}
        if self.draft_ids is not None:  # specinfer's draft-vocabulary extension (spec_decode/eagle.py)
            hf["draft_vocab_size"] = len(self.draft_ids)
            t["d2t"] = self.draft_ids - torch.arange(len(self.draft_ids))
        write_checkpoint(out, hf, t, "model.safetensors")


@torch.no_grad()
def eagle_acceptance_estimate(trainer, seqs, K: int, per_seq: int = 6, feature: str = "final",
                              walk: bool = False) -> dict:
    """Chain acceptance at up to per_seq continuation positions of each held-out sequence (spread
    evenly), or with walk=True where the engine's greedy steps start chains: the first right after
    the prompt's bonus token, each next one past the last chain's accepted drafts and its bonus
    token. The trainer drafts from (tokens, the sequence's `feature` states: "final", or "aux" for
    EAGLE-3)."""
    accepted = []

    def chain(s, e):  # history x_0..x_e: pairs i = 0..e-1, drafts predict x_{e+1}..x_{e+K}
        d = trainer.drafts(s.tokens[1:e + 1], getattr(s, feature)[:e], K)
        ok = [a == b for a, b in zip(d, s.tokens[e + 1:e + 1 + K].tolist())]
        return next((i for i, x in enumerate(ok) if not x), K)

    for s in seqs:
        n = len(s.tokens)
        if walk:
            e = s.prompt_len
            while e + K < n:
                accepted.append(chain(s, e))
                e += accepted[-1] + 1
            continue
        ends = torch.linspace(s.prompt_len, n - K - 1, steps=per_seq).long().unique().tolist() if n - K - 1 > \
            s.prompt_len else []
        accepted += [chain(s, e) for e in ends]
    acc = torch.tensor(accepted or [0], dtype=torch.float32)
    at = [(acc >= i).float().sum().item() for i in range(K + 1)]
    return {"positions": len(accepted), "acceptance_per_position": [at[i + 1] / at[i] if at[i] else 0.0
                                                                    for i in range(K)],
            "mean_acceptance_length": 1.0 + float(acc.mean()), "acceptance_rate": float(acc.sum() / (len(acc) * K))}
