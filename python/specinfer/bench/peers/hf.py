"""HF transformers as a benchmark peer: `generate` with assisted generation (draft model,
prompt lookup) on the same weights (a pack's GGUF dequantized by transformers, or an HF directory)."""
from __future__ import annotations

import os

import torch

from specinfer.bench.config import BenchConfig, MethodConfig
from specinfer.bench.peers import PeerUnavailable

_HF_MODELS: dict = {}  # (path, dtype) -> model: plain and assisted peers share one target copy


def load_hf_model(path_or_pack: str, dtype: torch.dtype):
    key = (path_or_pack, dtype)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = _load_hf_model(path_or_pack, dtype)
    return _HF_MODELS[key]


def release_hf_models() -> None:
    _HF_MODELS.clear()


def _load_hf_model(path_or_pack: str, dtype: torch.dtype):
    """transformers' own model from the same GGUF file (or HF directory) the engine loads.
    Loads GGUF through transformers' converter directly, which avoids from_pretrained's
    `accelerate` requirement for GGUF files."""
    try:
        import transformers
    except ImportError:
        raise PeerUnavailable("transformers is not installed (pip install transformers)") from None
    from specinfer.packs import resolve_pack

    path = path_or_pack
    if not os.path.exists(path):
        path = str(resolve_pack(path_or_pack))
    if os.path.isdir(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"{path}: transformers could not load every tensor (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    del parsed
    if missing:
        model.tie_weights()
    return model.eval()


class HFEngine:
    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids: tuple[int, ...]):
        dtype = getattr(torch, cfg.method_dtype(method))
        self.method = method
        self.last_token_ids: list[list[int]] = []
        self.model = load_hf_model(cfg.model, dtype)
        self.eos = list(eos_token_ids)
        self.assistant = None
        if method.mode == "assisted":
            self.assistant = load_hf_model(method.draft_model, dtype)
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = method.num_speculative_tokens
            gc.num_assistant_tokens_schedule = "constant"  # the same fixed k as ours
            gc.assistant_confidence_threshold = 0.0

    def run(self, prompts: list[list[int]], cfg: BenchConfig, seed: int = 0) -> tuple[int, None]:
        if self.method.mode != "plain" and len(prompts) > 1:
            raise PeerUnavailable(f"HF {self.method.mode} generation supports batch size 1 only")
        width = max(len(p) for p in prompts)
        pad = self.eos[0] if self.eos else 0
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        kw = dict(max_new_tokens=cfg.max_tokens, pad_token_id=pad, eos_token_id=self.eos or None)
        if cfg.temperature > 0:
            torch.manual_seed(seed)
            kw.update(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if cfg.ignore_eos:
            kw.update(min_new_tokens=cfg.max_tokens)
        if self.method.mode == "assisted":
            kw["assistant_model"] = self.assistant
        elif self.method.mode == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.method.num_speculative_tokens
            kw["max_matching_ngram_size"] = 4
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kw)
        new = out[:, width:].tolist()
        self.last_token_ids = []
        for row in new:  # useful tokens: up to and including the first EOS (the rest is padding)
            n = len(row)
            if not cfg.ignore_eos:
                n = next((i + 1 for i, t in enumerate(row) if t in self.eos), n)
            self.last_token_ids.append(row[:n])
        return sum(map(len, self.last_token_ids)), None

    def close(self):
        self.model = self.assistant = None
