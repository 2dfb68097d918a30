"""Runs one model's forward over a paged batch. The target and a draft model each have one."""
from __future__ import annotations

import torch

from specinfer.attention import ForwardContext
from specinfer.attention.metadata import AttentionMetadata


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, aux_layers: tuple[int, ...] = ()):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        if (getattr(model, "batch_invariant", False) or getattr(model, "quantization", None) == "w8a8") \
                and hasattr(backend, "batch_invariant"):
            # a row must get the same bits in a decode and in a verification run: the engine's
            # batch_invariant option, and always under W8A8, which rounds every GEMM input to a grid
            # (float noise would change greedy tokens) (attention/cpu_native.py)
            backend.batch_invariant = True
        # layers whose inputs a proposer reads (EAGLE-3): each forward keeps them in last_aux
        self.aux_layers = tuple(aux_layers)
        self.last_aux: torch.Tensor | None = None  # [T, len(aux_layers) * hidden] of the latest forward

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                prepared=None, **model_kwargs) -> tuple[torch.Tensor, object]:
        """input_ids/positions int64[T] -> final hidden states [T, hidden]; also the prepared
        attention metadata, so a second model over the same batch can reuse it. model_kwargs go
        to the model's forward (exit_layer, aux_layers: see LlamaForCausalLM.forward)."""
        if prepared is None:
            prepared = self.backend.prepare(attn)
        ctx = ForwardContext(self.backend, prepared, self.kv_caches)
        if not self.aux_layers or model_kwargs:
            return self.model(input_ids, positions, ctx, **model_kwargs), prepared
        hidden, self.last_aux = self.model(input_ids, positions, ctx, aux_layers=self.aux_layers)
        return hidden, prepared

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [L, hidden] -> float32[L, vocab]
        return self.model.compute_logits(hidden)
