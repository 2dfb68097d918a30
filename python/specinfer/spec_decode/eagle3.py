"""EAGLE-3 draft head (arXiv 2503.01840; SafeAILab/EAGLE `cnets.py`, vLLM `llama_eagle3.py`).

It reads three target layers' inputs (pre-norm residual stream) a_l at aux layers l (default
{2, L//2, L-3}, or config `eagle_config.eagle_aux_hidden_state_layer_ids`; concatenated in
ascending layer order, as vLLM collects them) and has its own norm, lm_head and (truncated) vocabulary:

    g = fc(cat(a_l1, a_l2, a_l3))  at target positions;  g = previous draft output  at draft steps
    x = cat(input_layernorm(embed(tok)), hidden_norm(g))         # [T, 2H]
    h = g + o_proj(Attn_rope(q, k, v = proj(x)))                 # q/k/v projections take 2H inputs
    h = h + MLP(post_attention_layernorm(h))
    draft id = argmax(lm_head(norm(h)))  -> target id = draft id + d2t[draft id];  next feature = h

Checkpoint: config.json (Llama fields, num_hidden_layers 1, draft_vocab_size, optional
target_hidden_size) and `model.safetensors` / `pytorch_model.bin` with `fc.weight` [H, 3E],
`midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight` [Vd, H], `d2t` int64[Vd]
(required when Vd < V), optional `t2d` bool[V] (checked against d2t), optional `embed_tokens.weight`.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from specinfer.attention.metadata import ForwardContext
from specinfer.models.config import ModelConfig
from specinfer.spec_decode.draft_kv_records import NUM_PRIVATE_BLOCKS
from specinfer.models.int8_linear import any_linear, quantized
from specinfer.models.llama import _rms_norm
from specinfer.spec_decode.head_quantization import refuse_saving_quantized
from specinfer.models.tensor_parallel import (check_shardable, kv_heads_of_rank, vocab_parallel_embedding,
                                               vocab_parallel_logits, vocab_rows)
from specinfer.models.rope import apply_rope, rope_factors, rope_table
from specinfer.spec_decode.head_checkpoint import TensorSet, read_config, read_tensors, write_checkpoint

_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "hidden_norm.weight", "post_attention_layernorm.weight")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


# the GEMM weights of an EAGLE-3 head (quantize() makes them int8)
GEMMS = ("fc.weight", "lm_head.weight") + tuple(
    "midlayer." + n + ".weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


class Eagle3Draft:
    num_layers = 1
    quantization = None  # "int8" once quantize() ran

    def __init__(self, cfg: ModelConfig, hf_config: dict, w: dict, aux_layers, d2t, t2d, embed, own_embed):
        self.config, self.hf_config, self.w = cfg, hf_config, w  # w: tensors by checkpoint name (midlayer.*)
        self.aux_layers = aux_layers  # ascending target layer ids
        self.d2t, self.t2d = d2t, t2d  # int64[Vd] offsets; bool[V] or None
        self.embed_tokens, self.own_embed = embed, own_embed
        self.scale = cfg.head_dim ** -0.5
        self.dtype = w["fc.weight"].dtype  # activations'
        cos, sin = rope_table(cfg, cfg.max_position_embeddings)
        self.rope_cos, self.rope_sin = cos.to(w["fc.weight"].device), sin.to(w["fc.weight"].device)
        self.target_draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # draft id -> target id
        self.target_embed = None  # the target's embedding lookup (vocab-parallel under TP) when not own_embed
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads  # this rank's, once sharded

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        # the proposer's private blocks follow the shared pool (EagleProposer, prefix-cache hits)
        return (2, num_blocks + NUM_PRIVATE_BLOCKS, block_size, self.num_kv_heads, self.config.head_dim)

    tp = None  # TensorParallelGroup once sharded

    def shard(self, tp) -> None:
        """Keep this rank's shard: q/k/v and gate/up rows of its heads and MLP columns, o and down
        columns (all-reduced), vocab rows of lm_head and of an own embedding; fc and the norms
        stay whole."""
        if tp.size == 1:
            return
        c, w, m = self.config, self.w, "midlayer."
        check_shardable(c, tp.size)
        D = c.head_dim
        k0, k1 = kv_heads_of_rank(c.num_kv_heads, tp.rank, tp.size)
        hq, inter = c.num_heads // tp.size, c.intermediate_size // tp.size
        q, kv, i = slice(tp.rank * hq * D, (tp.rank + 1) * hq * D), slice(k0 * D, k1 * D), slice(tp.rank * inter,
                                                                                              (tp.rank + 1) * inter)
        for name, rows in (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv),
                           ("mlp.gate_proj", i), ("mlp.up_proj", i)):
            w[m + name + ".weight"] = w[m + name + ".weight"][rows].contiguous()
        for name, cols in (("self_attn.o_proj", q), ("mlp.down_proj", i)):
            w[m + name + ".weight"] = w[m + name + ".weight"][:, cols].contiguous()
        w["lm_head.weight"] = vocab_rows(w["lm_head.weight"], tp)
        if self.own_embed:
            self.embed_tokens = vocab_rows(self.embed_tokens, tp)
        self.num_heads, self.num_kv_heads, self.tp = hq, k1 - k0, tp

    def gemm_weights(self) -> list:
        """The weights quantize() makes int8."""
        return [self.w[name] for name in GEMMS]

    def quantize(self, quantization: str) -> None:
        """GEMM weights as int8 (spec_decode/head_quantization.py); after shard()."""
        for name in GEMMS:
            self.w[name] = quantized(self.w[name], name)
        self.quantization = quantization

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:  # row-parallel partial sums -> the whole
        return x if self.tp is None else self.tp.all_reduce(x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.own_embed or self.target_embed is None:
            return vocab_parallel_embedding(tokens, self.embed_tokens, self.tp)
        return self.target_embed(tokens)

    def target_features(self, hidden, rows: torch.Tensor) -> torch.Tensor:  # TargetHidden -> [T', H] g
        return any_linear(hidden.aux[rows].to(self.dtype), self.w["fc.weight"])

    def forward(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """tokens int64[T], g [T, H], positions int64[T] -> [T, H] pre-norm draft features."""
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        T, H = g.shape
        m = "midlayer."
        x = torch.cat([_rms_norm(self.embed(tokens), (H,), w[m + "input_layernorm.weight"], eps),
                       _rms_norm(g, (H,), w[m + "hidden_norm.weight"], eps)], -1)  # [T, 2H]
        nh, nkv = self.num_heads, self.num_kv_heads
        q = any_linear(x, w[m + "self_attn.q_proj.weight"]).view(T, nh, c.head_dim)
        k = any_linear(x, w[m + "self_attn.k_proj.weight"]).view(T, nkv, c.head_dim)
        v = any_linear(x, w[m + "self_attn.v_proj.weight"]).view(T, nkv, c.head_dim)
        cos, sin = rope_factors(self.rope_cos[positions].to(g.dtype), self.rope_sin[positions].to(g.dtype))
        qk = apply_rope(torch.cat([q, k], 1), cos, sin)
        attn = ctx.backend.forward(qk[:, :nh], qk[:, nh:], v, ctx.kv_caches[0], ctx.metadata, self.scale)  # [T, nh, D]
        h = g + self._reduce(any_linear(attn.reshape(T, -1), w[m + "self_attn.o_proj.weight"]))
        u = _rms_norm(h, (H,), w[m + "post_attention_layernorm.weight"], eps)
        u = F.silu(any_linear(u, w[m + "mlp.gate_proj.weight"])) * any_linear(u, w[m + "mlp.up_proj.weight"])
        return h + self._reduce(any_linear(u, w[m + "mlp.down_proj.weight"]))

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [P, H] -> [P, Vd] over the draft vocabulary
        return vocab_parallel_logits(_rms_norm(h, (h.shape[-1],), self.w["norm.weight"], self.config.rms_norm_eps),
                                     self.w["lm_head.weight"], self.tp, len(self.d2t))

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:  # [P, H] -> int64[P] target ids
        return self.target_draft_ids[self._draft_logits(h).argmax(-1)]

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[P, H] -> float32[P, V]: the draft logits at their target ids, -inf at ids outside the
        draft vocabulary (probability 0 under any sampling parameters)."""
        d = self._draft_logits(h).float()
        out = torch.full((d.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32, device=d.device)
        out[:, self.target_draft_ids] = d
        return out

    # ---- checkpoint -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        refuse_saving_quantized(self)
        t = dict(self.w, d2t=self.d2t)
        if self.t2d is not None:
            t["t2d"] = self.t2d
        if self.own_embed:
            t["embed_tokens.weight"] = self.embed_tokens
        write_checkpoint(path, self.hf_config, t, "model.safetensors")

    @classmethod
    def load(cls, path: Path, *, target, dtype, device) -> "Eagle3Draft":
        src = str(path)
        hf = read_config(path, "EAGLE-3")
        try:
            cfg = ModelConfig.from_hf_config(dict(hf, model_type=hf.get("model_type", "llama")))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{src}: config.json is not a Llama-family EAGLE-3 config ({e})") from e
        tcfg = target.config
        H, E, V = cfg.hidden_size, tcfg.hidden_size, tcfg.vocab_size
        if cfg.num_layers != 1:
            raise ValueError(f"{src}: config field 'num_hidden_layers' is {cfg.num_layers}; an EAGLE-3 head has 1")
        if hf.get("target_hidden_size", H) != E:
            field = "target_hidden_size" if "target_hidden_size" in hf else "hidden_size"
            raise ValueError(f"{src}: config field {field!r} is {hf.get(field)}, but the target's hidden size is {E}")
        if cfg.vocab_size != V:
            raise ValueError(f"{src}: config field 'vocab_size' is {cfg.vocab_size}, but the target's vocabulary "
                             f"has {V} tokens")
        Vd = hf.get("draft_vocab_size", V)
        if not isinstance(Vd, int) or not 1 <= Vd <= V:
            raise ValueError(f"{src}: config field 'draft_vocab_size' must be an integer in 1..{V} (got {Vd!r})")
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(sorted(ids)) if ids is not None else default_aux_layers(tcfg.num_layers)
        if len(aux) != 3 or len(set(aux)) != 3 or not all(0 <= i < tcfg.num_layers for i in aux):
            field = "eagle_config.eagle_aux_hidden_state_layer_ids" if ids is not None else "num_hidden_layers"
            raise ValueError(f"{src}: the aux layers {list(aux)} ({field}) must be 3 distinct target layers in "
                             f"0..{tcfg.num_layers - 1} (the default {{2, L//2, L-3}} needs a target of >= 7 layers)")
        raw, file = read_tensors(path, _FILES)
        raw = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in raw.items()}
        ts = TensorSet(raw, file, dtype=dtype, device=device)
        nh, nkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        shapes = [(nh * d, 2 * H), (nkv * d, 2 * H), (nkv * d, 2 * H), (H, nh * d), (inter, H), (inter, H),
                  (H, inter), (H,), (H,), (H,)]
        w = {"midlayer." + n: ts.take("midlayer." + n, s) for n, s in zip(_NAMES, shapes)}
        w["fc.weight"] = ts.take("fc.weight", (H, 3 * E))
        w["norm.weight"] = ts.take("norm.weight", (H,))
        w["lm_head.weight"] = ts.take("lm_head.weight", (Vd, H))
        d2t, t2d = read_draft_vocabulary(ts, file, Vd, V, device)
        own = ts.has("embed_tokens.weight")
        embed = ts.take("embed_tokens.weight", (V, H)) if own else target.model.embed_tokens
        if not own and H != E:
            raise ValueError(f"{file}: missing tensor 'embed_tokens.weight' (the draft width {H} differs from the "
                             f"target's {E}, so the target's embedding cannot stand in)")
        ts.finish()
        draft = cls(cfg, copy.deepcopy(hf), w, aux, d2t, t2d, embed, own)
        draft.target_embed = target.model.embed
        return draft


