"""IBM MLP speculator ("accelerator", arXiv 2404.19124; fms-extras `speculator.py`, vLLM
`mlp_speculator.py`): n_predict MLP stages on the target's final hidden state.

    a = 0.5 ** (0.5 / n_predict); b = sqrt((1 - a^2) * D / 2)
    s = h_t  (scale_input: s = rmsnorm(s) / sqrt(2));  y = x_{t+1}
    stage i: s = GELU(LN_i(proj_i(s) + (b / a) * emb_i(y)));  y = argmax(head_i(s))   -> x_{t+2+i}
    LN(u) = w * u * rsqrt(mean(u^2) + 1e-6) + b      (no mean subtraction)

HF checkpoint layout: config.json (MLPSpeculatorConfig) + model.safetensors (or sharded with an
index, or pytorch_model.bin) with keys `speculator.emb.{i}.weight` [V, D], `speculator.proj.0.weight`
[D, E], `speculator.proj.{i>=1}.weight` [D, D], `speculator.head.{i}.weight` [V, D],
`speculator.ln.{i}.weight|bias` [D]; the prefix is optional (vLLM/fms strip it); inner_dim 0
means D = E; no ln0 tensors. tie_weights shares emb/head/ln with index 0 and proj.{i>=2} with
proj.1: tied copies may be stored (they must then be equal) or left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.models.int8_linear import any_linear
from specinfer.models.tensor_parallel import shard_rows_keeping_ties, vocab_parallel_embedding, vocab_parallel_logits
from specinfer.spec_decode.head_checkpoint import TensorSet, read_config, read_tensors, write_checkpoint
from specinfer.spec_decode.head_proposer import HiddenStateHeadProposer, checkpoint_dir, draft_chain
from specinfer.spec_decode.head_quantization import quantize_list, refuse_saving_quantized

_EPS = 1e-6
_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    vocab_size: int  # V
    emb_dim: int  # E, the target's hidden size
    inner_dim: int  # D (0 in the file means D = E; stored here resolved)
    n_predict: int  # stages
    tie_weights: bool = False
    scale_input: bool = False
    top_k_tokens_per_head: tuple[int, ...] = ()  # kept for saving; trees come from speculative.token_tree
    n_candidates: int = 5

    @classmethod
    def from_hf(cls, cfg: dict, source: str) -> "MLPSpeculatorConfig":
        for name in ("vocab_size", "emb_dim", "n_predict"):
            v = cfg.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{source}: config field {name!r} must be a positive integer (got {v!r})")
        inner = cfg.get("inner_dim", 0)
        if not isinstance(inner, int) or inner < 0:
            raise ValueError(f"{source}: config field 'inner_dim' must be an integer >= 0 (got {inner!r})")
        n = cfg["n_predict"]
        topk = tuple(cfg.get("top_k_tokens_per_head") or [1] * n)
        if len(topk) != n:
            raise ValueError(f"{source}: config field 'top_k_tokens_per_head' has {len(topk)} entries, "
                             f"n_predict is {n}")
        return cls(cfg["vocab_size"], cfg["emb_dim"], inner or cfg["emb_dim"], n, bool(cfg.get("tie_weights", False)),
                   bool(cfg.get("scale_input", False)), topk, int(cfg.get("n_candidates", 5)))

    def to_hf(self) -> dict:
        return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                "vocab_size": self.vocab_size, "emb_dim": self.emb_dim, "inner_dim": self.inner_dim,
                "n_predict": self.n_predict, "top_k_tokens_per_head": list(self.top_k_tokens_per_head),
                "n_candidates": self.n_candidates, "tie_weights": self.tie_weights, "scale_input": self.scale_input}


class MLPSpeculator:
    """The stages' weights as lists (tied stages hold the same tensor object)."""

    def __init__(self, cfg: MLPSpeculatorConfig, emb, proj, head, ln_w, ln_b):
        self.cfg = cfg
        self.emb, self.proj, self.head, self.ln_w, self.ln_b = emb, proj, head, ln_w, ln_b  # n_predict each
        a = 0.5 ** (0.5 / cfg.n_predict)
        self.emb_scale = math.sqrt((1 - a * a) * cfg.inner_dim / 2) / a
        self.dtype = proj[0].dtype  # activations'

    @classmethod
    def random(cls, cfg: MLPSpeculatorConfig, seed: int = 0, dtype=torch.float32) -> "MLPSpeculator":
        """fms initialisation: N(0, 1/sqrt(D)) matrices, LN weight 1 and bias 0."""
        g = torch.Generator().manual_seed(seed)
        V, E, D, n = cfg.vocab_size, cfg.emb_dim, cfg.inner_dim, cfg.n_predict

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(D)).to(dtype)

        one = lambda make: [make()] * n if cfg.tie_weights else [make() for _ in range(n)]  # noqa: E731
        emb, head = one(lambda: rnd(V, D)), one(lambda: rnd(V, D))
        ln_w, ln_b = one(lambda: torch.ones(D, dtype=dtype)), one(lambda: torch.zeros(D, dtype=dtype))
        proj = [rnd(D, E)] + (([rnd(D, D)] * (n - 1)) if cfg.tie_weights else [rnd(D, D) for _ in range(n - 1)])
        return cls(cfg, emb, proj, head, ln_w, ln_b)

    reads_parent = True  # stage i reads the state and the token drafted before it
    tp = None  # TensorParallelGroup once sharded: each rank keeps vocab rows of emb and head

    quantization = None  # "int8" once quantize() ran

    def gemm_weights(self) -> list:
        """The weights quantize() makes int8."""
        return [*self.proj, *self.head]

    def quantize(self, quantization: str) -> None:
        """Projections and heads as int8 (tied stages stay tied; embeddings stay dense: rows are
        looked up; spec_decode/head_quantization.py); after shard()."""
        self.proj = quantize_list(self.proj, "proj")
        self.head = quantize_list(self.head, "head")
        self.quantization = quantization

    def shard(self, tp) -> None:
        """Keep this rank's vocab-parallel rows of the stages' embeddings and heads (tied stages
        stay tied); projections and norms stay whole."""
        self.tp = tp
        self.emb = shard_rows_keeping_ties(self.emb, tp)
        self.head = shard_rows_keeping_ties(self.head, tp)

    @property
    def num_stages(self) -> int:
        return self.cfg.n_predict

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.vocab_size

    def start(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [P, E] -> [P, E]
        s = hidden.to(self.dtype)
        if self.cfg.scale_input:
            s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + _EPS) / math.sqrt(2)
        return s

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """state [P, E or D], tokens int64[P] (the previous token) -> (state [P, D], logits [P, V])."""
        u = any_linear(state, self.proj[i]) + self.emb_scale * vocab_parallel_embedding(tokens, self.emb[i], self.tp)
        u = self.ln_w[i] * (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + _EPS)) + self.ln_b[i]
        s = F.gelu(u)
        return s, vocab_parallel_logits(s, self.head[i], self.tp, self.cfg.vocab_size)

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """hidden [P, E] (h_t), tokens int64[P] (x_{t+1}) -> int64[P, steps] argmax drafts."""
        return draft_chain(self, hidden, tokens, steps)

    # ---- checkpoint -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """HF layout (`speculator.` prefix); tied stages store only what vLLM reads (emb.0, head.0,
        ln.0, proj.0, proj.1), which the loader accepts too."""
        refuse_saving_quantized(self)
        t = {}
        for i in range(self.cfg.n_predict):
            p = f"speculator.{{}}.{i}.{{}}"
            if i == 0 or not self.cfg.tie_weights:
                t[p.format("emb", "weight")] = self.emb[i]
                t[p.format("head", "weight")] = self.head[i]
                t[p.format("ln", "weight")] = self.ln_w[i]
                t[p.format("ln", "bias")] = self.ln_b[i]
            if i <= 1 or not self.cfg.tie_weights:
                t[p.format("proj", "weight")] = self.proj[i]
        write_checkpoint(path, self.cfg.to_hf(), t, "model.safetensors")

    @classmethod
    def load(cls, path: Path, *, hidden_size: int, vocab_size: int, dtype, device) -> "MLPSpeculator":
        src = str(path)
        cfg = MLPSpeculatorConfig.from_hf(read_config(path, "MLP speculator"), src)
        if cfg.emb_dim != hidden_size:
            raise ValueError(f"{src}: config field 'emb_dim' is {cfg.emb_dim}, but the target's hidden size is "
                             f"{hidden_size}")
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"{src}: config field 'vocab_size' is {cfg.vocab_size}, but the target's vocabulary "
                             f"has {vocab_size} tokens")
        raw, file = read_tensors(path, _FILES)
        prefixed = any(k.startswith("speculator.") for k in raw)
        raw = {(k[len("speculator."):] if prefixed and k.startswith("speculator.") else k): v for k, v in raw.items()}
        ts = TensorSet(raw, file, dtype=dtype, device=device, prefix="speculator." if prefixed else "")
        V, E, D, n = cfg.vocab_size, cfg.emb_dim, cfg.inner_dim, cfg.n_predict
        emb, proj, head, ln_w, ln_b = [], [], [], [], []
        for i in range(n):
            tied = cfg.tie_weights and i > 0
            src_i = 0 if tied else i
            for lst, name, shape in ((emb, "emb.{}.weight", (V, D)), (head, "head.{}.weight", (V, D)),
                                     (ln_w, "ln.{}.weight", (D,)), (ln_b, "ln.{}.bias", (D,))):
                if tied:
                    lst.append(lst[0])
                    ts.take_tied_copy(name.format(i), lst[0], name.format(src_i))
                else:
                    lst.append(ts.take(name.format(i), shape))
            if cfg.tie_weights and i >= 2:
                proj.append(proj[1])
                ts.take_tied_copy(f"proj.{i}.weight", proj[1], "proj.1.weight")
            else:
                proj.append(ts.take(f"proj.{i}.weight", (D, E) if i == 0 else (D, D)))
        ts.finish()
        return cls(cfg, emb, proj, head, ln_w, ln_b)


class MLPSpeculatorProposer(HiddenStateHeadProposer):
    @staticmethod
    def load_head(path, target, *, dtype, device) -> MLPSpeculator:
        tcfg = target.config
        return MLPSpeculator.load(checkpoint_dir(path), hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                                  dtype=dtype, device=device)

    def __init__(self, spec, ctx):
        head = ctx.load_head(spec.method, spec.model)
        self.check_tree(spec.token_tree, head, "MLP speculator (n_predict)", spec.model)
        self.check_k(spec.num_speculative_tokens, head.cfg.n_predict, "MLP speculator (n_predict)", spec.model)
        super().__init__(head, spec.num_speculative_tokens, spec.token_tree)
