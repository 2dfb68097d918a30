"""Medusa heads (arXiv 2401.10774): head k reads the target's final hidden state h_t and predicts
x_{t+2+k} through L residual blocks `x + SiLU(W x + b)` and its own lm_head (or the target's).

Two public layouts load:
- original repository (FasterDecoding/Medusa): config.json `{medusa_num_heads, medusa_num_layers}`
  and `medusa_lm_head.safetensors` / `.pt` with `{k}.{j}.linear.weight` [H, H], `{k}.{j}.linear.bias`
  [H], `{k}.{L}.weight` [V, H]; legacy heads lack `{k}.{L}.weight` and use the target's lm_head.
- vLLM (`MedusaModel`): config.json `{hidden_size, vocab_size, num_heads, num_hidden_layers,
  medusa_fc_bias, truncated_vocab_size, original_lm_head}` and `model.safetensors` with
  `blocks.{k}.layers.{j}.weight|bias`, `lm_heads.{k}.weight` [V_t, H] (one shared head when
  original_lm_head), optional `token_map` int64[V_t] (draft row -> target token id; a full-size
  stored head is gathered by it). Keys may carry a `medusa_heads.` prefix.
Biases present in the file are used even where vLLM's config flag would drop them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.models.tensor_parallel import shard_rows_keeping_ties, vocab_parallel_logits
from specinfer.spec_decode.head_checkpoint import TensorSet, read_config, read_tensors, write_checkpoint
from specinfer.models.int8_linear import any_linear
from specinfer.spec_decode.head_quantization import quantize_list, refuse_saving_quantized
from specinfer.spec_decode.head_proposer import HiddenStateHeadProposer, checkpoint_dir, draft_chain

ORIGINAL, VLLM = "medusa", "vllm"


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int  # K
    num_layers: int  # L residual blocks per head
    hidden_size: int  # H (the target's)
    vocab_size: int  # V (the target's)
    truncated_vocab_size: int  # V_t rows of each lm_head (== V unless token_map)
    layout: str  # ORIGINAL | VLLM (what save() writes back)


class MedusaHeads:
    def __init__(self, cfg: MedusaConfig, block_w, block_b, lm_heads, token_map, target_logits):
        self.cfg = cfg
        self.block_w = block_w  # [K][L] Tensor[H, H]
        self.block_b = block_b  # [K][L] Tensor[H] or None (vLLM layout without medusa_fc_bias)
        self.lm_heads = lm_heads  # [K] Tensor[V_t, H] (may be the same object), or None: target's lm_head
        self.token_map = token_map  # int64[V_t] draft row -> target id, or None
        self.target_logits = target_logits  # callable [P, H] -> [P, V] (legacy shared head)
        self.dtype = block_w[0][0].dtype  # activations'

    quantization = None  # "int8" once quantize() ran

    def gemm_weights(self) -> list:
        """The weights quantize() makes int8."""
        return [w for ws in self.block_w for w in ws] + list(self.lm_heads or [])

    def quantize(self, quantization: str) -> None:
        """The residual blocks' and the own lm_heads' weights as int8 (a shared head stays one
        weight; spec_decode/head_quantization.py); after shard()."""
        self.block_w = [quantize_list(ws, f"blocks.{k}") for k, ws in enumerate(self.block_w)]
        if self.lm_heads is not None:
            self.lm_heads = quantize_list(self.lm_heads, "lm_heads")
        self.quantization = quantization

    reads_parent = False  # head k sees only h_t, never the tokens drafted before
    tp = None  # TensorParallelGroup once sharded: each rank keeps vocab rows of the lm_heads

    def shard(self, tp) -> None:
        """Keep this rank's vocab-parallel rows of every lm_head (a shared head stays shared);
        the residual blocks (H x H) stay whole. A legacy head uses the target's sharded lm_head."""
        self.tp = tp
        if self.lm_heads is not None:
            self.lm_heads = shard_rows_keeping_ties(self.lm_heads, tp)

    @property
    def num_stages(self) -> int:
        return self.cfg.num_heads

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.cfg.truncated_vocab_size

    def start(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [P, H] -> [P, H]
        return hidden.to(self.dtype)

    def stage(self, k: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head k on h_t (state [P, H]; tokens ignored) -> (state, logits [P, V]) over the target's
        vocabulary (-inf outside token_map)."""
        x = state
        for j in range(self.cfg.num_layers):
            b = self.block_b[k][j] if self.block_b is not None else None
            x = x + F.silu(any_linear(x, self.block_w[k][j], b))
        logits = (self.target_logits(x) if self.lm_heads is None else
                  vocab_parallel_logits(x, self.lm_heads[k], self.tp, self.cfg.truncated_vocab_size))
        if self.token_map is not None:  # [P, V_t] -> [P, V]
            full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
            full[:, self.token_map] = logits
            logits = full
        return state, logits

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """hidden [P, H] (h_t) -> int64[P, steps]: head k's argmax predicts x_{t+2+k}."""
        return draft_chain(self, hidden, tokens, steps)

    # ---- checkpoint -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        refuse_saving_quantized(self)
        c = self.cfg
        t = {}
        if c.layout == ORIGINAL:
            for k in range(c.num_heads):
                for j in range(c.num_layers):
                    t[f"{k}.{j}.linear.weight"] = self.block_w[k][j]
                    t[f"{k}.{j}.linear.bias"] = self.block_b[k][j]
                if self.lm_heads is not None:
                    t[f"{k}.{c.num_layers}.weight"] = self.lm_heads[k]
            cfg = {"medusa_num_heads": c.num_heads, "medusa_num_layers": c.num_layers}
            write_checkpoint(path, cfg, t, "medusa_lm_head.safetensors")
            return
        shared = self.lm_heads is not None and all(h is self.lm_heads[0] for h in self.lm_heads)
        for k in range(c.num_heads):
            for j in range(c.num_layers):
                t[f"blocks.{k}.layers.{j}.weight"] = self.block_w[k][j]
                if self.block_b is not None:
                    t[f"blocks.{k}.layers.{j}.bias"] = self.block_b[k][j]
            if self.lm_heads is not None and (k == 0 or not shared):
                t[f"lm_heads.{k}.weight"] = self.lm_heads[k]
        if self.token_map is not None:
            t["token_map"] = self.token_map
        cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
               "vocab_size": c.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
               "truncated_vocab_size": c.truncated_vocab_size, "medusa_fc_bias": self.block_b is not None,
               "original_lm_head": shared}
        write_checkpoint(path, cfg, t, "model.safetensors")

    @classmethod
    def load(cls, path: Path, *, hidden_size: int, vocab_size: int, target_logits, dtype, device) -> "MedusaHeads":
        cfg = read_config(path, "Medusa")
        if "medusa_num_heads" in cfg and "architectures" not in cfg:
            return _load_original(path, cfg, hidden_size, vocab_size, target_logits, dtype, device)
        return _load_vllm(path, cfg, hidden_size, vocab_size, target_logits, dtype, device)


def _int_field(cfg: dict, names: tuple[str, ...], source: str, default=None) -> int:
    for n in names:
        if n in cfg:
            v = cfg[n]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{source}: config field {n!r} must be a positive integer (got {v!r})")
            return v
    if default is None:
        raise ValueError(f"{source}: config lacks {names[0]!r}")
    return default


def _load_original(path, cfg, H, V, target_logits, dtype, device) -> MedusaHeads:
    src = str(path)
    K = _int_field(cfg, ("medusa_num_heads",), src)
    L = _int_field(cfg, ("medusa_num_layers",), src, 1)
    raw, file = read_tensors(path, ("medusa_lm_head.safetensors", "medusa_lm_head.pt"))
    found = {int(n.split(".")[0]) for n in raw if n.split(".")[0].isdigit()}
    if found and max(found) + 1 != K:
        raise ValueError(f"{src}: config field 'medusa_num_heads' is {K} but {file.name} holds {max(found) + 1} "
                         "heads (some uploads carry a wrong count); correct the config")
    ts = TensorSet(raw, file, dtype=dtype, device=device)
    w = [[ts.take(f"{k}.{j}.linear.weight", (H, H)) for j in range(L)] for k in range(K)]
    b = [[ts.take(f"{k}.{j}.linear.bias", (H,)) for j in range(L)] for k in range(K)]
    own = [ts.has(f"{k}.{L}.weight") for k in range(K)]
    if any(own) and not all(own):
        missing = next(k for k in range(K) if not own[k])
        raise ValueError(f"{file}: missing tensor '{missing}.{L}.weight' (other heads have their own lm_head)")
    heads = [ts.take(f"{k}.{L}.weight", (V, H)) for k in range(K)] if all(own) else None
    ts.finish()
    return MedusaHeads(MedusaConfig(K, L, H, V, V, ORIGINAL), w, b, heads, None, target_logits)


def _load_vllm(path, cfg, H, V, target_logits, dtype, device) -> MedusaHeads:
    src = str(path)
    if cfg.get("hidden_size") != H:
        raise ValueError(f"{src}: config field 'hidden_size' is {cfg.get('hidden_size')!r}, but the target's "
                         f"hidden size is {H}")
    if cfg.get("vocab_size") != V:
        raise ValueError(f"{src}: config field 'vocab_size' is {cfg.get('vocab_size')!r}, but the target's "
                         f"vocabulary has {V} tokens")
    K = _int_field(cfg, ("num_heads", "medusa_num_heads"), src, 5)
    L = _int_field(cfg, ("num_hidden_layers", "medusa_num_layers"), src, 1)
    Vt = _int_field(cfg, ("truncated_vocab_size",), src, V)
    if Vt > V:
        raise ValueError(f"{src}: config field 'truncated_vocab_size' ({Vt}) exceeds vocab_size ({V})")
    raw, file = read_tensors(path, ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    prefix = "medusa_heads." if any(k.startswith("medusa_heads.") for k in raw) else ""
    raw = {k.removeprefix(prefix): v for k, v in raw.items()}
    ts = TensorSet(raw, file, dtype=dtype, device=device, prefix=prefix)
    w = [[ts.take(f"blocks.{k}.layers.{j}.weight", (H, H)) for j in range(L)] for k in range(K)]
    has_bias = bool(cfg.get("medusa_fc_bias", False)) or ts.has("blocks.0.layers.0.bias")
    b = [[ts.take(f"blocks.{k}.layers.{j}.bias", (H,)) for j in range(L)] for k in range(K)] if has_bias else None
    token_map = None
    if Vt < V or ts.has("token_map"):
        token_map = ts.take("token_map", (Vt,), dtype=torch.int64)
        if int(token_map.min()) < 0 or int(token_map.max()) >= V:
            raise ValueError(f"{file}: tensor 'token_map' holds ids outside the target vocabulary [0, {V})")
    n_heads = 1 if cfg.get("original_lm_head", False) else K
    heads = []
    for k in range(n_heads):
        name = f"lm_heads.{k}.weight"
        full = ts.has(name) and tuple(ts.tensors[name].shape) == (V, H) and Vt < V
        head = ts.take(name, (V, H) if full else (Vt, H))
        heads.append(head[token_map] if full else head)
    heads = heads * K if n_heads == 1 else heads
    ts.finish()
    return MedusaHeads(MedusaConfig(K, L, H, V, Vt, VLLM), w, b, heads, token_map, target_logits)


class MedusaProposer(HiddenStateHeadProposer):
    @staticmethod
    def load_head(path, target, *, dtype, device) -> MedusaHeads:
        """target: the LoadedModel (its sizes, and its lm_head for legacy heads)."""
        tcfg = target.config
        return MedusaHeads.load(checkpoint_dir(path), hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                                target_logits=target.model.compute_logits, dtype=dtype, device=device)

    def __init__(self, spec, ctx):
        head = ctx.load_head(spec.method, spec.model)
        self.check_tree(spec.token_tree, head, "Medusa heads (number of heads)", spec.model)
        self.check_k(spec.num_speculative_tokens, head.cfg.num_heads, "Medusa heads (number of heads)", spec.model)
        super().__init__(head, spec.num_speculative_tokens, spec.token_tree)
