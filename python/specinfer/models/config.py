"""The architecture description of a decoder-only causal LM: Llama, Mistral, Qwen2/3, Gemma 2/3,
Phi-3 and the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE.

One frozen, validated dataclass; `from_hf_config` reads an HF `config.json` dict in either the
transformers 4.x spelling (`rope_theta` + `rope_scaling`) or the 5.x one (`rope_parameters`),
family by family (models/hf_config.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# HF `model_type` -> the architecture name we keep; all share one implementation (models/llama.py)
# whose per-family parts the fields below switch on (models/hf_config.py reads each family).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                           "qwen3_moe", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")

_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Mapping[str, Any] | None = None  # None == plain RoPE; else has "rope_type"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama attention_bias)
    attention_output_bias: bool = False  # bias on o_proj (Llama attention_bias only)
    sliding_window: int | None = None  # the window of the sliding layers (layer_types; None: every layer)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # ---- family features (defaults: Llama) ----
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" | "sliding_attention"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # MLP gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 2/3)
    norm_weight_offset: float = 0.0  # checkpoint norms hold w, applied as (offset + w) (HF Gemma: 1)
    attn_softcap: float | None = None  # attention-logit soft-cap (Gemma 2)
    final_softcap: float | None = None  # final-logit soft-cap (Gemma 2)
    attn_scale: float | None = None  # attention scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    num_experts: int = 0  # mixture of experts: routed experts per MoE layer (0: dense MLP)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities (Mixtral: always)
    moe_layers: tuple[bool, ...] | None = None  # which layers are MoE (None: all when num_experts)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a sigmoid-gated shared expert (0: none)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"ModelConfig.layer_types must list {self.num_layers} of {LAYER_TYPES}, "
                                 f"got {self.layer_types!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("attn_softcap", "final_softcap", "attn_scale", "embed_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig: MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                 f"num_experts ({self.num_experts}) and moe_intermediate_size > 0 "
                                 f"({self.moe_intermediate_size})")
            if self.moe_layers is not None and len(self.moe_layers) != self.num_layers:
                raise ValueError(f"ModelConfig.moe_layers must have {self.num_layers} entries")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"ModelConfig.rope_scaling: unsupported rope_type {rope_type!r}; "
                    f"supported: {list(SUPPORTED_ROPE_TYPES)}"
                )
            missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if self.rope_scaling.get(k) is None]
            if missing:
                raise ValueError(f"ModelConfig.rope_scaling ({rope_type}) lacks {missing}")
            factor = self.rope_scaling.get("factor")
            if factor is not None and not factor > 0:
                raise ValueError(f"ModelConfig.rope_scaling.factor must be > 0, got {factor!r}")

    def __hash__(self) -> int:  # rope_scaling is a dict; hash its items so configs can key caches
        scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (self.rope_scaling or {}).items()))
        return hash(tuple(scaling if f == "rope_scaling" else getattr(self, f) for f in self.__dataclass_fields__))

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Read an HF `config.json` dict (transformers 4.x or 5.x spelling); models/hf_config.py."""
        from specinfer.models.hf_config import config_from_hf

        return config_from_hf(cls, hf)

    # ---- per-layer structure ------------------------------------------------------------------

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Gemma 3: sliding layers rotate with their own base (local_rope_theta, no scaling)."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    def is_moe_layer(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        return True if self.moe_layers is None else self.moe_layers[layer]

    @property
    def min_window(self) -> int | None:
        windows = [w for w in (self.layer_window(i) for i in range(self.num_layers)) if w is not None]
        return min(windows) if windows else None

    @property
    def all_layers_slide(self) -> bool:
        return all(self.layer_window(i) is not None for i in range(self.num_layers))
