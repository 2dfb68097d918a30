"""Draft-head checkpoints fabricated in the public layouts (HEADS.md §6), written here with
safetensors / torch.save directly, independently of specinfer's own writers. The heads are built
from the target's lm_head so that their drafts are sometimes right (a random head never is):
each drafts "the newest token again", which a tiny random target's greedy output often does."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def target_lm_head(target: Path) -> torch.Tensor:  # [V, H]
    weights = load_file(str(Path(target) / "model.safetensors"))  # tied targets: the embedding table
    return weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()


def _write(path: Path, config: dict, tensors: dict, file: str, pt: bool = False) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.clone().contiguous() for k, v in tensors.items()}
    if pt:
        torch.save(tensors, path / file)
    else:
        save_file(tensors, str(path / file))
    return path


def mlp_speculator(path, target, *, n_predict=4, inner_dim=0, tie=False, scale_input=False, prefix=True,
                   seed=0) -> Path:
    """IBM layout. emb_i random; head_i rows = GELU(LN(c * emb_i rows)) so stage i repeats its input token."""
    lm = target_lm_head(target)
    V, E = lm.shape
    D = inner_dim or E
    a = 0.5 ** (0.5 / n_predict)
    c = math.sqrt((1 - a * a) * D / 2) / a
    t = {}
    for i in range(n_predict):
        j = 0 if tie else i
        gi = torch.Generator().manual_seed(seed * 100 + j)
        emb = torch.randn(V, D, generator=gi) / math.sqrt(D)
        u = c * emb
        feat = F.gelu(u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6))
        t[f"emb.{i}.weight"] = emb
        t[f"head.{i}.weight"] = feat / feat.norm(dim=-1, keepdim=True)
        t[f"ln.{i}.weight"] = torch.ones(D) + (0 if tie else 0.01 * i)
        t[f"ln.{i}.bias"] = torch.zeros(D)
        pj = 1 if tie and i >= 2 else i
        gp = torch.Generator().manual_seed(seed * 100 + 50 + pj)
        t[f"proj.{i}.weight"] = torch.randn(D, E if i == 0 else D, generator=gp) * 1e-3
    if prefix:
        t = {f"speculator.{k}": v for k, v in t.items()}
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": V,
           "emb_dim": E, "inner_dim": inner_dim, "n_predict": n_predict,
           "top_k_tokens_per_head": [4, 3, 2, 2, 2, 2][:n_predict], "n_candidates": 5, "tie_weights": tie,
           "scale_input": scale_input}
    return _write(path, cfg, t, "model.safetensors")


def _resblocks(K, L, H, seed, scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    w = [[torch.randn(H, H, generator=g) * scale for _ in range(L)] for _ in range(K)]
    b = [[torch.randn(H, generator=g) * scale for _ in range(L)] for _ in range(K)]
    return w, b


def medusa_original(path, target, *, num_heads=4, num_layers=1, legacy=False, pt=False, seed=1,
                    scale=1e-3) -> Path:
    """FasterDecoding/Medusa layout; ResBlocks near identity (exactly with scale 0: Medusa's own
    initialisation), lm_head = the target's (repeat drafts)."""
    lm = target_lm_head(target)
    V, H = lm.shape
    w, b = _resblocks(num_heads, num_layers, H, seed, scale)
    t = {}
    for k in range(num_heads):
        for j in range(num_layers):
            t[f"{k}.{j}.linear.weight"], t[f"{k}.{j}.linear.bias"] = w[k][j], b[k][j]
        if not legacy:
            t[f"{k}.{num_layers}.weight"] = lm
    cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": str(target)}
    return _write(path, cfg, t, "medusa_lm_head.pt" if pt else "medusa_lm_head.safetensors", pt=pt)


def medusa_vllm(path, target, *, num_heads=4, num_layers=1, fc_bias=True, truncated=None, shared=False,
                prefix=False, seed=2) -> Path:
    """vLLM MedusaModel layout; `truncated` = V_t keeps V_t ids (a fixed random subset, sorted) with
    token_map; `shared` = original_lm_head (one head for all)."""
    lm = target_lm_head(target)
    V, H = lm.shape
    w, b = _resblocks(num_heads, num_layers, H, seed)
    t = {}
    for k in range(num_heads):
        for j in range(num_layers):
            t[f"blocks.{k}.layers.{j}.weight"] = w[k][j]
            if fc_bias:
                t[f"blocks.{k}.layers.{j}.bias"] = b[k][j]
    Vt = V
    rows = lm
    if truncated:
        Vt = truncated
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vt].sort().values
        t["token_map"] = ids.to(torch.int64)
        rows = lm[ids]
    for k in range(1 if shared else num_heads):
        t[f"lm_heads.{k}.weight"] = rows
    if prefix:
        t = {f"medusa_heads.{k}": v for k, v in t.items()}
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
           "num_heads": num_heads, "num_hidden_layers": num_layers, "medusa_fc_bias": fc_bias,
           "truncated_vocab_size": Vt, "original_lm_head": shared, "max_paths": 64, "topk": 10}
    return _write(path, cfg, t, "model.safetensors")