def read_draft_vocabulary(ts: TensorSet, file: str, Vd: int, V: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft vocabulary of a head checkpoint: `d2t` int64[Vd] offsets (draft id + d2t = target
    id; required when Vd < V), optional `t2d` bool[V] checked against it. -> (d2t, t2d or None)."""
    if ts.has("d2t"):
        d2t = ts.take("d2t", (Vd,), dtype=torch.int64)
    elif Vd == V:
        d2t = torch.zeros(Vd, dtype=torch.int64, device=device)
    else:
        raise ValueError(f"{file}: missing tensor 'd2t' (draft_vocab_size {Vd} < vocab_size {V}: without it "
                         "draft ids cannot be mapped to target ids)")
    tid = torch.arange(Vd, device=d2t.device) + d2t
    if int(tid.min()) < 0 or int(tid.max()) >= V or len(set(tid.tolist())) != Vd:
        raise ValueError(f"{file}: tensor 'd2t' maps draft ids outside [0, {V}) or two onto one target id")
    t2d = None
    if ts.has("t2d"):
        t2d = ts.take("t2d", (V,), dtype=torch.bool)
        if int(t2d.sum()) != Vd or not bool(t2d[tid].all()):
            raise ValueError(f"{file}: tensor 't2d' disagrees with 'd2t' (it must mark exactly the mapped ids)")
    return d2t, t2d
