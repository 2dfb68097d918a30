"""The architecture description of a Llama-family causal LM (Llama, Mistral, Qwen2).

One frozen, validated dataclass; `from_hf_config` reads an HF `config.json` dict in either the
transformers 4.x spelling (`rope_theta` + `rope_scaling`) or the 5.x one (`rope_parameters`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# HF `model_type` -> the architecture name we keep; all share one implementation.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


_REQUIRED = object()


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


def _hf_ids(hf: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = hf.get(key)
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ValueError(f"field {key!r} must be a token id or a list of token ids (got {value!r})")
    return tuple(values)


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
    sliding_window: int | None = None  # stored only: attention here is always full (see caveat)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

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
        scaling = tuple(sorted((self.rope_scaling or {}).items()))
        return hash(tuple(scaling if f == "rope_scaling" else getattr(self, f) for f in self.__dataclass_fields__))

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Read an HF `config.json` dict (transformers 4.x or 5.x spelling)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            names = hf.get("architectures") or []
            raise ValueError(
                f"unsupported architecture: model_type {arch!r} (architectures {names}); "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=True")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported config: hidden_act {hf.get('hidden_act')!r} (only 'silu')")
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
        # 5.x: rope_parameters = {"rope_type", "rope_theta", ...}; 4.x: rope_theta + rope_scaling.
        for key in ("rope_parameters", "rope_scaling"):
            if hf.get(key) is not None and not isinstance(hf.get(key), Mapping):
                raise ValueError(f"field {key!r} must be an object (got {hf.get(key)!r})")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        rope_theta = _hf_float({"rope_theta": rope.pop("rope_theta", hf.get("rope_theta", 10000.0))}, "rope_theta")
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        rope_scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
        if rope_scaling is not None and rope_type == "yarn":
            rope_scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if arch == "qwen2":
            qkv_bias, o_bias = True, False
            use_sw = hf.get("use_sliding_window", False)
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
            use_sw = True
        sliding_window = _hf_int(hf, "sliding_window", None) if use_sw else None
        bos = (_hf_ids(hf, "bos_token_id") or (None,))[0]
        return cls(
            architecture=arch,
            vocab_size=_hf_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(hf, "intermediate_size"),
            num_layers=_hf_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=_hf_int(hf, "max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_output_bias=o_bias,
            sliding_window=sliding_window,
            bos_token_id=bos,
            eos_token_ids=_hf_ids(hf, "eos_token_id"),
        )
