"""Write a tiny HF checkpoint (tests/tiny_models.py) as llama.cpp's converter would
(convert_hf_to_gguf.py): its tensor names per architecture, Q/K rows permuted for the llama
architecture, Gemma's norms stored as 1 + w, Phi-3's fused tensors and LongRoPE factor tensors,
MoE experts stacked [experts, rows, cols], the family's metadata keys — written with the `gguf`
package's own GGUFWriter, so the reader is tested against the format, not against itself."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3_text": "gemma3",
              "phi3": "phi3", "mixtral": "llama", "llama": "llama"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, path: Path, *, expert_type: str = "f32") -> None:
    """model_dir: a tiny_models checkpoint (model.safetensors, config.json, word tokenizer);
    expert_type "q8_0" stores the stacked expert tensors as Q8_0."""
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

    def put(name, array, kind="f32"):
        if kind == "q8_0":
            w.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
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
                q, k = _permute(q, H), _permute(k, Hkv)
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
