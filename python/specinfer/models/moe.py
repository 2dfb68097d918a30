"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE) over a flat batch of tokens.

    out = moe(h, linear, act)   # h [T, hidden] -> [T, hidden]

Routing: softmax over the router's logits in float32, the top-k experts of each token, their
probabilities renormalized to sum to one where the checkpoint says so (Mixtral always; Qwen
`norm_topk_prob`). The T * k (token, expert) pairs are sorted by expert once; each expert that
any token chose then runs ONE gate|up GEMM and ONE down GEMM over all of its tokens — never a
loop per token. A verification run of 1 + k tokens activates more experts than a decode, so it
costs more (benches/moe_verify_cost.py); the goodput policy sees that through its step timings.

Three executions of the same arithmetic plan:
- the Rust kernel (`specinfer._core.moe_experts`, rust/kernels/src/moe.rs) on CPU for float32
  and bfloat16 weights: the whole layer's experts in one call, through the few-rows GEMM kernel,
  whose output rows do not depend on how many rows share a call, and each token's expert outputs
  summed in ascending expert order — so a token's result is the same bits in a decode, a
  verification run or any batch (greedy speculation stays token-for-token exact). Chosen for
  every row count (as the few-rows kernel is for float32 models when asked): a long prefill
  chunk pays for it (the kernel trails oneDNN from ~16 rows per expert);
- on CUDA, two Triton launches per layer (kernels/triton/fused_moe.py): every active expert's
  gate|up GEMM in one, every down GEMM in the other, over tiles of one expert each;
- torch (other devices, int8 experts, shapes the kernel does not take): per active expert,
  `linear` over its gathered tokens and `index_add_` in ascending expert order.

