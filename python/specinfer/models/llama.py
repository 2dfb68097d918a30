"""One decoder-only transformer over a flat varlen batch and a paged KV cache: Llama and the
families that differ from it in parts (ModelConfig's family fields, read by models/hf_config.py):
Mistral and Qwen2 (sliding windows, biases), Qwen3 (q/k norms per head), Gemma 2/3 (GeGLU,
scaled embeddings, sandwich norms, logit soft-caps, alternating sliding layers with their own
RoPE base), Phi-3 (fused checkpoint tensors, LongRoPE), and the mixture-of-experts Mixtral,
Qwen3-MoE and Qwen2-MoE (models/moe.py).

    hidden = model(input_ids, positions, ctx)   # [T, hidden]  final-normed
    logits = model.compute_logits(hidden[rows]) # float32[L, vocab]

A batch is any mix of prefill chunks, single-token decodes and 1 + k verification runs: the
model only sees T tokens with their positions, and attention (ctx.backend) sorts out which
sequence each token belongs to from ctx.metadata. Weights are stored fused — q/k/v in one
matrix, gate/up in one — so each layer runs four GEMMs; `load_weights` takes HF-named tensors
and copies them into the fused slices.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specinfer.attention.metadata import ForwardContext
from specinfer.models.config import ModelConfig
from specinfer.models.gguf_decoder import build_decoder, fused_forward, silu_mul
from specinfer.models.gguf_linear import GgufWeight, gguf_linear
from specinfer.models.int8_linear import Int8Weight, check_quantization, int8_linear
from specinfer.models.moe import SparseMoE
from specinfer.models.panel_linear import PanelWeight
from specinfer.models.packed_linear import dense_linear
from specinfer.models.rms_norm import rms_norm
from specinfer.models.rope import apply_rope, rope_factors, rope_table


_rms_norm = rms_norm
_QUANTIZED_LINEAR = {"int8": int8_linear, "w8a8": int8_linear, "gguf": gguf_linear}
_QUANTIZED_WEIGHTS = (Int8Weight, GgufWeight)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _param(*shape: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _gemm_weight(n: int, k: int, *, dtype, device, quantization: str | None):
    """A [n, k] GEMM weight: a dense parameter, int8 + scales with quantization="int8"/"w8a8", or
    a GGUF file's stored rows with quantization="gguf"."""
    if quantization in ("int8", "w8a8"):
        return Int8Weight(n, k, device=device)
    if quantization == "gguf":
        return GgufWeight(n, k)
    return _param(n, k, dtype=dtype, device=device)



