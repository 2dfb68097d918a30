"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE) over a flat batch of tokens.

    out = moe(h, linear, act)   # h [T, hidden] -> [T, hidden]

Routing: softmax over the router's logits in float32, the top-k experts of each token, their
probabilities renormalized to sum to one where the checkpoint says so (Mixtral always; Qwen
`norm_topk_prob`). Execution is grouped by expert: the T * k (token, expert) pairs are sorted by
expert once, and each expert that any token chose runs ONE gate|up GEMM and ONE down GEMM over
all of its tokens (a verification run of 1 + k tokens activates more experts than a decode —
the policy sees that cost through its step timings). Each token's outputs are summed into it
in ascending expert order whatever the batch, so a token's result does not depend on which
other tokens share the step. Qwen2-MoE adds a shared expert on every token, gated by
sigmoid(shared_expert_gate . h).

Expert weights are one GEMM weight per expert (dense, oneDNN-packed or int8, like every other
GEMM weight of the model), so every linear kernel of the CPU platform runs them unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 make_gemm, make_param, shared_inter: int = 0):
        """make_gemm(n, k) -> a [n, k] GEMM weight; make_param(*shape) -> a plain parameter."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob, self.inter = num_experts, top_k, norm_topk_prob, inter
        self.router = make_param(num_experts, hidden)  # [E, hidden], applied in float32
        # per expert: rows gate | up, and down; plain lists (the weights may be int8 or packed objects)
        self.gate_up = [make_gemm(2 * inter, hidden) for _ in range(num_experts)]
        self.down = [make_gemm(hidden, inter) for _ in range(num_experts)]
        for e in range(num_experts):  # registered by name too, so .to() and state walks see them
            if isinstance(self.gate_up[e], nn.Parameter):
                self.register_parameter(f"gate_up_{e}", self.gate_up[e])
                self.register_parameter(f"down_{e}", self.down[e])
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if shared_inter:
            self.shared_inter = shared_inter
            self.shared_gate_up = make_gemm(2 * shared_inter, hidden)
            self.shared_down = make_gemm(hidden, shared_inter)
            self.shared_gate = make_param(1, hidden)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in h's dtype, expert ids int64[T, k])."""
        probs = torch.softmax(F.linear(h.float(), self.router.float()), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, linear, act) -> torch.Tensor:
        T = h.shape[0]
        weights, experts = self.route(h)
        flat = experts.flatten()  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        pair_weight = weights.flatten()[order].unsqueeze(1)
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start:start + n]
            gate, up = linear(h.index_select(0, rows), self.gate_up[e]).chunk(2, dim=-1)
            y = linear(act(gate) * up, self.down[e])
            out.index_add_(0, rows, y * pair_weight[start:start + n])
            start += n
        if self.shared_gate_up is not None:
            gate, up = linear(h, self.shared_gate_up).chunk(2, dim=-1)
            shared = linear(act(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * shared
        return out

    def active_experts(self, h: torch.Tensor) -> int:
        """How many distinct experts the tokens of h route to (what a step's MoE GEMMs cost)."""
        return int(torch.unique(self.route(h)[1]).numel())

    def gemm_weights(self) -> list:
        shared = [self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else []
        return list(self.gate_up) + list(self.down) + shared

    def replace_gemm_weights(self, fn) -> None:
        """Every GEMM weight w becomes fn(w) (packing, quantization); registrations follow."""
        for e in range(self.num_experts):
            self._parameters.pop(f"gate_up_{e}", None)
            self._parameters.pop(f"down_{e}", None)
        self.gate_up = [fn(w) for w in self.gate_up]
        self.down = [fn(w) for w in self.down]
        if self.shared_gate_up is not None:
            for name in ("shared_gate_up", "shared_down"):
                w = fn(getattr(self, name))
                self._parameters.pop(name, None)
                setattr(self, name, w)
