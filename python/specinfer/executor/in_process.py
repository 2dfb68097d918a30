"""The in-process executor: the engine's own process runs the target (and any draft) on one device.
This is the engine as it always ran; the multiprocess executor offers the same methods."""
from __future__ import annotations

import torch

from specinfer.attention.kv_cache import allocate_kv_caches
from specinfer.loader.model_loading import load_any
from specinfer.models.model_runner import ModelRunner
from specinfer.attention.kv_cache import apply_kv_copies
from specinfer.executor.forward_thread import LaunchesForwards
from specinfer.executor.head_handle import LocalHead


class InProcessExecutor(LaunchesForwards):
    tensor_parallel_size = 1

    def __init__(self, platform):
        self.platform = platform
        self.target_runner = None  # the runner execute_model drives (the first one made)
        self._kv_caches: list[list[torch.Tensor]] = []  # every pool: KV copies apply to all

    def load_model(self, path, role: str = "target", *, dtype, quantization=None):
        """-> LoadedModel, prepared for this platform (packed GEMMs on CPU)."""
        return load_any(path, dtype=dtype, device=self.platform.device, platform=self.platform,
                        quantization=quantization)

    def load_head(self, method: str, path, target, *, dtype, quantization=None):
        """The draft head of `method` at `path` over the target (LoadedModel), its GEMM weights
        int8 with quantization="int8" (or "auto": where they fit; spec_decode/head_quantization.py), behind the handle its proposer calls (executor/head_handle.py)."""
        from specinfer.spec_decode.head_quantization import apply_quantization
        from specinfer.spec_decode.registry import proposer_class

        head = proposer_class(method).load_head(path, target, dtype=dtype, device=self.platform.device)
        apply_quantization(head, quantization)
        return LocalHead(head)

    def allocate_kv_caches(self, models, num_blocks: int, block_size: int, dtype, attention_backend: str,
                           limits) -> list[list[torch.Tensor]]:
        """One list of per-layer caches per model, in the order given."""
        caches = [allocate_kv_caches(m, num_blocks, block_size, dtype, self.platform.device) for m in models]
        self._kv_caches = caches
        return caches

    def make_runner(self, model, kv_caches, backend, limits, aux_layers: tuple = ()):
        """The platform's runner (CUDA graphs, HPU buckets), or an eager one that keeps the inputs
        of aux_layers (EAGLE-3 reads them). The first runner made is the target's."""
        if aux_layers:
            runner = ModelRunner(model, kv_caches, backend, aux_layers)
        else:
            runner = self.platform.make_runner(model, kv_caches, backend, limits)
        if self.target_runner is None:
            self.target_runner = runner
        return runner

    def make_eager_runner(self, model, kv_caches, backend) -> ModelRunner:
        """A plain runner (model kwargs such as exit_layer pass through), e.g. layer_skip's."""
        return ModelRunner(model, kv_caches, backend)

    def execute_model(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: attention.batch_metadata.ModelBatch -> (hidden [T, hidden], float32 logits [L, vocab])."""
        runner = self.target_runner
        hidden, _ = runner.forward(batch.input_ids, batch.positions, batch.attn)
        return hidden, runner.logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def apply_kv_copies(self, src, dst) -> None:
        """K and V of flat slots src int64[C] -> slots dst int64[C] (the core's copy list after a
        tree verification), in every layer of every pool."""
        apply_kv_copies(self._kv_caches, src, dst)

    def shutdown(self) -> None:
        self.run_forwards_on_thread(False)
