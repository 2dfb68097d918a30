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
            d = int(self.target.lm_head(h).argmax())
            out.append(d)
            toks.append(d)
            feats = torch.cat([feats, h[None]], 0)
        return out
