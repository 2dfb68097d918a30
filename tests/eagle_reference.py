"""EAGLE-1 drafting written with HF transformers (the independent reference): the target's
post-norm features over the whole history, then the draft layer (HF LlamaDecoderLayer without
input layernorm) over all (x_{i+1}, f_i) pairs recomputed from scratch for every draft."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import load_file


class EagleReference:
    def __init__(self, target_dir: Path, eagle_dir: Path):
        self.target = tf.LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
        cfg_dict = json.loads((Path(eagle_dir) / "config.json").read_text())
        cfg = tf.LlamaConfig(**{k: v for k, v in cfg_dict.items() if k != "bias"})
        cfg._attn_implementation = "sdpa"
        files = list(Path(eagle_dir).glob("*.safetensors"))
        w = load_file(str(files[0])) if files else torch.load(Path(eagle_dir) / "pytorch_model.bin")
        self.layer = tf.models.llama.modeling_llama.LlamaDecoderLayer(cfg, 0).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")},
                                   strict=False)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in w)
        self.fc.load_state_dict({"weight": w["fc.weight"], **({"bias": w["fc.bias"]} if "fc.bias" in w else {})})
        self.embed = w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)
        d2t = w.get("d2t")  # a draft vocabulary: only these target ids are scored
        self.vocab = None if d2t is None else torch.arange(len(d2t)) + d2t

    @torch.no_grad()
    def _draft_layer(self, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed[torch.tensor(tokens)], feats], -1))[None]  # [1, T, H]
        pos = torch.arange(len(tokens))[None]
        return self.layer(x, attention_mask=None, position_ids=pos,
                          position_embeddings=self.rotary(x, pos))[0]  # [T, H]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        f = self.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # [N-1, H] f_0..f_{N-2}
        toks, feats, out = list(tokens[1:]), f, []
        for _ in range(k):
            h = self._draft_layer(toks, feats)[-1]
            logits = self.target.lm_head(h)
            d = int(logits.argmax()) if self.vocab is None else int(self.vocab[logits[self.vocab].argmax()])
            out.append(d)
            toks.append(d)
            feats = torch.cat([feats, h[None]], 0)
        return out


class Eagle3Reference:
    """EAGLE-3 with HF modules: LlamaAttention built 2H wide (its o_proj swapped for [H, heads*d]),
    LlamaMLP, LlamaRMSNorm; target aux states from output_hidden_states (input of layer j)."""

    def __init__(self, target_dir: Path, eagle_dir: Path):
        llama = tf.models.llama.modeling_llama
        self.target = tf.LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
        c = json.loads((Path(eagle_dir) / "config.json").read_text())
        H, nh = c["hidden_size"], c["num_attention_heads"]
        L = self.target.config.num_hidden_layers
        ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
        self.aux_ids = sorted(ids)
        w = load_file(str(Path(eagle_dir) / "model.safetensors"))
        w = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in w.items()}
        base = {k: c[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                  "rope_theta", "max_position_embeddings")}
        wide = tf.LlamaConfig(**base, hidden_size=2 * H, head_dim=H // nh)
        wide._attn_implementation = "sdpa"
        narrow = tf.LlamaConfig(**base, hidden_size=H)
        self.attn = llama.LlamaAttention(wide, 0).eval()
        self.attn.o_proj = torch.nn.Linear(H, H, bias=False)
        self.attn.load_state_dict({k[len("midlayer.self_attn."):]: v for k, v in w.items()
                                   if k.startswith("midlayer.self_attn.")})
        self.mlp = llama.LlamaMLP(narrow).eval()
        self.mlp.load_state_dict({k[len("midlayer.mlp."):]: v for k, v in w.items() if k.startswith("midlayer.mlp.")})
        self.norms = {}
        for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
            n = llama.LlamaRMSNorm(H, eps=c["rms_norm_eps"])
            n.weight.data.copy_(w[name + ".weight"])
            self.norms[name] = n
        self.rotary = llama.LlamaRotaryEmbedding(wide)
        self.fc, self.lm_head, self.d2t = w["fc.weight"], w["lm_head.weight"], w["d2t"]
        self.embed = self.target.model.embed_tokens.weight

    @torch.no_grad()
    def _layer(self, tokens, g):
        n = self.norms
        x = torch.cat([n["midlayer.input_layernorm"](self.embed[torch.tensor(tokens)]),
                       n["midlayer.hidden_norm"](g)], -1)[None]
        pos = torch.arange(len(tokens))[None]
        a, _ = self.attn(hidden_states=x, position_embeddings=self.rotary(x, pos), attention_mask=None)
        h = g + a[0]
        return h + self.mlp(n["midlayer.post_attention_layernorm"](h))

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        hs = self.target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        g = torch.cat([hs[j][0] for j in self.aux_ids], -1) @ self.fc.T  # [N-1, H]
        toks, out = list(tokens[1:]), []
        for _ in range(k):
            h = self._layer(toks, g)[-1]
            i = int((self.norms["norm"](h) @ self.lm_head.T).argmax())
            out.append(i + int(self.d2t[i]))
            toks.append(out[-1])
            g = torch.cat([g, h[None]], 0)
        return out


class PathLogits:
    """next_logits(path) over the target vocabulary for one context, EAGLE drafting recomputed
    from the whole history for every path (no tree attention, no paged KV)."""

    def __init__(self, ref, tokens):
        self.ref, self.tokens = ref, tokens
        with torch.no_grad():
            if isinstance(ref, Eagle3Reference):
                hs = ref.target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
                self.feats = torch.cat([hs[j][0] for j in ref.aux_ids], -1) @ ref.fc.T
            else:
                self.feats = ref.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]

    @torch.no_grad()
    def __call__(self, path):
        ref, toks, feats = self.ref, list(self.tokens[1:]), self.feats
        layer = ref._layer if isinstance(ref, Eagle3Reference) else ref._draft_layer
        h = layer(toks, feats)[-1]
        for t in path:
            toks.append(t)
            feats = torch.cat([feats, h[None]], 0)
            h = layer(toks, feats)[-1]
        if isinstance(ref, Eagle3Reference):
            d = ref.norms["norm"](h) @ ref.lm_head.T
            out = torch.full((ref.target.config.vocab_size,), float("-inf"))
            out[torch.arange(len(d)) + ref.d2t] = d
            return out
        logits = ref.target.lm_head(h)
        if ref.vocab is not None:  # a draft vocabulary: -inf elsewhere
            out = torch.full_like(logits, float("-inf"))
            out[ref.vocab] = logits[ref.vocab]
            return out
        return logits
