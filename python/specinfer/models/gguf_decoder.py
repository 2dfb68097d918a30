"""The decoder layers of a GGUF model as stored, in Rust: one call per forward
(`specinfer._core.GgufDecoder`, rust/kernels/src/gguf_decoder.rs) instead of ~25 torch and
kernel calls per layer, which at 135M parameters cost more than the GEMMs' share (SmolLM2-135M:
~3 ms of a 16 ms decode step). The MLP's activation is `silu_mul` (Rust), which the unfused
layers of a GGUF model call too.

Every step is the kernel the unfused layer calls or the same IEEE operations in the same order,
so the fused forward's bits equal `DecoderLayer.forward`'s (tests/test_gguf_decoder.py); the
model takes it wherever it applies — plain Llama-family layers (no MoE, q/k norms, sandwich
norms, windows, soft-caps or local rope; any rope scaling: the factors come from Python),
float32, the cpu_native attention backend in its batch-invariant mode (always so under gguf) —
and the unfused layers elsewhere (and for a LayerSkip draft or EAGLE-3 features, which read
the residual stream between layers). `SPECINFER_GGUF_FUSED=0` turns it off (an A/B switch).
"""
from __future__ import annotations

import os

import torch

from specinfer._core import GgufDecoder, gguf_silu_mul


def build_decoder(model) -> GgufDecoder | None:
    """The fused layers of `model` (a LlamaForCausalLM whose weights are final), or None where
    they do not apply. The model keeps every weight the decoder points into alive."""
    from specinfer.models.gguf_linear import GgufWeight

    cfg = model.config
    if (os.environ.get("SPECINFER_GGUF_FUSED", "1") == "0" or model.quantization != "gguf"
            or cfg.hidden_act != "silu" or model.dtype != torch.float32 or model.tp is not None or not len(model.layers)):
        return None
    layers = []
    for layer in model.layers:
        if (layer.moe is not None or layer.q_norm is not None or layer.attn_out_norm is not None
                or layer.mlp_out_norm is not None or layer.window is not None or layer.softcap is not None
                or layer.local_rope or layer.input_norm is None or layer.tp is not None):
            return None
        weights = (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
        if not all(isinstance(w, GgufWeight) for w in weights):
            return None
        vectors = (layer.input_norm, layer.qkv_bias, layer.o_bias, layer.post_attention_norm)
        if any(v is not None and (v.dtype != torch.float32 or not v.is_contiguous()) for v in vectors):
            return None
        ptr = [0 if v is None else v.data_ptr() for v in vectors]
        qkv, o, gate_up, down = (list(w._kernel_parts or w._kernel_args()) for w in weights)
        layers.append((ptr[0], qkv, ptr[1], o, ptr[2], ptr[3], gate_up, down))
    first = model.layers[0]
    return GgufDecoder(cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                       cfg.intermediate_size, float(first.eps), float(first.scale), layers)


def fused_forward(model, decoder: GgufDecoder, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> bool:
    """Run every layer over x ([T, hidden] float32, updated in place); False (x untouched) when
    this forward's attention is not the batch-invariant cpu_native kernel over float32 caches."""
    from specinfer.attention.cpu_native import CpuNativePrepared

    prepared, backend, caches = ctx.metadata, ctx.backend, ctx.kv_caches
    if (not isinstance(prepared, CpuNativePrepared) or not getattr(backend, "batch_invariant", False)
            or x.dtype != torch.float32 or not x.is_contiguous()
            or any(c.dtype != torch.float32 or not c.is_contiguous() for c in caches[:len(model.layers)])):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()  # [T, 1, D] each
    layer_caches = caches[:len(model.layers)]
    decoder.forward(x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), prepared.batch,
                    [c.data_ptr() for c in layer_caches], layer_caches[0].shape[1], layer_caches[0].shape[2],
                    torch.get_num_threads(), backend.isa)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up ([T, 2 * I] float32 on CPU, rows [gate | up]) -> [T, I]: the
    activation of a GGUF model's layers, the one the fused layers compute (the same bits)."""
    gate_up = gate_up.contiguous()
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=torch.float32)
    if T == 0:  # (an empty tensor's data pointer may be null)
        return out
    gguf_silu_mul(gate_up.data_ptr(), T, inter, out.data_ptr(), torch.get_num_threads())
    return out
