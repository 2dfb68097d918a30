"""EAGLE-3 head training by self-distillation (used by head_training.train for method "eagle3").

The head (spec_decode/eagle3.py) reads three target layers' inputs a_i (distill_data's `aux`),
g_i = fc(a_i), and one draft layer over x = cat(norm(embed(x_{i+1})), hidden_norm(g_i)) (2H wide);
its own norm and lm_head score a truncated draft vocabulary (the Vd tokens the target emits most in
the training continuations; `d2t` maps draft ids to target ids). As EAGLE-3 trains it: no feature
regression, only the token loss, with "training-time test" unrolling: step 1 feeds the target's
features; step s > 1 feeds the head's own step s-1 output at the same pair (token x_{i+s}), and its
query at position i + s - 1 sees step 1's keys at pair positions <= i and its own chain's keys of
steps 2..s at pair i — exactly what the engine's draft KV holds when it drafts (eagle_proposer;
the layer and its unrolling: draft_layer_unroll, shared with EAGLE-1's trainer).
Loss = sum_s 0.8^(s-1) CE(lm_head(norm(h_s)), x_{i+s+1}) over continuation positions whose label
is in the draft vocabulary. Initialisation: fc reads the last aux layer through, the norm and
lm_head start as the target's final norm and lm_head rows, o_proj and down_proj start at zero, so
the untrained head drafts roughly what the target's last layers would.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.models.rope import rope_table
from specinfer.training.draft_layer_unroll import UnrolledDraftLayer, rms
from specinfer.spec_decode.eagle3 import default_aux_layers
from specinfer.spec_decode.head_checkpoint import write_checkpoint

TTT_STEPS = 3  # unrolled steps per training position
STEP_WEIGHT = 0.8


def training_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The aux layers a trained head reads: EAGLE-3's {2, L//2, L-3}, or (0, L//2, L-1) for targets
    too shallow for it (L < 7; tests), written into the checkpoint's config either way."""
    if num_layers >= 7:
        return default_aux_layers(num_layers)
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads 3 distinct target layers; the target has {num_layers}")
    return (0, num_layers // 2, num_layers - 1)


def draft_vocabulary(seqs, vocab_size: int, size: int) -> torch.Tensor:
    """int64[Vd] target ids, ascending: the `size` tokens most frequent in the sequences (ties by id)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(s.tokens, minlength=vocab_size)
    size = min(size, vocab_size)
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))  # by count desc, then id
    return torch.sort(order[:size]).values


class Eagle3Trainer(UnrolledDraftLayer):
    def __init__(self, target, seqs, seed: int, draft_vocab_size: int, lm_head: torch.Tensor):
        c = target.config
        self.cfg, self.target_cfg = c, c
        self.aux_layers = training_aux_layers(c.num_layers)
        H, nh, nkv, d, inter = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).requires_grad_()

        self.tid = draft_vocabulary(seqs, c.vocab_size, draft_vocab_size)  # draft id -> target id
        self.t2d = torch.full((c.vocab_size,), -1, dtype=torch.int64)
        self.t2d[self.tid] = torch.arange(len(self.tid))
        norm_w = target.model.norm.detach().float()  # the final RMSNorm weight [H]
        self.params = {
            "fc": torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1).requires_grad_(),
            "in_ln": torch.ones(H, requires_grad=True), "hid_ln": torch.ones(H, requires_grad=True),
            "q": rnd(nh * d, 2 * H), "k": rnd(nkv * d, 2 * H), "v": rnd(nkv * d, 2 * H),
            "o": torch.zeros(H, nh * d, requires_grad=True),
            "post_ln": torch.ones(H, requires_grad=True),
            "gate": rnd(inter, H), "up": rnd(inter, H), "down": torch.zeros(H, inter, requires_grad=True),
            "norm": norm_w.clone().requires_grad_(),
            "lm_head": lm_head[self.tid].clone().requires_grad_()}
        self.embed = target.model.embed_tokens.detach().float()
        self.rope_cos, self.rope_sin = rope_table(c, c.max_position_embeddings)

    def _inputs(self, tokens, g):  # EAGLE-3: cat(norm(embed(x_{i+1})), hidden_norm(g_i)), 2H wide; g is the residual
        c, p = self.cfg, self.params
        return g, torch.cat([rms(self.embed[tokens], p["in_ln"], c.rms_norm_eps),
                             rms(g, p["hid_ln"], c.rms_norm_eps)], -1)

    def unroll_aux(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens int64[B, T + steps - 1], aux [B, T, 3H] -> per step the outputs [B, T, H]
        (draft_layer_unroll.UnrolledDraftLayer.unroll over g = fc(aux))."""
        return self.unroll(tokens, F.linear(aux, self.params["fc"]), steps)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        return rms(h, self.params["norm"], self.cfg.rms_norm_eps) @ self.params["lm_head"].T

    # ---- training --------------------------------------------------------------------------------
    def loss_on(self, seqs, steps: int = TTT_STEPS) -> torch.Tensor:
        T = max(len(s.tokens) for s in seqs) - 1
        B = len(seqs)
        tokens = torch.zeros(B, T + steps, dtype=torch.int64)
        aux = torch.zeros(B, T, seqs[0].aux.shape[1])
        labels = torch.full((steps, B, T), -100, dtype=torch.int64)
        for b, s in enumerate(seqs):
            n = len(s.tokens) - 1  # pairs i = 0 .. n-1: (x_{i+1}, a_i)
            tokens[b, :n] = s.tokens[1:]
            aux[b, :n] = s.aux[:-1]
            for j in range(steps):  # step j + 1 at pair i predicts x_{i+j+2}
                i = torch.arange(max(s.prompt_len - 2 - j, 0), n - 1 - j)
                labels[j, b, i] = self.t2d[s.tokens[i + j + 2]]
        labels[labels < 0] = -100  # labels outside the draft vocabulary teach nothing
        outs = self.unroll_aux(tokens, aux, steps)
        loss = 0.0
        for j, h in enumerate(outs):
            loss = loss + STEP_WEIGHT ** j * F.cross_entropy(self.draft_logits(h).view(B * T, -1),
                                                             labels[j].view(-1), ignore_index=-100)
        return loss

    @torch.no_grad()
    def drafts(self, tokens: torch.Tensor, aux: torch.Tensor, k: int) -> list[int]:
        """Greedy chain of k target ids after pairs (tokens int64[T] = x_1..x_T, aux [T, 3H])."""
        out = []
        toks = tokens[None]
        for s in range(k):
            hs = self.unroll_aux(toks, aux[None], s + 1)
            d = int(self.tid[self.draft_logits(hs[s][0, -1]).argmax()])
            out.append(d)
            toks = torch.cat([toks, torch.tensor([[d]])], 1)
        return out

    def save(self, out: Path, target) -> None:
        c, p = self.cfg, {k: v.detach() for k, v in self.params.items()}
        hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "vocab_size": c.vocab_size, "draft_vocab_size": len(self.tid),
              "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "hidden_act": "silu", "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}}
        if c.rope_scaling is not None:
            hf["rope_scaling"] = dict(c.rope_scaling)
        m = "midlayer."
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[self.tid] = True
        t = {"fc.weight": p["fc"], m + "input_layernorm.weight": p["in_ln"], m + "hidden_norm.weight": p["hid_ln"],
             m + "self_attn.q_proj.weight": p["q"], m + "self_attn.k_proj.weight": p["k"],
             m + "self_attn.v_proj.weight": p["v"], m + "self_attn.o_proj.weight": p["o"],
             m + "post_attention_layernorm.weight": p["post_ln"], m + "mlp.gate_proj.weight": p["gate"],
             m + "mlp.up_proj.weight": p["up"], m + "mlp.down_proj.weight": p["down"], "norm.weight": p["norm"],
             "lm_head.weight": p["lm_head"], "d2t": self.tid - torch.arange(len(self.tid)), "t2d": t2d}
        write_checkpoint(out, hf, t, "model.safetensors")
