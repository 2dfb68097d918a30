"""What `load_model` hands back: the model, its config and everything needed to talk to it."""
from __future__ import annotations

from dataclasses import dataclass

import tokenizers

from specinfer.models.config import ModelConfig
from specinfer.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: tokenizers.Tokenizer  # encode(text) adds BOS iff add_bos_token
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config eos, then generation_config's (GGUF: eos, eot, eom)
    add_bos_token: bool
    chat_template: str | None  # Jinja source, as shipped with the model
    source: str  # the directory or .gguf file it came from
