"""Single-file GGUF models: config from `{arch}.*` metadata, tensors dequantized to torch.

The traps (see shared/MODELS.md): GGUF lists dims innermost-first (the reader's numpy arrays
are already [rows, cols]); llama.cpp's converter permutes the rows of llama-arch Q and K
(`LlamaModel.permute`: interleaved rotary pairs) which we undo; Qwen2 carries q/k/v biases and
is not permuted; a file without `output.weight` ties the LM head to the embeddings. Other
families (llama.cpp's names): Gemma 2/3 store norms as 1 + w already and name the MLP's input
norm ffn_norm (post_attention_norm / post_ffw_norm are the sandwich's output norms); Phi-3
fuses q|k|v (attn_qkv) and gate|up (ffn_up) and keeps its LongRoPE factors as tensors; MoE
files stack experts ([experts, rows, cols]: ffn_{gate,up,down}_exps), Mixtral under the "llama"
architecture with an expert_count.
"""
from __future__ import annotations

import math
import re
from typing import Iterator

import numpy as np
import torch

from specinfer.loader.gguf_tokenizer import build_gguf_tokenizer
from specinfer.loader.loaded import LoadedModel
from specinfer.models.config import ModelConfig
from specinfer.models.int8_linear import QuantizedTensor
from specinfer.models.llama import LlamaForCausalLM

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "phi3")
# GGUF general.architecture -> ours (llama.cpp's "llama" also holds Mixtral: experts in the file)
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
         "gemma2": "gemma2",
         "gemma3": "gemma3_text", "phi3": "phi3"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3
    "ffn_gate_inp.weight": "mlp.gate.weight",  # MoE router (Mixtral: renamed in hf_name)
    # Qwen2-MoE's shared expert and its gate ([hidden] in the file, [1, hidden] in HF)
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma's sandwich norms (llama.cpp names -> HF): its ffn_norm is the MLP's input norm
_GEMMA_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor for our architecture `arch` (stacked expert tensors: the
    prefix "model.layers.N.mlp.experts.{}." + projection, see expert_names)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    if arch in ("gemma2", "gemma3_text") and rest in _GEMMA_NAMES:
        return f"model.layers.{layer}.{_GEMMA_NAMES[rest]}"
    if arch == "phi3" and rest == "ffn_up.weight":  # Phi-3 stores gate|up as one tensor
        return f"model.layers.{layer}.mlp.gate_up_proj.weight"
    if arch == "mixtral" and rest == "ffn_gate_inp.weight":
        return f"model.layers.{layer}.block_sparse_moe.gate.weight"
    if rest in _EXPERTS:
        return f"model.layers.{layer}.<experts>.{_EXPERTS[rest]}"
    if rest in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