LOADED_IN_PLACE = object()  # yielded by a loader for a tensor it wrote into float32_destinations()

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, quantization: str | None = None):
        super().__init__()
        # swapped by LlamaForCausalLM.pack_linear_weights; int8 weights have their own kernel
        self.linear = _QUANTIZED_LINEAR.get(quantization, dense_linear)
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.window = cfg.layer_window(layer_idx)  # sliding window of this layer (None: full)
        self.softcap = cfg.attn_softcap
        self.local_rope = cfg.layer_uses_local_rope(layer_idx)  # Gemma 3 sliding layers: their own table
        self.act = ACTIVATIONS[cfg.hidden_act]
        # a GGUF model's silu(gate) * up is the fused layers' own (models/gguf_decoder.py), so
        # its unfused layers (LayerSkip drafts, EAGLE-3 features) give the fused forward's bits
        self.gguf_silu = quantization == "gguf" and cfg.hidden_act == "silu"
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        h = cfg.hidden_size
        gemm = dict(dtype=dtype, device=device, quantization=quantization)
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_weight = _gemm_weight(q_size + 2 * kv_size, h, **gemm)  # rows: q | k | v
        self.qkv_bias = _param(q_size + 2 * kv_size, dtype=dtype, device=device) if cfg.attention_bias else None
        self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.o_weight = _gemm_weight(h, q_size, **gemm)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.attention_output_bias else None
        # Gemma's sandwich: norms on the attention output and the MLP output before each residual add
        self.attn_out_norm = _param(h, dtype=dtype, device=device) if cfg.sandwich_norms else None
        self.mlp_out_norm = _param(h, dtype=dtype, device=device) if cfg.sandwich_norms else None
        self.post_attention_norm = _param(h, dtype=dtype, device=device)  # the MLP's input norm
        self.moe = None
        if cfg.is_moe_layer(layer_idx):
            self.moe = SparseMoE(h, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.norm_topk_prob, lambda n, k: _gemm_weight(n, k, **gemm),
                                 lambda *shape: _param(*shape, dtype=dtype, device=device),
                                 cfg.shared_expert_intermediate_size,
                                 quantized=quantization is not None, activation=cfg.hidden_act)
            self.gate_up_weight = self.down_weight = None
        else:
            self.gate_up_weight = _gemm_weight(2 * cfg.intermediate_size, h, **gemm)  # rows: gate | up
            self.down_weight = _gemm_weight(h, cfg.intermediate_size, **gemm)
        self.tp = None  # TensorParallelGroup once sharded (models/tensor_parallel.py): o/down all-reduce

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream
        cos: torch.Tensor,  # [T, 1, D]   see rope_factors
        sin: torch.Tensor,  # [T, 1, D]   signed: (-sin | sin)
        ctx: ForwardContext,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cos, sin) of local layers (Gemma 3)
    ) -> torch.Tensor:  # [T, hidden]
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.local_rope:
            cos, sin = local_rope
        # input_norm None: no input layernorm (EAGLE-1's single draft layer)
        h = x if self.input_norm is None else _rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        linear = self.linear
        qkv = linear(h, self.qkv_weight, self.qkv_bias)  # [T, (H + 2 Hkv) D]
        if self.q_norm is None:
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D), cos, sin)  # [T, H+Hkv, D]
            q, k = qk[:, :H], qk[:, H:]
        else:  # per-head RMSNorm of q and k before the rotation
            q = _rms_norm(qkv[:, : self.q_size].reshape(T, H, D), (D,), self.q_norm, self.eps)
            k = _rms_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(T, Hkv, D), (D,), self.k_norm,
                          self.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
        options = {}
        if self.window is not None:
            options["window"] = self.window
        if self.softcap is not None:
            options["softcap"] = self.softcap
        attn = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                   **options)  # [T, H, D]
        if self.tp is None:
            o = linear(attn.reshape(T, H * D), self.o_weight, self.o_bias)
        else:  # row-parallel: partial sums over the group's heads, bias added once after the sum
            o = self.tp.all_reduce(linear(attn.reshape(T, H * D), self.o_weight), self.o_bias)
        if self.attn_out_norm is not None:
            o = _rms_norm(o, (o.shape[-1],), self.attn_out_norm, self.eps)
        x = x + o
        h = _rms_norm(x, (x.shape[-1],), self.post_attention_norm, self.eps)
        if self.moe is not None:
            down = self.moe(h, linear, self.act)
            if self.tp is not None:  # every rank holds a slice of every expert: partial sums
                down = self.tp.all_reduce(down)
        else:
            gate_up = linear(h, self.gate_up_weight)
            if self.gguf_silu and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
                act = silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = self.act(gate) * up
            down = linear(act, self.down_weight)
            if self.tp is not None:
                down = self.tp.all_reduce(down)
        if self.mlp_out_norm is not None:
            down = _rms_norm(down, (down.shape[-1],), self.mlp_out_norm, self.eps)
        return x + down

    def gemm_weight_names(self) -> tuple[str, ...]:
        return ("qkv_weight", "o_weight") + (() if self.moe is not None else ("gate_up_weight", "down_weight"))


