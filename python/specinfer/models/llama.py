"""One Llama-family decoder (Llama, Mistral, Qwen2) over a flat varlen batch and a paged KV cache.

    hidden = model(input_ids, positions, ctx)   # [T, hidden]  final-normed
    logits = model.compute_logits(hidden[rows]) # float32[L, vocab]

A batch is any mix of prefill chunks, single-token decodes and 1 + k verification runs: the
model only sees T tokens with their positions, and attention (ctx.backend) sorts out which
sequence each token belongs to from ctx.metadata. Weights are stored fused — q/k/v in one
matrix, gate/up in one — so each layer runs four GEMMs; `load_weights` takes HF-named tensors
and copies them into the fused slices.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specinfer.attention.metadata import ForwardContext
from specinfer.models.config import ModelConfig
from specinfer.models.int8_linear import Int8Weight, check_quantization, int8_linear
from specinfer.models.panel_linear import PanelWeight
from specinfer.models.packed_linear import dense_linear
from specinfer.models.rms_norm import rms_norm
from specinfer.models.rope import apply_rope, rope_factors, rope_table


_rms_norm = rms_norm


def _param(*shape: int, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _gemm_weight(n: int, k: int, *, dtype, device, quantization: str | None):
    """A [n, k] GEMM weight: a dense parameter, or int8 + scales with quantization="int8"."""
    if quantization in ("int8", "w8a8"):
        return Int8Weight(n, k, device=device)
    return _param(n, k, dtype=dtype, device=device)



LOADED_IN_PLACE = object()  # yielded by a loader for a tensor it wrote into float32_destinations()

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype, device, quantization: str | None = None):
        super().__init__()
        # swapped by LlamaForCausalLM.pack_linear_weights; int8 weights have their own kernel
        self.linear = int8_linear if quantization in ("int8", "w8a8") else dense_linear
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        h = cfg.hidden_size
        gemm = dict(dtype=dtype, device=device, quantization=quantization)
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_weight = _gemm_weight(q_size + 2 * kv_size, h, **gemm)  # rows: q | k | v
        self.qkv_bias = _param(q_size + 2 * kv_size, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_weight = _gemm_weight(h, q_size, **gemm)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.attention_output_bias else None
        self.post_attention_norm = _param(h, dtype=dtype, device=device)
        self.gate_up_weight = _gemm_weight(2 * cfg.intermediate_size, h, **gemm)  # rows: gate | up
        self.down_weight = _gemm_weight(h, cfg.intermediate_size, **gemm)
        self.tp = None  # TensorParallelGroup once sharded (models/tensor_parallel.py): o/down all-reduce

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream
        cos: torch.Tensor,  # [T, 1, D]   see rope_factors
        sin: torch.Tensor,  # [T, 1, D]   signed: (-sin | sin)
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # input_norm None: no input layernorm (EAGLE-1's single draft layer)
        h = x if self.input_norm is None else _rms_norm(x, (x.shape[-1],), self.input_norm, self.eps)
        linear = self.linear
        qkv = linear(h, self.qkv_weight, self.qkv_bias)  # [T, (H + 2 Hkv) D]
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D), cos, sin)  # [T, H+Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
        attn = ctx.backend.forward(
            qk[:, :H], qk[:, H:], v, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale
        )  # [T, H, D]
        if self.tp is None:
            x = x + linear(attn.reshape(T, H * D), self.o_weight, self.o_bias)
        else:  # row-parallel: partial sums over the group's heads, bias added once after the sum
            x = x + self.tp.all_reduce(linear(attn.reshape(T, H * D), self.o_weight), self.o_bias)
        h = _rms_norm(x, (x.shape[-1],), self.post_attention_norm, self.eps)
        gate, up = linear(h, self.gate_up_weight).chunk(2, dim=-1)
        down = linear(F.silu(gate) * up, self.down_weight)
        return x + (down if self.tp is None else self.tp.all_reduce(down))


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
        self.linear = int8_linear if quantization else dense_linear  # swapped by pack_linear_weights
        self.packed = False
        if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
            warnings.warn(
                f"sliding_window={cfg.sliding_window} is not applied: attention is full, so outputs "
                f"differ from the reference for contexts longer than {cfg.sliding_window} tokens",
                stacklevel=2,
            )
        gemm = dict(dtype=dtype, device=device, quantization=quantization)
        self.embed_tokens = _gemm_weight(cfg.vocab_size, cfg.hidden_size, **gemm)
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
        if isinstance(self.embed_tokens, Int8Weight):
            return self.embed_tokens.embedding(input_ids).to(self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

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
        captured = {}
        # slicing an nn.ModuleList builds a new one (0.15 ms a step): slice only for a LayerSkip draft
        for layer in (self.layers if exit_layer is None else self.layers[:exit_layer]):
            if layer.layer_idx in aux_layers:
                captured[layer.layer_idx] = x
            x = layer(x, cos, sin, ctx)
        hidden = _rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        if not aux_layers:
            return hidden
        return hidden, torch.cat([captured[i] for i in aux_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [L, hidden] -> float32[L, vocab]
        if self.tp is not None and self.tp.size > 1:  # vocab-parallel: gather the shards, drop the padding
            return self.tp.all_gather_last(self.linear(hidden, self.lm_head).float())[:, : self.config.vocab_size]
        return self.linear(hidden, self.lm_head).float()

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
        if isinstance(w, Int8Weight):
            return w.dequantize(ids)
        return w[ids].float()

    def pack_linear_weights(self, pack, linear) -> None:
        """Replace every GEMM weight by pack(weight) and run GEMMs through `linear` (same contract
        as F.linear). One-way: afterwards the model serves inference only (load_weights refuses).
        Int8 weights keep their own kernel; under "w8a8" they move into its tiled layout here."""
        if self.quantization == "w8a8":
            for w in [self.lm_head, self.embed_tokens] + [getattr(layer, n) for layer in self.layers for n in (
                    "qkv_weight", "o_weight", "gate_up_weight", "down_weight")]:
                if isinstance(w, Int8Weight):
                    w.pack()
        if self.quantization is not None:
            return
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        for layer in self.layers:
            for name in names:
                packed = pack(getattr(layer, name))
                delattr(layer, name)  # drop the parameter (and the dense copy with it)
                setattr(layer, name, packed)
            layer.linear = linear
        lm_head = pack(self.lm_head)
        self._parameters.pop("lm_head")  # tied: embed_tokens keeps the dense copy for lookups
        self.lm_head = lm_head
        self.linear = linear
        self.packed = True

    # ---- weights -------------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        """Bytes held by the weights: dense, oneDNN-packed or int8 (values + scales)."""
        names = ("input_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "post_attention_norm",
                 "gate_up_weight", "down_weight")
        weights = [self.embed_tokens, self.lm_head, self.norm]
        weights += [getattr(layer, n) for layer in self.layers for n in names]
        total, seen = 0, set()
        for w in weights:
            if w is None or id(w) in seen:
                continue
            seen.add(id(w))
            total += w.nbytes if isinstance(w, (Int8Weight, PanelWeight)) else w.numel() * w.element_size()
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
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_norm, None)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_norm, None)
            for name, rows in (("q", rows_q), ("k", rows_k), ("v", rows_v)):
                slots[p + f"self_attn.{name}_proj.weight"] = (layer.qkv_weight, rows)
                if layer.qkv_bias is not None:
                    slots[p + f"self_attn.{name}_proj.bias"] = (layer.qkv_bias, rows)
            slots[p + "self_attn.o_proj.weight"] = (layer.o_weight, None)
            if layer.o_bias is not None:
                slots[p + "self_attn.o_proj.bias"] = (layer.o_bias, None)
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

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint") -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled once.

        Names the model does not use (rotary inv_freq buffers, a tied lm_head copy) are ignored;
        a missing tensor or a shape mismatch raises ValueError naming `source`.
        """
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
            if isinstance(target, Int8Weight):
                want = target.rows_shape(rows)
            else:
                dest = target if rows is None else target[rows]
                want = tuple(dest.shape)
            if tuple(tensor.shape) != tuple(want):
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
            if isinstance(target, Int8Weight):
                target.load(rows, tensor)  # float: quantized here; QuantizedTensor (GGUF Q8_0): copied
            else:
                dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(slots) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"{source}: missing tensors {missing[:5]}{more}")