Weights: dense experts are stacked, gate|up [E, 2I, hidden] and down [E, hidden, I] (the layout
the kernel streams; never repacked); with quantization="int8"/"w8a8" each expert holds its own
Int8Weight pair run by the int8 kernels. Qwen2-MoE adds a shared expert on every token, gated
by sigmoid(shared_expert_gate . h), through the model's ordinary linear path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specinfer.models.few_rows_linear import few_rows_linear
from specinfer.models.packed_linear import dense_linear

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _kernel():
    try:
        from specinfer._core import moe_experts
    except ImportError:  # an extension built before the kernel existed
        return None
    return moe_experts


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 make_gemm, make_param, shared_inter: int = 0, *, quantized: bool = False,
                 activation: str = "silu"):
        """make_gemm(n, k) -> a [n, k] GEMM weight; make_param(*shape) -> a plain parameter."""
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob, self.inter = num_experts, top_k, norm_topk_prob, inter
        self.hidden, self.activation = hidden, activation
        self.router = make_param(num_experts, hidden)  # [E, hidden], applied in float32
        self.quantized = quantized
        if quantized:  # per expert: gate|up and down int8 weights (plain lists: not Parameters)
            self._gate_up = [make_gemm(2 * inter, hidden) for _ in range(num_experts)]
            self._down = [make_gemm(hidden, inter) for _ in range(num_experts)]
        else:
            self.w_gate_up = make_param(num_experts, 2 * inter, hidden)  # rows per expert: gate | up
            self.w_down = make_param(num_experts, hidden, inter)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if shared_inter:
            self.shared_inter = shared_inter
            self.shared_gate_up = make_gemm(2 * shared_inter, hidden)
            self.shared_down = make_gemm(hidden, shared_inter)
            self.shared_gate = make_param(1, hidden)

    @property
    def gate_up(self) -> list:
        """Each expert's gate|up weight (views of the stack, which load_weights fills)."""
        return self._gate_up if self.quantized else list(self.w_gate_up.unbind(0))

    @property
    def down(self) -> list:
        return self._down if self.quantized else list(self.w_down.unbind(0))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in h's dtype, expert ids int64[T, k]). On the kernel path the router
        runs through the few-rows kernel too (a BLAS GEMM's bits depend on the row count)."""
        if self._kernel_takes(h):
            logits = few_rows_linear(h.float(), self.router.float().contiguous())
        else:
            logits = F.linear(h.float(), self.router.float())
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def _kernel_takes(self, h: torch.Tensor) -> bool:
        if self.quantized or (torch.is_grad_enabled() and (h.requires_grad or self.w_gate_up.requires_grad)):
            return False
        w = self.w_gate_up
        return (h.device.type == "cpu" and w.device.type == "cpu" and w.dtype in _KERNEL_DTYPES
                and h.dtype in _KERNEL_DTYPES and self.hidden % 16 == 0 and self.inter % 16 == 0
                and w.is_contiguous() and self.w_down.is_contiguous() and _kernel() is not None)

    def forward(self, h: torch.Tensor, linear, act) -> torch.Tensor:
        weights, experts = self.route(h)  # (softmax, top-k: row by row, so batch-independent)
        flat = experts.flatten()  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = order // self.top_k
        pair_weight = weights.flatten()[order]
        if self._kernel_takes(h):
            out = self._run_kernel(h, token, pair_weight, counts)
        elif h.device.type == "cuda" and not self.quantized:
            out = self._run_triton(h, token, pair_weight, counts, act)
        else:
            out = self._run_torch(h, token, pair_weight, counts.tolist(), linear, act)
        if self.shared_gate_up is not None:
            gate, up = linear(h, self.shared_gate_up).chunk(2, dim=-1)
            shared = linear(act(gate) * up, self.shared_down)
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * shared
        return out

    def _run_kernel(self, h, token, pair_weight, counts) -> torch.Tensor:
        T = h.shape[0]
        x = h.to(torch.float32).contiguous()
        out = torch.empty(T, self.hidden, dtype=torch.float32)
        tok = token.to(torch.int32).contiguous()
        wts = pair_weight.to(torch.float32).contiguous()
        offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        _kernel()(x.data_ptr(), T, self.w_gate_up.data_ptr(), self.w_down.data_ptr(),
                  _KERNEL_DTYPES[self.w_gate_up.dtype], self.num_experts, self.hidden, self.inter, self.activation,
                  tok.data_ptr(), wts.data_ptr(), offsets.data_ptr(), int(tok.numel()), out.data_ptr(),
                  torch.get_num_threads())
        return out.to(h.dtype)

    def _run_triton(self, h, token, pair_weight, counts, act) -> torch.Tensor:
        from specinfer.kernels.triton.fused_moe import fused_moe

        return fused_moe(h, self.w_gate_up, self.w_down, token, pair_weight, counts, act)

    def _run_torch(self, h, token, pair_weight, counts, linear, act) -> torch.Tensor:
        if not self.quantized:
            linear = dense_linear  # stacked experts stay plain tensors whatever the model packs
        pair_weight = pair_weight.unsqueeze(1)
        out = torch.zeros_like(h)
        gate_up, down = self.gate_up, self.down
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token[start:start + n]
            gate, up = linear(h.index_select(0, rows), gate_up[e]).chunk(2, dim=-1)
            y = linear(act(gate) * up, down[e])
            out.index_add_(0, rows, y * pair_weight[start:start + n])
            start += n
        return out

    def active_experts(self, h: torch.Tensor) -> int:
        """How many distinct experts the tokens of h route to (what a step's MoE GEMMs cost)."""
        return int(torch.unique(self.route(h)[1]).numel())

    def gemm_weights(self) -> list:
        experts = list(self.gate_up) + list(self.down) if self.quantized else [self.w_gate_up, self.w_down]
        shared = [self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else []
        return experts + shared

    def replace_gemm_weights(self, fn) -> None:
        """The shared expert's GEMM weights w become fn(w) (the platform's packing); routed experts
        keep their layout (stacked for the kernel, or int8)."""
        if self.shared_gate_up is not None:
            for name in ("shared_gate_up", "shared_down"):
                w = fn(getattr(self, name))
                self._parameters.pop(name, None)
                setattr(self, name, w)