class LlamaForCausalLM(nn.Module):
    """`quantization="int8"` (or "w8a8": same weights, activations rounded too): every GEMM weight (q|k|v, o, gate|up, down, the LM head and the
    embedding table it may be tied to) is int8 with per-32 scales (models/int8_linear.py),
    filled straight from GGUF Q8_0 blocks or quantized tensor by tensor as it loads; norms,
    biases and activations keep `dtype`."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device="cpu",
                 quantization: str | None = None):
        super().__init__()
        self.config = cfg
        self.num_layers = cfg.num_layers
        self.dtype = dtype
        self.quantization = quantization = check_quantization(quantization)
        if quantization is not None and torch.device(device).type != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on CPU only (device={device!s})")
        self.linear = _QUANTIZED_LINEAR.get(quantization, dense_linear)  # swapped by pack_linear_weights
        self.packed = False
        gemm = dict(dtype=dtype, device=device, quantization=quantization)
        self.embed_tokens = _gemm_weight(cfg.vocab_size, cfg.hidden_size, **gemm)
        if isinstance(self.embed_tokens, GgufWeight) and not cfg.tie_word_embeddings:
            self.embed_tokens.for_gemm = False  # rows looked up only: kept in the file's layout
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, quantization) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _gemm_weight(cfg.vocab_size, cfg.hidden_size, **gemm)
        # tensor parallelism (models/tensor_parallel.py): this rank's group, KV heads and vocab shard
        self.tp = None
        self.num_kv_heads = cfg.num_kv_heads
        self.vocab_start = 0
        cos, sin = rope_table(cfg, cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)  # float32[P, D/2]
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.has_local_rope = any(layer.local_rope for layer in self.layers)
        if self.has_local_rope:  # Gemma 3: the sliding layers' own (unscaled, other base) table
            cos, sin = rope_table(cfg, cfg.max_position_embeddings, local=True)
            self.register_buffer("rope_cos_local", cos.to(device), persistent=False)
            self.register_buffer("rope_sin_local", sin.to(device), persistent=False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged cache: (2 [k|v], num_blocks, block_size, num_kv_heads, head_dim)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.config.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64[T] -> [T, hidden]
        if self.tp is not None and self.tp.size > 1:  # vocab-parallel: rows outside the shard are zeros
            local = input_ids - self.vocab_start
            inside = (local >= 0) & (local < self.embed_tokens.shape[0])
            x = self._lookup(torch.where(inside, local, torch.zeros_like(local)))
            return self.tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))
        return self._lookup(input_ids)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, _QUANTIZED_WEIGHTS):
            x = self.embed_tokens.embedding(input_ids).to(self.dtype)
        else:
            x = F.embedding(input_ids, self.embed_tokens)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,  # int64[T]
        positions: torch.Tensor,  # int64[T] position of each token in its sequence
        ctx: ForwardContext,
        *,
        exit_layer: int | None = None,  # run only the first E layers, then the final norm (LayerSkip draft)
        aux_layers: tuple[int, ...] = (),  # also return the inputs of these layers (EAGLE-3 features)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """-> [T, hidden] final-normed hidden states; with aux_layers also [T, len(aux_layers) * hidden],
        the pre-norm residual stream entering each listed layer (0 = the embeddings), concatenated."""
        x = self.embed(input_ids)
        dtype = x.dtype
        cos, sin = rope_factors(self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype))  # [T, 1, D]
        local = None
        if self.has_local_rope:
            local = rope_factors(self.rope_cos_local[positions].to(dtype), self.rope_sin_local[positions].to(dtype))
        if exit_layer is None and not aux_layers and local is None and self._fused_gguf_decoder() is not None:
            # GGUF weights as stored: the layers in Rust, the same bits (models/gguf_decoder.py)
            if fused_forward(self, self._gguf_decoder, x, cos, sin, ctx):
                return _rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        captured = {}
        # slicing an nn.ModuleList builds a new one (0.15 ms a step): slice only for a LayerSkip draft
        for layer in (self.layers if exit_layer is None else self.layers[:exit_layer]):
            if layer.layer_idx in aux_layers:
                captured[layer.layer_idx] = x
            x = layer(x, cos, sin, ctx, local)
        hidden = _rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        if not aux_layers:
            return hidden
        return hidden, torch.cat([captured[i] for i in aux_layers], dim=-1)

    _gguf_decoder = None  # models/gguf_decoder.py: built at the first forward, False where it does not apply

    def _fused_gguf_decoder(self):
        if self._gguf_decoder is None:
            self._gguf_decoder = build_decoder(self) or False
        return self._gguf_decoder or None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [L, hidden] -> float32[L, vocab]
        if self.tp is not None and self.tp.size > 1:  # vocab-parallel: gather the shards, drop the padding
            logits = self.tp.all_gather_last(self.linear(hidden, self.lm_head).float())[:, : self.config.vocab_size]
        else:
            logits = self.linear(hidden, self.lm_head).float()
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: c * tanh(logits / c)
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32[n, hidden]: the lm_head rows of token ids (dense whatever the weights' form:
        plain, oneDNN-packed or int8). A head drafting over a truncated vocabulary scores these."""
        if self.tp is not None and self.tp.size > 1:
            raise ValueError("lm_head_rows: this rank holds only its vocab shard of the lm_head")
        w = self.lm_head
        if getattr(w, "is_mkldnn", False) or isinstance(w, PanelWeight):  # packed by the CPU platform:
            # the dense tied table, or unpacked
            w = self.embed_tokens if self.config.tie_word_embeddings else w.to_dense()
        if isinstance(w, _QUANTIZED_WEIGHTS):
            return w.dequantize(ids)
        return w[ids].float()

    def pack_linear_weights(self, pack, linear) -> None:
        """Replace every GEMM weight by pack(weight) and run GEMMs through `linear` (same contract
        as F.linear). One-way: afterwards the model serves inference only (load_weights refuses).
        Int8 weights keep their own kernel; under "w8a8" they move into its tiled layout here."""
        if self.quantization == "w8a8":
            for w in [self.lm_head, self.embed_tokens] + self._layer_gemm_weights():
                if isinstance(w, Int8Weight):
                    w.pack()
        if self.quantization is not None:
            return
        for layer in self.layers:
            for name in layer.gemm_weight_names():
                packed = pack(getattr(layer, name))
                delattr(layer, name)  # drop the parameter (and the dense copy with it)
                setattr(layer, name, packed)
            if layer.moe is not None:
                layer.moe.replace_gemm_weights(pack)
            layer.linear = linear
        lm_head = pack(self.lm_head)
        self._parameters.pop("lm_head")  # tied: embed_tokens keeps the dense copy for lookups
        self.lm_head = lm_head
        self.linear = linear
        self.packed = True

    # ---- weights -------------------------------------------------------------------------------

    def _layer_gemm_weights(self) -> list:
        out = []
        for layer in self.layers:
            out += [getattr(layer, n) for n in layer.gemm_weight_names()]
            if layer.moe is not None:
                out += layer.moe.gemm_weights()
        return out

    def weight_bytes(self) -> int:
        """Bytes held by the weights: dense, oneDNN-packed or int8 (values + scales)."""
        names = ("input_norm", "qkv_bias", "o_bias", "post_attention_norm", "q_norm", "k_norm", "attn_out_norm",
                 "mlp_out_norm")
        weights = [self.embed_tokens, self.lm_head, self.norm] + self._layer_gemm_weights()
        weights += [getattr(layer, n) for layer in self.layers for n in names]
        weights += [layer.moe.router for layer in self.layers if layer.moe is not None]
        weights += [layer.moe.shared_gate for layer in self.layers if layer.moe is not None]
        total, seen = 0, set()
        for w in weights:
            if w is None or id(w) in seen:
                continue
            seen.add(id(w))
            total += w.nbytes if isinstance(w, (*_QUANTIZED_WEIGHTS, PanelWeight)) else w.numel() * w.element_size()
        return total

    def _slots(self) -> dict[str, tuple[torch.Tensor, slice | None]]:
        """HF parameter name -> (our tensor, row slice of it that the HF tensor fills)."""
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        rows_q, rows_k, rows_v = slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)
        slots: dict[str, tuple[torch.Tensor, slice | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None),
            "model.norm.weight": (self.norm, None),
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, None)
        fused = cfg.architecture == "phi3"  # Phi-3 stores q|k|v and gate|up as one tensor each
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_norm, None)
            if cfg.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention output
                slots[p + "post_attention_layernorm.weight"] = (layer.attn_out_norm, None)
                slots[p + "pre_feedforward_layernorm.weight"] = (layer.post_attention_norm, None)
                slots[p + "post_feedforward_layernorm.weight"] = (layer.mlp_out_norm, None)
            else:
                slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_norm, None)
            if fused:
                slots[p + "self_attn.qkv_proj.weight"] = (layer.qkv_weight, None)
            else:
                for name, rows in (("q", rows_q), ("k", rows_k), ("v", rows_v)):
                    slots[p + f"self_attn.{name}_proj.weight"] = (layer.qkv_weight, rows)
                    if layer.qkv_bias is not None:
                        slots[p + f"self_attn.{name}_proj.bias"] = (layer.qkv_bias, rows)
            if layer.q_norm is not None:
                slots[p + "self_attn.q_norm.weight"] = (layer.q_norm, None)
                slots[p + "self_attn.k_norm.weight"] = (layer.k_norm, None)
            slots[p + "self_attn.o_proj.weight"] = (layer.o_weight, None)
            if layer.o_bias is not None:
                slots[p + "self_attn.o_proj.bias"] = (layer.o_bias, None)
            if layer.moe is not None:
                slots.update(_moe_slots(cfg, p, layer.moe))
            elif fused:
                slots[p + "mlp.gate_up_proj.weight"] = (layer.gate_up_weight, None)
                slots[p + "mlp.down_proj.weight"] = (layer.down_weight, None)
            else:
                slots[p + "mlp.gate_proj.weight"] = (layer.gate_up_weight, slice(0, inter))
                slots[p + "mlp.up_proj.weight"] = (layer.gate_up_weight, slice(inter, 2 * inter))
                slots[p + "mlp.down_proj.weight"] = (layer.down_weight, None)
        return slots

    def float32_destinations(self) -> dict[str, torch.Tensor]:
        """HF name -> the contiguous float32 parameter memory that tensor fills, for loaders that
        can write it in place (then yield LOADED_IN_PLACE to load_weights for it): a GGUF load
        then touches the weights' memory once instead of writing a temporary and copying it."""
        out = {}
        if self.packed:
            return out
        for name, (target, rows) in self._slots().items():
            if isinstance(target, torch.Tensor) and target.dtype == torch.float32:
                dest = target if rows is None else target[rows]
                if dest.is_contiguous():
                    out[name] = dest
        return out

    def stored_destinations(self) -> set[str]:
        """HF names of the tensors a GGUF loader hands over as stored (StoredTensor) under
        quantization="gguf": every GEMM weight's."""
        return {name for name, (target, _) in self._slots().items() if isinstance(target, GgufWeight)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint",
                     norms_include_offset: bool = False) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled once.

        Names the model does not use (rotary inv_freq buffers, a tied lm_head copy) are ignored;
        a missing tensor or a shape mismatch raises ValueError naming `source`. Norm weights are
        held as the multiplier itself: an HF Gemma norm w becomes 1 + w here, unless the source
        stores it so already (norms_include_offset: llama.cpp's GGUF files).
        """
        offset = 0.0 if norms_include_offset else self.config.norm_weight_offset
        if self.packed:
            raise RuntimeError("load_weights after pack_linear_weights: load dense weights first, then pack")
        slots = self._slots()
        tied_ok = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        loaded: set[str] = set()
        for name, tensor in weights:
            if tensor is LOADED_IN_PLACE:  # the loader wrote float32_destinations()[name] itself
                if name not in slots:
                    raise ValueError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
                loaded.add(name)
                continue
            if name not in slots:
                if name in tied_ok or name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            target, rows = slots[name]
            if isinstance(target, _QUANTIZED_WEIGHTS):
                want = target.rows_shape(rows)
            else:
                dest = target if rows is None else target[rows]
                want = tuple(dest.shape)
            if tuple(tensor.shape) != tuple(want):
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
            if offset and name.endswith("norm.weight"):
                tensor = tensor + offset
            if isinstance(target, _QUANTIZED_WEIGHTS):
                # Int8Weight: float quantized here, QuantizedTensor (GGUF Q8_0) copied; GgufWeight:
                # the StoredTensor kept as it is
                target.load(rows, tensor)
            else:
                dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(slots) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{source}: missing tensors {missing[:5]}{more}")


def _moe_slots(cfg: ModelConfig, p: str, moe: SparseMoE) -> dict:
    """HF names of one MoE layer's tensors -> (our tensor, row slice): Mixtral's block_sparse_moe
    (w1 gate, w3 up, w2 down) or Qwen's mlp (gate_proj, up_proj, down_proj; Qwen2-MoE's shared expert)."""
    I = moe.inter
    gate_up, down = moe.gate_up, moe.down  # views of the stacks (or int8 weights), taken once
    mixtral = cfg.architecture == "mixtral"
    m = p + ("block_sparse_moe." if mixtral else "mlp.")
    gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    slots = {m + "gate.weight": (moe.router, None)}
    for e in range(moe.num_experts):
        x = f"{m}experts.{e}."
        slots[x + gate_name + ".weight"] = (gate_up[e], slice(0, I))
        slots[x + up_name + ".weight"] = (gate_up[e], slice(I, 2 * I))
        slots[x + down_name + ".weight"] = (down[e], None)
    if moe.shared_gate_up is not None:
        S = moe.shared_inter
        slots[m + "shared_expert.gate_proj.weight"] = (moe.shared_gate_up, slice(0, S))
        slots[m + "shared_expert.up_proj.weight"] = (moe.shared_gate_up, slice(S, 2 * S))
        slots[m + "shared_expert.down_proj.weight"] = (moe.shared_down, None)
        slots[m + "shared_expert_gate.weight"] = (moe.shared_gate, None)
    return slots
