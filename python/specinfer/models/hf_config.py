"""Reading an HF `config.json` into a ModelConfig, family by family.

Each family's checkpoint spells its structure differently; this module is the one place that
knows the spellings (transformers 4.x and 5.x): where the RoPE base and scaling live (Gemma 3
keeps one set per layer type), which layers slide (`layer_types`, or the family's older rule),
how norms are stored (HF Gemma: w, applied as 1 + w), and the mixture-of-experts fields.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from specinfer.models.config import LAYER_TYPES, SUPPORTED_ARCHITECTURES

_REQUIRED = object()
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA = ("gemma2", "gemma3_text")


def _hf_int(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """config.json's `key` as a positive int (or `default` when absent); errors name the key."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"missing field {key!r}")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"field {key!r} must be a positive integer (got {value!r})")
    return value


def _hf_float(hf: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = hf.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"field {key!r} must be a positive number (got {value!r})")
    return float(value)


def _hf_optional_float(hf: Mapping[str, Any], key: str) -> float | None:
    return None if hf.get(key) is None else _hf_float(hf, key)


def _hf_ids(hf: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = hf.get(key)
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ValueError(f"field {key!r} must be a token id or a list of token ids (got {value!r})")
    return tuple(values)


def _rope(hf: Mapping[str, Any], params: Mapping[str, Any] | None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from one set of RoPE parameters (5.x) merged over the
    4.x top-level rope_theta / rope_scaling."""
    legacy = hf.get("rope_scaling") or {}
    rope = {**legacy, **dict(params or {})}
    theta = _hf_float({"rope_theta": rope.pop("rope_theta", hf.get("rope_theta", 10000.0))}, "rope_theta")
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"unsupported config: partial_rotary_factor {partial!r} (only 1.0)")
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type == "default":
        return theta, None
    scaling = {"rope_type": rope_type, **rope}
    if rope_type in ("yarn", "longrope"):
        scaling.setdefault("original_max_position_embeddings",
                           hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
    if rope_type == "longrope":
        scaling.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
        for key in ("short_factor", "long_factor"):
            if isinstance(scaling.get(key), list):
                scaling[key] = tuple(scaling[key])
    return theta, scaling


def _layer_types(hf: Mapping[str, Any], arch: str, num_layers: int):
    """(sliding_window, layer_types) — which layers slide, by the config or the family's rule.
    A Qwen config without use_sliding_window ignores its sliding_window (0 in some)."""
    if arch in _QWEN and not hf.get("use_sliding_window", False):
        return None, None
    window = _hf_int(hf, "sliding_window", None)
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, (list, tuple)) or len(given) != num_layers or any(t not in LAYER_TYPES for t in given):
            raise ValueError(f"field 'layer_types' must list {num_layers} of {list(LAYER_TYPES)} (got {given!r})")
        types = tuple(given)
    elif arch in _QWEN:
        first = hf.get("max_window_layers", 0) or 0
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    elif arch == "gemma2":
        types = tuple("full_attention" if i % 2 else "sliding_attention" for i in range(num_layers))
    elif arch == "gemma3_text":
        pattern = hf.get("sliding_window_pattern", 6)
        types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
    else:  # llama, mistral, mixtral, phi3: a window, when given, applies to every layer
        return window, None
    if window is None or all(t == "full_attention" for t in types):
        return None, None
    return window, types


def _experts(hf: Mapping[str, Any], arch: str, num_layers: int) -> dict:
    if arch not in ("mixtral", "qwen3_moe", "qwen2_moe"):
        return {}
    num = _hf_int(hf, "num_local_experts", None) or _hf_int(hf, "num_experts")
    out = dict(num_experts=num, num_experts_per_tok=_hf_int(hf, "num_experts_per_tok"))
    if arch == "mixtral":
        out.update(moe_intermediate_size=_hf_int(hf, "intermediate_size"), norm_topk_prob=True)
        return out
    step = _hf_int(hf, "decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ())
    out.update(moe_intermediate_size=_hf_int(hf, "moe_intermediate_size"),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))
    if arch == "qwen2_moe":
        out["shared_expert_intermediate_size"] = _hf_int(hf, "shared_expert_intermediate_size", 0) or 0
    return out


def config_from_hf(cls, hf: Mapping[str, Any]):
    arch = hf.get("model_type")
    if arch == "gemma3" and isinstance(hf.get("text_config"), Mapping):
        raise ValueError("unsupported architecture: model_type 'gemma3' is the multimodal Gemma 3 "
                         "(a vision tower around the text model); load a text-only gemma3_text checkpoint")
    if arch not in SUPPORTED_ARCHITECTURES:
        names = hf.get("architectures") or []
        raise ValueError(f"unsupported architecture: model_type {arch!r} (architectures {names}); "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported config: mlp_bias=True")
    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    act = _ACTS.get(act_name)
    if act is None or (arch in _GEMMA) != (act == "gelu_tanh"):
        raise ValueError(f"unsupported config: hidden activation {act_name!r} for {arch}")
    num_heads = _hf_int(hf, "num_attention_heads")
    hidden = _hf_int(hf, "hidden_size")
    head_dim = _hf_int(hf, "head_dim", None)
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) does not divide hidden_size ({hidden}) "
                             "and there is no head_dim")
        head_dim = hidden // num_heads
    num_kv_heads = _hf_int(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) does not divide num_attention_heads "
                         f"({num_heads})")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf.get(key), Mapping):
            raise ValueError(f"field {key!r} must be an object (got {hf.get(key)!r})")
    params = hf.get("rope_parameters")
    local_theta = None
    if isinstance(params, Mapping) and set(params) & set(LAYER_TYPES):  # Gemma 3 (5.x): one set per layer type
        rope_theta, rope_scaling = _rope(hf, params.get("full_attention"))
        local_theta, local_scaling = _rope({}, params.get("sliding_attention"))
        if local_scaling is not None:
            raise ValueError("unsupported config: scaled RoPE on sliding layers")
    else:
        rope_theta, rope_scaling = _rope(hf, params)
        if arch == "gemma3_text":
            local_theta = _hf_float(hf, "rope_local_base_freq", 10000.0)
    num_layers = _hf_int(hf, "num_hidden_layers")
    window, layer_types = _layer_types(hf, arch, num_layers)
    if arch in ("qwen2", "qwen2_moe"):
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
    gemma = arch in _GEMMA
    bos = (_hf_ids(hf, "bos_token_id") or (None,))[0]
    pre_attn = _hf_optional_float(hf, "query_pre_attn_scalar") if gemma else None
    return cls(
        architecture=arch,
        vocab_size=_hf_int(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_hf_int(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=_hf_int(hf, "max_position_embeddings", 4096),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        attention_bias=qkv_bias,
        attention_output_bias=o_bias,
        sliding_window=window,
        bos_token_id=bos,
        eos_token_ids=_hf_ids(hf, "eos_token_id"),
        layer_types=layer_types,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
        hidden_act=act,
        embed_scale=math.sqrt(hidden) if gemma else None,
        sandwich_norms=gemma,
        norm_weight_offset=1.0 if gemma else 0.0,
        attn_softcap=_hf_optional_float(hf, "attn_logit_softcapping") if gemma else None,
        final_softcap=_hf_optional_float(hf, "final_logit_softcapping") if gemma else None,
        attn_scale=None if pre_attn is None else pre_attn ** -0.5,
        local_rope_theta=local_theta,
        **_experts(hf, arch, num_layers),
    )
