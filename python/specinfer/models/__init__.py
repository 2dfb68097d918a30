"""Model implementations. One Llama-family decoder covers Llama, Mistral and Qwen2."""
from specinfer.models.config import ModelConfig
from specinfer.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig"]