def expert_names(name: str, arch: str, num_experts: int) -> list[str]:
    """A stacked expert tensor's HF names, expert by expert (Mixtral: block_sparse_moe w1/w3/w2)."""
    prefix, proj = name.split(".<experts>.")
    if arch == "mixtral":
        return [f"{prefix}.block_sparse_moe.experts.{e}.{_MIXTRAL[proj]}.weight" for e in range(num_experts)]
    return [f"{prefix}.mlp.experts.{e}.{proj}.weight" for e in range(num_experts)]


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head)`: rows (head, pair, 2) -> (head, 2, pair). w [rows, ...]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read(path: str):
    from specinfer.loader.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except (ValueError, OSError) as e:  # bad magic, truncated header or tensor data
        raise ValueError(f"{path}: not a valid GGUF file or truncated ({type(e).__name__}: {e})") from e
    return reader, {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}


def _rope_scaling(meta: dict, arch: str, path: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"])}
    raise ValueError(f"{path}: unsupported GGUF rope scaling type {kind!r}")


def gguf_config(meta: dict, tensor_names: set[str], path: str, rope_factors: dict | None = None) -> ModelConfig:
    """rope_factors: Phi-3's LongRoPE factor tensors ("short"/"long" -> float lists), read by the caller."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    ours = _ARCH[arch]
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        ours = "mixtral"
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: GGUF per-frequency RoPE factors (rope_freqs.weight) are not supported yet")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    def positive(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} must be a positive integer (got {value!r})")
        return int(value)

    hidden = positive("embedding_length", get("embedding_length"))
    heads = positive("attention.head_count", get("attention.head_count"))
    kv_heads = positive("attention.head_count_kv", meta.get(f"{arch}.attention.head_count_kv", heads))
    if f"{arch}.attention.key_length" in meta:
        head_dim = positive("attention.key_length", meta[f"{arch}.attention.key_length"])
    elif hidden % heads:
        raise ValueError(f"{path}: GGUF metadata {arch}.attention.head_count ({heads}) does not divide "
                         f"{arch}.embedding_length ({hidden})")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{path}: GGUF metadata {arch}.attention.head_count_kv ({kv_heads}) does not divide "
                         f"{arch}.attention.head_count ({heads})")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: missing or empty GGUF tokenizer array tokenizer.ggml.tokens")
    vocab_size = positive("vocab_size", meta.get(f"{arch}.vocab_size") or len(tokens))
    if len(tokens) > vocab_size:
        raise ValueError(f"{path}: tokenizer.ggml.tokens has {len(tokens)} tokens, more than "
                         f"{arch}.vocab_size ({vocab_size})")
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count {rot} != head_dim {head_dim})")
    special = {}
    for k in ("bos", "eos", "eot", "eom"):
        key = f"tokenizer.ggml.{k}_token_id"
        if key in meta:
            i = meta[key]
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(tokens):
                raise ValueError(f"{path}: GGUF metadata {key} = {i!r} is outside the vocabulary "
                                 f"[0, {len(tokens)})")
            special[k] = int(i)
    eos = list(dict.fromkeys(special[k] for k in ("eos", "eot", "eom") if k in special))
    bos = special.get("bos")
    has_bias = "blk.0.attn_q.bias" in tensor_names
    num_layers = int(get("block_count"))
    family = _family_fields(meta, arch, ours, num_layers, hidden, heads, head_dim, path)
    rope_scaling = _rope_scaling(meta, arch, path)
    if rope_factors:  # Phi-3 LongRoPE: the factors are tensors of the file
        rope_scaling = {"rope_type": "longrope", "short_factor": tuple(rope_factors["short"]),
                        "long_factor": tuple(rope_factors["long"]),
                        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                        "max_position_embeddings": int(get("context_length"))}
        if f"{arch}.rope.scaling.attn_factor" in meta:
            rope_scaling["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
    return ModelConfig(
        architecture=ours,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_bias,
        attention_output_bias="blk.0.attn_output.bias" in tensor_names,
        bos_token_id=bos,
        eos_token_ids=tuple(eos),
        **family,
    )


def _family_fields(meta: dict, arch: str, ours: str, num_layers: int, hidden: int, heads: int, head_dim: int,
                   path: str) -> dict:
    """The ModelConfig family fields from llama.cpp's metadata and its per-architecture constants
    (src/llama-model.cpp): Gemma's sliding pattern (2: even layers slide; 3: five of six), Gemma
    3's local RoPE base 10000, the attention scale 1/sqrt(hidden / heads) of the 27B models."""
    out: dict = {}
    window = meta.get(f"{arch}.attention.sliding_window")
    if ours in ("gemma2", "gemma3_text"):
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # newer files: one bool per layer (True: sliding)
            if len(pattern) != num_layers:
                raise ValueError(f"{path}: GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries for {num_layers} layers")
            slides = [bool(x) for x in pattern]
        else:  # a period n (every n-th layer global), llama.cpp's constant where absent
            n = int(pattern) if pattern else (2 if ours == "gemma2" else 6)
            slides = [i % n < n - 1 for i in range(num_layers)]
        big = (ours == "gemma2" and num_layers == 46) or (ours == "gemma3_text" and num_layers == 62)
        out.update(hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden), sandwich_norms=True,
                   norm_weight_offset=1.0, attn_scale=(hidden / heads if big else head_dim) ** -0.5)
        if ours == "gemma2":
            for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap")):
                if meta.get(f"{arch}.{key}") is not None:
                    out[field] = float(meta[f"{arch}.{key}"])
        else:
            out.update(qk_norm=True, local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)))
        if window is not None:
            out.update(sliding_window=int(window),
                       layer_types=tuple("sliding_attention" if s else "full_attention" for s in slides))
    elif window is not None:  # every layer slides, unless the file lists which do
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        out["sliding_window"] = int(window)
        if isinstance(pattern, list) and len(pattern) == num_layers and not all(pattern):
            out["layer_types"] = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    if ours in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    if ours in ("qwen3_moe", "qwen2_moe", "mixtral"):
        experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
        if experts <= 0:
            raise ValueError(f"{path}: GGUF metadata {arch}.expert_count is missing")
        out.update(num_experts=experts, num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
                   moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                             or meta[f"{arch}.feed_forward_length"]),
                   norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", ours != "qwen2_moe")))
        if ours == "qwen2_moe":
            out["shared_expert_intermediate_size"] = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    return out


_Q8_0_BLOCK, _Q8_0_BYTES = 32, 34  # values per block; bytes per block (float16 scale + 32 int8)


def q8_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF Q8_0 tensor's raw bytes [rows, blocks * 34] -> int8 [rows, cols] + float32 scales
    [rows, blocks], exactly (no dequantization)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // _Q8_0_BLOCK, _Q8_0_BYTES)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]  # [rows, blocks]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return QuantizedTensor(torch.from_numpy(q), torch.from_numpy(scales), _Q8_0_BLOCK)


def _stored(t, expected: tuple[int, ...], path: str, unpermute: int | None = None):
    """A 2-D tensor as stored (a view of the file's memory map; llama-arch Q/K rows reordered
    back into a copy: `unpermute` = its head count)."""
    from specinfer.models.gguf_linear import StoredTensor

    try:
        st = StoredTensor.from_bytes(t.data, t.tensor_type, expected)
    except ValueError as e:
        raise ValueError(f"{path}: tensor {t.name!r} cannot be kept as stored ({e})") from e
    if unpermute is not None:
        order = unpermute_rows(torch.arange(expected[0]).unsqueeze(1), unpermute).reshape(-1).numpy()
        st = st.take_rows(order)
    return st


def _gguf_weights(reader, cfg: ModelConfig, dtype: torch.dtype, path: str,
                  quantization: str | None = None,
                  destinations: dict[str, torch.Tensor] | None = None,
                  stored: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in `dtype`; with quantization="int8", Q8_0 GEMM weights as QuantizedTensor
    (kept int8) and every other tensor in float32 (the model quantizes GEMM weights one by one).
    A tensor named in `stored` (model.stored_destinations, quantization="gguf") is handed over as
    stored (StoredTensor: its bytes in the file's memory map). A tensor whose float32 parameter
    memory is in `destinations` (model.float32_destinations) and needs no row permutation is
    dequantized straight into it and yielded as LOADED_IN_PLACE."""
    from gguf import GGMLQuantizationType

    from specinfer.loader.gguf_dequant import dequantize, dequantize_into
    from specinfer.models.llama import LOADED_IN_PLACE

    destinations = destinations or {}
    stored = stored or set()

    permuted = cfg.architecture in ("llama", "mixtral")
    for t in reader.tensors:
        if t.name in _ROPE_FACTOR_TENSORS:  # Phi-3's LongRoPE factors: read into the config
            continue
        name = hf_name(t.name, cfg.architecture)
        if name is None:
            raise ValueError(f"{path}: unexpected GGUF tensor {t.name!r}")
        expected = tuple(int(d) for d in reversed(t.shape))
        if ".<experts>." in name and stored:  # [experts, rows, cols]: each expert's rows as stored
            E, rows, cols = expected
            names = expert_names(name, cfg.architecture, E)
            if all(n in stored for n in names):
                per_expert = np.asarray(t.data).reshape(E, -1)
                for e, e_name in enumerate(names):
                    yield e_name, _stored(_Slice(t, per_expert[e]), (rows, cols), path)
                continue
        if name in stored and len(expected) == 2:
            heads = None
            if permuted and ".attn_q." in t.name:
                heads = cfg.num_heads
            elif permuted and ".attn_k." in t.name:
                heads = cfg.num_kv_heads
            yield name, _stored(t, expected, path, heads)
            continue
        if ".<experts>." in name and quantization in ("int8", "w8a8") and t.tensor_type == GGMLQuantizationType.Q8_0:
            E, rows, cols = expected  # Q8_0 experts stay int8: each expert's blocks, no dequantization
            raw = np.ascontiguousarray(t.data).reshape(E, -1)
            try:
                blocks = [q8_0_blocks(raw[e], (rows, cols)) for e in range(E)]
            except ValueError as e:
                raise ValueError(f"{path}: tensor {t.name!r} Q8_0 data is truncated ({e})") from e
            yield from zip(expert_names(name, cfg.architecture, E), blocks)
            continue
        if ".<experts>." in name:  # [experts, rows, cols]: one HF tensor per expert
            try:
                array = dequantize(t.data, t.tensor_type, expected)
            except Exception as e:
                raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} (truncated or damaged data: "
                                 f"{type(e).__name__}: {e})") from e
            for e_name, w in zip(expert_names(name, cfg.architecture, expected[0]), torch.from_numpy(array)):
                yield e_name, (w if quantization else w.to(dtype))
            continue
        if (quantization in ("int8", "w8a8") and t.tensor_type == GGMLQuantizationType.Q8_0 and len(expected) == 2
                and name.endswith(".weight") and "norm" not in name):
            try:
                qt = q8_0_blocks(t.data, expected)
            except ValueError as e:
                raise ValueError(f"{path}: tensor {t.name!r} Q8_0 data is truncated ({e})") from e
            if permuted and ".attn_q." in t.name:
                qt = QuantizedTensor(unpermute_rows(qt.q, cfg.num_heads), unpermute_rows(qt.scales, cfg.num_heads))
            elif permuted and ".attn_k." in t.name:
                qt = QuantizedTensor(unpermute_rows(qt.q, cfg.num_kv_heads), unpermute_rows(qt.scales, cfg.num_kv_heads))
            yield name, qt
            continue
        if name.endswith("shared_expert_gate.weight") and len(expected) == 1:
            expected = (1, expected[0])  # HF's Linear(hidden, 1)
        permute = permuted and (".attn_q." in t.name or ".attn_k." in t.name)
        dest = destinations.get(name)
        if dest is not None and not permute and tuple(dest.shape) == expected:
            try:
                done = dequantize_into(t.data, t.tensor_type, dest)
            except Exception as e:
                raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} (truncated or damaged data: "
                                 f"{type(e).__name__}: {e})") from e
            if done:
                yield name, LOADED_IN_PLACE
                continue
        try:
            array = dequantize(t.data, t.tensor_type, expected)  # a new float32 array [rows, cols]
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} (truncated or damaged data: "
                             f"{type(e).__name__}: {e})") from e
        w = torch.from_numpy(array)
        if permuted and ".attn_q." in t.name:
            w = unpermute_rows(w, cfg.num_heads)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_rows(w, cfg.num_kv_heads)
        yield name, (w if quantization else w.to(dtype))


class _Slice:
    """One expert's part of a stacked tensor, with the fields _stored reads."""

    def __init__(self, t, data):
        self.name, self.tensor_type, self.data = t.name, t.tensor_type, data


_ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short", "rope_factors_long.weight": "long"}


def load_gguf(path: str, *, dtype: torch.dtype, device, quantization: str | None = None) -> LoadedModel:
    reader, meta = _read(path)
    tensor_names = {t.name for t in reader.tensors}
    from specinfer.loader.gguf_dequant import dequantize

    factors = {_ROPE_FACTOR_TENSORS[t.name]: dequantize(t.data, t.tensor_type, (int(np.prod(t.shape)),)).tolist()
               for t in reader.tensors if t.name in _ROPE_FACTOR_TENSORS}
    cfg = gguf_config(meta, tensor_names, path, factors or None)
    tokenizer, add_bos = build_gguf_tokenizer(meta, path)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, quantization=quantization)
    model.load_weights(_gguf_weights(reader, cfg, dtype, path, model.quantization, model.float32_destinations(),
                                     model.stored_destinations()),
                       source=path, norms_include_offset=True)  # llama.cpp stores Gemma's norms as 1 + w
    model.eval()
    return LoadedModel(
        model=model, config=cfg, tokenizer=tokenizer, bos_token_id=cfg.bos_token_id,
        eos_token_ids=cfg.eos_token_ids, add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"), source=path,
    )