def eagle1(path, target, *, bias=True, bias_key=True, embed=False, pt=False, repeat=False, seed=3,
           draft_vocab=None) -> Path:
    """EAGLE-1 reference layout (SafeAILab/EAGLE cnets1.py): a 1-layer Llama config.json and
    fc / layers.0.* tensors without input_layernorm, norm or lm_head. `repeat`: fc passes the
    target feature through and the layer is nearly zero, so the draft repeats the newest token
    (accepted sometimes); otherwise every weight is random (drafts depend on the whole history)."""
    tcfg = json.loads((Path(target) / "config.json").read_text())
    H, I = tcfg["hidden_size"], tcfg["intermediate_size"]
    nh, nkv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    d = H // nh
    g = torch.Generator().manual_seed(seed)
    small = 1e-2 if repeat else 1.0

    def mat(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=g) * scale / math.sqrt(cols)

    t = {"fc.weight": torch.cat([mat(H, H, 1e-2), torch.eye(H)], 1) if repeat else mat(H, 2 * H),
         "layers.0.self_attn.q_proj.weight": mat(nh * d, H), "layers.0.self_attn.k_proj.weight": mat(nkv * d, H),
         "layers.0.self_attn.v_proj.weight": mat(nkv * d, H), "layers.0.self_attn.o_proj.weight": mat(H, nh * d, small),
         "layers.0.mlp.gate_proj.weight": mat(I, H), "layers.0.mlp.up_proj.weight": mat(I, H),
         "layers.0.mlp.down_proj.weight": mat(H, I, small),
         "layers.0.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    if bias:
        t["fc.bias"] = torch.randn(H, generator=g) * (1e-3 if repeat else 0.1)
    if embed:
        t["embed_tokens.weight"] = load_file(str(Path(target) / "model.safetensors"))["model.embed_tokens.weight"]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1,
           "vocab_size": tcfg["vocab_size"], "max_position_embeddings": tcfg["max_position_embeddings"],
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32"}
    if bias_key:
        cfg["bias"] = bias
    if draft_vocab is not None:  # specinfer's extension: a draft vocabulary of `draft_vocab` ids (d2t offsets)
        ids = torch.sort(torch.randperm(tcfg["vocab_size"], generator=g)[:draft_vocab]).values
        t["d2t"] = ids - torch.arange(draft_vocab)
        cfg["draft_vocab_size"] = draft_vocab
    return _write(path, cfg, t, "pytorch_model.bin" if pt else "model.safetensors", pt=pt)


def eagle3(path, target, *, draft_vocab=None, aux_ids=None, t2d=True, layers_prefix=False, seed=4) -> Path:
    """EAGLE-3 layout (cnets.py / SpecForge): fc [H, 3H], midlayer.* with 2H-wide q/k/v inputs,
    hidden_norm, own norm and lm_head over `draft_vocab` ids (a sorted subset: d2t offsets, t2d mask)."""
    tcfg = json.loads((Path(target) / "config.json").read_text())
    H, I, V = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    nh, nkv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    d = H // nh
    Vd = draft_vocab or V
    g = torch.Generator().manual_seed(seed)

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=g)

    m = "layers.0." if layers_prefix else "midlayer."
    t = {"fc.weight": mat(H, 3 * H), m + "self_attn.q_proj.weight": mat(nh * d, 2 * H),
         m + "self_attn.k_proj.weight": mat(nkv * d, 2 * H), m + "self_attn.v_proj.weight": mat(nkv * d, 2 * H),
         m + "self_attn.o_proj.weight": mat(H, nh * d), m + "mlp.gate_proj.weight": mat(I, H),
         m + "mlp.up_proj.weight": mat(I, H), m + "mlp.down_proj.weight": mat(H, I),
         m + "input_layernorm.weight": norm(), m + "hidden_norm.weight": norm(),
         m + "post_attention_layernorm.weight": norm(), "norm.weight": norm(), "lm_head.weight": mat(Vd, H) * 4}
    used = torch.randperm(V, generator=g)[:Vd].sort().values
    t["d2t"] = (used - torch.arange(Vd)).to(torch.int64)
    if t2d:
        mask = torch.zeros(V, dtype=torch.bool)
        mask[used] = True
        t["t2d"] = mask
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": nh, "num_key_value_heads": nkv, "num_hidden_layers": 1,
           "vocab_size": V, "draft_vocab_size": Vd, "max_position_embeddings": tcfg["max_position_embeddings"],
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "target_hidden_size": H}
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True}
    return _write(path, cfg, t, "model.safetensors")
