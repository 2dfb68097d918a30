"""The CUDA platform: Triton kernels, bf16/fp16, a KV budget from the device's free memory
(`gpu_memory_utilization`, like vLLM), and CUDA graphs for decode and verification batches."""
from __future__ import annotations

import importlib.util

import torch

from specinfer.platform.base import EngineLimits, MemoryBudget, Platform


def triton_available() -> bool:
    """Whether triton is installed, without importing it (its import is slow and CUDA-probing)."""
    return importlib.util.find_spec("triton") is not None


class CudaPlatform(Platform):
    name = "cuda"
    distributed_backend = "nccl"
    launches_are_async = True  # kernels queue on the stream; the host returns at once
    supported_attention_backends = ("triton", "torch_ref")

    def __init__(self, device: torch.device, *, triton: bool | None = None, cuda_graphs: bool = True):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        super().__init__(device, dtype)
        self.attention_backend = "triton" if (triton_available() if triton is None else triton) else "torch_ref"
        self.cuda_graphs = cuda_graphs
        self.graph_runners: list = []

    def available_memory_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def memory_budget(self, cache_cfg, reserve_bytes: int = 0) -> MemoryBudget:
        """vLLM's rule: the engine may use gpu_memory_utilization of the device's TOTAL memory.
        Weights are loaded already (they and other processes' use show as not free), so the KV
        cache gets free - total * (1 - utilization), less the forward's activations (reserve)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryBudget(*cuda_kv_budget(free, total, cache_cfg.gpu_memory_utilization, reserve_bytes))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def make_runner(self, model, kv_caches, backend, limits: EngineLimits):
        from specinfer.models.model_runner import ModelRunner
        from specinfer.platform.cuda_graphs import CudaGraphRunner, graph_plan

        if not self.cuda_graphs or getattr(backend, "name", None) != "triton":
            return ModelRunner(model, kv_caches, backend)
        runner = CudaGraphRunner(model, kv_caches, backend, graph_plan(limits), mode="graph")
        self.graph_runners.append(runner)
        return runner

    def warmup(self) -> None:
        """Capture every planned decode/verification bucket of every graph runner (each falls
        back to eager for a bucket whose capture fails, and for every batch no bucket fits)."""
        for r in self.graph_runners:
            r.capture_all()


def cuda_kv_budget(free: int, total: int, utilization: float, reserve_bytes: int) -> tuple[int, float, int]:
    """(available_bytes, memory_fraction, max_bytes) for choose_num_blocks: everything up to the
    utilization cap, minus the activation reserve; no extra fraction, no absolute cap."""
    available = free - int(total * (1.0 - utilization)) - int(reserve_bytes)
    return max(0, available), 1.0, 1 << 62
