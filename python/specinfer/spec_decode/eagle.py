"""EAGLE-1 draft head (arXiv 2401.15077; SafeAILab/EAGLE `cnets1.py`), also used by EAGLE-2.

Draft position i consumes the pair (token x_{i+1}, target feature f_i) at RoPE position i, where
f_i is the target's final post-norm hidden state at position i:

    x = fc(cat(embed(x_{i+1}), f_i))              # [T, H] (fc has a bias unless config "bias": false)
    h = x + Attn(x)                               # no input layernorm in the single layer
    h = h + MLP(post_attention_layernorm(h))
    logits = target_lm_head(h); next feature = h  # no final norm

Checkpoint (public EAGLE-1 layout): config.json = a Llama config with num_hidden_layers 1 (and an
optional "bias"; absent means True); `pytorch_model.bin` or `model.safetensors` with `fc.weight`
[H, 2H], `fc.bias` [H], `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}
_proj.weight`, `layers.0.post_attention_layernorm.weight`, optionally `embed_tokens.weight` (else
the target's embedding) and `layers.0.input_layernorm.weight` (applied if present). No norm, no
lm_head: the target's lm_head is used.

Draft vocabulary (a specinfer extension, written by `specinfer train-heads --method eagle`): with a
config field `draft_vocab_size` Vd < V and a tensor `d2t` int64[Vd] (EAGLE-3's offsets: draft id +
d2t = target id), the head scores only those Vd rows of the target's lm_head — on CPU the
lm_head is most of a head's cost (under tensor parallelism, where the target's lm_head is split by
vocabulary, the gathered logits are cut to it instead). Drafts never leave that vocabulary (q is 0
outside it).
Checkpoints without them draft over the whole vocabulary, as everywhere else.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from specinfer.attention.metadata import ForwardContext
from specinfer.models.config import ModelConfig
from specinfer.spec_decode.draft_kv_records import NUM_PRIVATE_BLOCKS
from specinfer.spec_decode.eagle3 import read_draft_vocabulary
from specinfer.models.int8_linear import any_linear, quantized
from specinfer.models.llama import DecoderLayer
from specinfer.spec_decode.head_quantization import DECODER_GEMMS, quantize_decoder_layer, refuse_saving_quantized
from specinfer.models.tensor_parallel import shard_decoder_layer, vocab_parallel_embedding, vocab_rows
from specinfer.models.rope import rope_factors, rope_table
from specinfer.spec_decode.head_checkpoint import TensorSet, read_config, read_tensors, write_checkpoint

_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class EagleDraft:
    """The draft layer over its own paged KV (one cache tensor: `num_layers` = 1)."""

    num_layers = 1
    quantization = None  # "int8" once quantize() ran

    def __init__(self, cfg: ModelConfig, hf_config: dict, layer: DecoderLayer, fc_w, fc_b, embed, own_embed: bool,
                 target_logits, d2t: torch.Tensor | None = None, lm_rows: torch.Tensor | None = None):
        self.config, self.hf_config = cfg, hf_config
        self.layer, self.fc_w, self.fc_b, self.embed_tokens = layer, fc_w, fc_b, embed
        self.own_embed = own_embed  # embed_tokens came from the checkpoint (saved back) or the target
        self.target_logits = target_logits  # [P, H] -> float32[P, V]
        self.target_embed = None  # the target's embedding lookup (vocab-parallel under TP) when not own_embed
        self.dtype = fc_w.dtype  # activations'
        self.num_kv_heads = cfg.num_kv_heads  # this rank's, once sharded
        self.d2t, self.lm_rows = d2t, lm_rows  # draft vocabulary: offsets int64[Vd], lm_head rows [Vd, H]
        self.target_draft_ids = None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t
        cos, sin = rope_table(cfg, cfg.max_position_embeddings)
        self.rope_cos, self.rope_sin = cos.to(fc_w.device), sin.to(fc_w.device)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        # the proposer's private blocks follow the shared pool (EagleProposer, prefix-cache hits)
        return (2, num_blocks + NUM_PRIVATE_BLOCKS, block_size, self.num_kv_heads, self.config.head_dim)

    tp = None  # TensorParallelGroup once sharded

    def shard(self, tp) -> None:
        """Keep this rank's shard of the layer (attention heads by KV group, MLP columns; o and
        down all-reduced) and of an own embedding (vocab rows); fc stays whole. The target's
        embedding and lm_head are its own shards already."""
        if tp.size == 1:
            return
        self.tp = tp
        _, self.num_kv_heads = shard_decoder_layer(self.layer, self.config, tp)
        if self.own_embed:
            self.embed_tokens = vocab_rows(self.embed_tokens, tp)

    def gemm_weights(self) -> list:
        """The weights quantize() makes int8."""
        layer = [getattr(self.layer, n) for n in DECODER_GEMMS]
        return [self.fc_w, *layer] + ([] if self.lm_rows is None else [self.lm_rows])

    def quantize(self, quantization: str) -> None:
        """GEMM weights (fc, the layer, the draft vocabulary's lm_head rows) as int8
        (spec_decode/head_quantization.py); after shard(), before any forward."""
        self.fc_w = quantized(self.fc_w, "fc.weight")
        quantize_decoder_layer(self.layer, "layers.0")
        if self.lm_rows is not None:
            self.lm_rows = quantized(self.lm_rows, "lm_head rows")
        self.quantization = quantization

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.own_embed or self.target_embed is None:
            return vocab_parallel_embedding(tokens, self.embed_tokens, self.tp)
        return self.target_embed(tokens)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """tokens int64[T] (x_{i+1}), features [T, H] (f_i), positions int64[T] (i) -> [T, H] draft features."""
        x = any_linear(torch.cat([self.embed(tokens).to(self.dtype), features.to(self.dtype)], -1),
                       self.fc_w, self.fc_b)
        dtype = x.dtype
        cos, sin = rope_factors(self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype))
        return self.layer(x, cos, sin, ctx)

    aux_layers = ()  # reads only the target's final hidden state

    def target_features(self, hidden, rows: torch.Tensor) -> torch.Tensor:  # TargetHidden -> [T', H] f_i
        return hidden.final[rows]

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [P, H] -> [P, Vd] over the draft vocabulary
        if self.lm_rows is None:  # under TP the rows are spread over the ranks: the gathered logits, cut
            return self.target_logits(h)[:, self.target_draft_ids]
        return any_linear(h.to(self.dtype), self.lm_rows)

    def draft_tokens(self, h: torch.Tensor) -> torch.Tensor:  # [P, H] -> int64[P] target ids
        if self.d2t is None:
            return self.target_logits(h).argmax(-1)
        return self.target_draft_ids[self._draft_logits(h).argmax(-1)]

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.d2t is None else len(self.d2t)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[P, H] -> float32[P, V] over the target vocabulary (-inf outside a draft vocabulary)."""
        if self.d2t is None:
            return self.target_logits(h)
        d = self._draft_logits(h).float()
        out = torch.full((d.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32, device=d.device)
        out[:, self.target_draft_ids] = d
        return out

    # ---- checkpoint -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        refuse_saving_quantized(self)
        c, L = self.config, self.layer
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        t = {"fc.weight": self.fc_w,
             "layers.0.self_attn.q_proj.weight": L.qkv_weight[:q],
             "layers.0.self_attn.k_proj.weight": L.qkv_weight[q:q + kv],
             "layers.0.self_attn.v_proj.weight": L.qkv_weight[q + kv:],
             "layers.0.self_attn.o_proj.weight": L.o_weight,
             "layers.0.mlp.gate_proj.weight": L.gate_up_weight[:inter],
             "layers.0.mlp.up_proj.weight": L.gate_up_weight[inter:],
             "layers.0.mlp.down_proj.weight": L.down_weight,
             "layers.0.post_attention_layernorm.weight": L.post_attention_norm}
        if self.fc_b is not None:
            t["fc.bias"] = self.fc_b
        if L.input_norm is not None:
            t["layers.0.input_layernorm.weight"] = L.input_norm
        if self.own_embed:
            t["embed_tokens.weight"] = self.embed_tokens
        if self.d2t is not None:
            t["d2t"] = self.d2t
        cfg = dict(self.hf_config, bias=self.fc_b is not None)
        write_checkpoint(path, cfg, t, "model.safetensors")

    @classmethod
    def load(cls, path: Path, *, target, dtype, device) -> "EagleDraft":
        """target: the LoadedModel (its config, embedding and lm_head)."""
        src = str(path)
        hf = read_config(path, "EAGLE")
        if hf.get("model_type") == "eagle" and isinstance(hf.get("model"), dict):
            raise ValueError(f"{src}: this is vLLM V0's EAGLE wrapper layout (model_type 'eagle'); give the "
                             "original EAGLE checkpoint (a plain Llama config.json)")
        try:
            cfg = ModelConfig.from_hf_config(hf)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{src}: config.json is not a Llama-family config ({e})") from e
        tcfg = target.config
        if cfg.num_layers != 1:
            raise ValueError(f"{src}: config field 'num_hidden_layers' is {cfg.num_layers}; an EAGLE-1 head has 1")
        if cfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"{src}: config field 'hidden_size' is {cfg.hidden_size}, but the target's hidden "
                             f"size is {tcfg.hidden_size}")
        if cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{src}: config field 'vocab_size' is {cfg.vocab_size}, but the target's vocabulary "
                             f"has {tcfg.vocab_size} tokens")
        raw, file = read_tensors(path, _FILES)
        prefix = "model." if any(k.startswith("model.layers.") for k in raw) else ""
        raw = {k.removeprefix(prefix): v for k, v in raw.items()}
        ts = TensorSet(raw, file, dtype=dtype, device=device, prefix=prefix)
        H = cfg.hidden_size
        fc_w = ts.take("fc.weight", (H, 2 * H))
        bias = hf.get("bias", True)  # EAGLE's ea_model.py: no "bias" key means a bias
        fc_b = ts.take("fc.bias", (H,)) if bias or ts.has("fc.bias") else None
        layer = DecoderLayer(cfg, 0, dtype, device)
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        with torch.no_grad():
            p = "layers.0."
            for name, rows, width in (("q", slice(0, q), q), ("k", slice(q, q + kv), kv),
                                      ("v", slice(q + kv, q + 2 * kv), kv)):
                layer.qkv_weight[rows] = ts.take(p + f"self_attn.{name}_proj.weight", (width, H))
                if layer.qkv_bias is not None:
                    layer.qkv_bias[rows] = ts.take(p + f"self_attn.{name}_proj.bias", (width,))
            layer.o_weight.copy_(ts.take(p + "self_attn.o_proj.weight", (H, q)))
            if layer.o_bias is not None:
                layer.o_bias.copy_(ts.take(p + "self_attn.o_proj.bias", (H,)))
            layer.gate_up_weight[:inter] = ts.take(p + "mlp.gate_proj.weight", (inter, H))
            layer.gate_up_weight[inter:] = ts.take(p + "mlp.up_proj.weight", (inter, H))
            layer.down_weight.copy_(ts.take(p + "mlp.down_proj.weight", (H, inter)))
            layer.post_attention_norm.copy_(ts.take(p + "post_attention_layernorm.weight", (H,)))
            if ts.has(p + "input_layernorm.weight"):
                layer.input_norm.copy_(ts.take(p + "input_layernorm.weight", (H,)))
            else:
                layer.input_norm = None
        own = ts.has("embed_tokens.weight")
        embed = ts.take("embed_tokens.weight", (cfg.vocab_size, H)) if own else target.model.embed_tokens
        V = cfg.vocab_size
        Vd = hf.get("draft_vocab_size", V)
        if not isinstance(Vd, int) or isinstance(Vd, bool) or not 1 <= Vd <= V:
            raise ValueError(f"{src}: config field 'draft_vocab_size' must be an integer in 1..{V} (got {Vd!r})")
        d2t = lm_rows = None
        if Vd < V or ts.has("d2t"):
            d2t, _ = read_draft_vocabulary(ts, file, Vd, V, device)
            tp = target.model.tp
            if tp is None or tp.size == 1:  # (under TP the target's lm_head is vocab-parallel: no rows here)
                lm_rows = target.model.lm_head_rows(torch.arange(Vd, device=d2t.device) + d2t).to(dtype)
        ts.finish()
        draft = cls(cfg, copy.deepcopy(hf), layer, fc_w, fc_b, embed, own, target.model.compute_logits, d2t, lm_rows)
        draft.target_embed = target.model.embed
        return draft
