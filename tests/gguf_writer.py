"""Tiny GGUF files written as llama.cpp's converter writes them, shared by the GGUF tests.

`write_gguf`: a tiny HF checkpoint (tests/tiny_models.py) as llama.cpp's converter would
(convert_hf_to_gguf.py): its tensor names per architecture, Q/K rows permuted for the llama
architecture, Gemma's norms stored as 1 + w, Phi-3's fused tensors and LongRoPE factor tensors,
MoE experts stacked [experts, rows, cols], the family's metadata keys — written with the `gguf`
package's own GGUFWriter, so the reader is tested against the format, not against itself.
`write_synthetic_gguf`: a random Llama or Qwen2 with a byte-level BPE vocabulary, F32/F16 tensors
and one Q8_0 tensor, returning the HF model with those roundings applied."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

_GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3_text": "gemma3",
              "phi3": "phi3", "mixtral": "llama", "llama": "llama"}


def write_gguf(model_dir: Path, path: Path, *, expert_type: str = "f32", gemm_types: tuple[str, ...] = ()) -> None:
    """model_dir: a tiny_models checkpoint (model.safetensors, config.json, word tokenizer);
    expert_type "q8_0" stores the stacked expert tensors as Q8_0; gemm_types (e.g. ("q4_0",
    "q5_1")) stores the GEMM weights and the embedding in those block types, round-robin tensor
    by tensor (the `gguf` package's quantizers: the 32-value formats)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    sd = load_file(str(Path(model_dir) / "model.safetensors"))
    ours = cfg["model_type"]
    arch = _GGUF_ARCH[ours]
    gemma = ours in ("gemma2", "gemma3_text")
    L, H, Hkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if gemma and "full_attention" in rope:
        rope = rope["full_attention"]
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if cfg.get("sliding_window") and (cfg.get("use_sliding_window", True) or gemma):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("layer_types"):
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if ours == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if ours in ("qwen3_moe", "qwen2_moe"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if ours == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if ours == "phi3" and rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    tokens = [f"t{i}" for i in range(cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    turn = [0]

    def put(name, array, kind="f32"):
        gemm = (name.endswith(".weight") and array.ndim >= 2 and "norm" not in name and "gate_inp" not in name)
        if gemm and gemm_types and kind == "f32":
            kind = gemm_types[turn[0] % len(gemm_types)]
            turn[0] += 1
        if kind != "f32":
            t = gguf.GGMLQuantizationType[kind.upper()]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), t), raw_dtype=t)
        else:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    def norm(array):
        return array + 1.0 if gemma else array  # llama.cpp's Gemma converters: norm_shift

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", norm(sd["model.norm.weight"]))
    if "lm_head.weight" in sd and not cfg.get("tie_word_embeddings"):
        put("output.weight", sd["lm_head.weight"])
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", norm(sd[p + "input_layernorm.weight"]))
        if ours == "phi3":
            put(b + "attn_qkv.weight", sd[p + "self_attn.qkv_proj.weight"])
        else:
            q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
            if arch == "llama":
                q, k = llama_cpp_permute(q, H), llama_cpp_permute(k, Hkv)
            put(b + "attn_q.weight", q)
            put(b + "attn_k.weight", k)
            put(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
            for n in "qkv":
                if p + f"self_attn.{n}_proj.bias" in sd:
                    put(b + f"attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"])
        if p + "self_attn.q_norm.weight" in sd:
            put(b + "attn_q_norm.weight", norm(sd[p + "self_attn.q_norm.weight"]))
            put(b + "attn_k_norm.weight", norm(sd[p + "self_attn.k_norm.weight"]))
        put(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        if gemma:
            put(b + "post_attention_norm.weight", norm(sd[p + "post_attention_layernorm.weight"]))
            put(b + "ffn_norm.weight", norm(sd[p + "pre_feedforward_layernorm.weight"]))
            put(b + "post_ffw_norm.weight", norm(sd[p + "post_feedforward_layernorm.weight"]))
        else:
            put(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        moe = p + "block_sparse_moe." if ours == "mixtral" else p + "mlp."
        if moe + "gate.weight" in sd:
            put(b + "ffn_gate_inp.weight", sd[moe + "gate.weight"])
            names = (("w1", "w3", "w2") if ours == "mixtral" else ("gate_proj", "up_proj", "down_proj"))
            for gname, hf in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
                stack = np.stack([sd[f"{moe}experts.{e}.{hf}.weight"] for e in range(experts)])
                put(b + gname + ".weight", stack, expert_type)
            if moe + "shared_expert_gate.weight" in sd:
                put(b + "ffn_gate_inp_shexp.weight", sd[moe + "shared_expert_gate.weight"].reshape(-1))
                for gname, hf in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                                  ("ffn_down_shexp", "down_proj")):
                    put(b + gname + ".weight", sd[f"{moe}shared_expert.{hf}.weight"])
        elif ours == "phi3":
            put(b + "ffn_up.weight", sd[p + "mlp.gate_up_proj.weight"])
            put(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        else:
            for gname, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                put(b + gname + ".weight", sd[p + f"mlp.{hf}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- the Llama / Qwen2 writer with a byte-level BPE vocabulary and mixed tensor types (test_gguf.py) ----


def _byte_level_vocab():
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġa", "n"), ("Ġan", "d")]
    tokens = alphabet + [a + b for a, b in merges] + ["<|bos|>", "<|eos|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]  # normal..., control, control, user-defined
    return tokens, types, [f"{a} {b}" for a, b in merges]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _build_hf(arch: str, vocab: int):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=(arch == "qwen2"))
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.15 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def write_synthetic_gguf(path: str, arch: str) -> "transformers.PreTrainedModel":
    """Write `arch` as llama.cpp would; -> the HF model with the Q8_0 tensor's rounding applied."""
    tokens, types, merges = _byte_level_vocab()
    hf = _build_hf(arch, len(tokens))
    cfg = hf.config
    sd = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(arch == "llama")
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def put(name: str, array: np.ndarray, kind: str = "f32"):
        if kind == "f16":
            w.add_tensor(name, array.astype(np.float16))
        elif kind == "q8_0":
            w.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, array.astype(np.float32))

    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    put("token_embd.weight", sd["model.embed_tokens.weight"], "f16")
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    reference = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = llama_cpp_permute(q, H), llama_cpp_permute(k, Hkv)
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", q)
        put(f"blk.{i}.attn_k.weight", k, "f16")
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        if arch == "qwen2":
            for n in "qkv":
                put(f"blk.{i}.attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], "f16" if i else "q8_0")
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
        # what the reader must reproduce: f16 and q8_0 rounding applied to the HF weights
        reference[p + "self_attn.k_proj.weight"] = sd[p + "self_attn.k_proj.weight"].astype(np.float16)
        up = sd[p + "mlp.up_proj.weight"]
        reference[p + "mlp.up_proj.weight"] = up.astype(np.float16) if i else gguf.quants.dequantize(
            gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    reference["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].astype(np.float16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, value in reference.items():
            params[name].copy_(torch.from_numpy(value.astype(np.float32)))
    return hf
