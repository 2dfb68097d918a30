"""The Platform protocol's shared part: what every hardware answers, and the defaults.

A Platform is resolved once per engine. Everything hardware-specific that the engine needs goes
through it: device and default dtype, the attention backend (default and which overrides are
allowed), the KV memory budget, model preparation, the runner that executes forwards (eager,
CUDA graphs, HPU graphs), and the shape policy (token buckets the Rust packer pads to, and the
speculation length allowed by the warmed shapes). Subclasses override; nothing outside this
package asks which hardware it is on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.models.model_runner import ModelRunner

ATTENTION_BACKENDS = ("cpu_native", "torch_ref", "triton", "hpu_flat")


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings a platform's shape policy is derived from."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_speculative_tokens: int  # 0 without speculation
    scorer: str  # "mqa" | "batch_expansion" (meaningless without speculation)
    token_tree: bool = False  # verification runs carry token-tree masks


@dataclass(frozen=True)
class MemoryBudget:
    """How many bytes the KV cache may take: min(available_bytes * memory_fraction, max_bytes)."""

    available_bytes: int
    memory_fraction: float
    max_bytes: int

    def as_kwargs(self) -> dict:
        return dict(available_bytes=self.available_bytes, memory_fraction=self.memory_fraction,
                    max_bytes=self.max_bytes)


class Platform:
    name = "base"
    default_attention_backend = "torch_ref"
    # backends that run on this platform; an override outside this set is refused
    supported_attention_backends: tuple[str, ...] = ATTENTION_BACKENDS
    distributed_backend = "gloo"  # torch.distributed backend of tensor-parallel collectives (executor/)
    device_name: str | None = None  # what a tensor-parallel worker passes to resolve_platform (None: the device)
    # a forward launched here returns before the device finished it (CUDA streams, Gaudi's lazy
    # graphs); where it does not, the engine's overlapped loop runs forwards on a worker thread
    launches_are_async = False
    # without a forward thread, a plain step's sampling may be queued as device work behind its
    # forward and the next step scheduled ahead on the device (engine/device_sampling.py); Gaudi's
    # lazy graphs would recompile for its per-step index shapes: not there until measured
    samples_on_device = True

    def __init__(self, device: torch.device, default_dtype: torch.dtype):
        self.device = device
        self.default_dtype = default_dtype
        self.attention_backend = self.default_attention_backend  # set by choose_attention_backend
        # the engine's batch_invariant option (see check_batch_invariant): prepare_model reads it
        self.batch_invariant = False

    def check_batch_invariant(self, dtype: torch.dtype, quantization: str | None) -> None:
        """Refuse batch_invariant=True where this platform cannot compute a row the same in
        every batch (the CPU platform says where it can)."""
        raise ValueError(f"batch_invariant=True runs on CPU only (device {self.device})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, attention_backend={self.attention_backend!r})"

    # ------------------------------------------------------------------ attention
    def choose_attention_backend(self, override: str | None) -> str:
        """The backend to run: the override when given (validated), else the platform's default."""
        if override is None or override == "auto":
            return self.attention_backend
        if override not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={override!r} is not one of {['auto', *ATTENTION_BACKENDS]}")
        if override not in self.supported_attention_backends:
            raise ValueError(f"attention_backend={override!r} does not run on {self.name} "
                             f"(supported: {list(self.supported_attention_backends)})")
        self.attention_backend = override
        return override

    def make_attention_backend(self, name: str, limits: EngineLimits):
        from specinfer.attention import get_backend

        return get_backend(name)

    # ------------------------------------------------------------------ memory
    def available_memory_bytes(self) -> int:
        raise NotImplementedError

    def memory_budget(self, cache_cfg, reserve_bytes: int = 0) -> MemoryBudget:
        """The KV cache budget. reserve_bytes: activation memory the forward will still need (host
        platforms ignore it: their fraction of available memory and absolute cap leave room)."""
        return MemoryBudget(self.available_memory_bytes(), cache_cfg.kv_cache_memory_fraction,
                            cache_cfg.kv_cache_max_bytes)

    # ------------------------------------------------------------------ models and forwards
    def prepare_model(self, model) -> None:
        """Last touches before serving (weight packing, graph-friendly layouts)."""

    def make_runner(self, model, kv_caches: list[torch.Tensor], backend, limits: EngineLimits) -> ModelRunner:
        return ModelRunner(model, kv_caches, backend)

    def synchronize(self) -> None:
        pass

    # ------------------------------------------------------------------ shape policy
    num_null_blocks = 0  # KV blocks past the pool that padded rows write into (static-shape platforms)

    def token_buckets(self, limits: EngineLimits) -> tuple[int, ...] | None:
        """Token counts the Rust packer pads every batch to; None: dynamic shapes, no padding."""
        return None

    def speculation_length(self, wanted_k: int, num_seqs: int, scorer: str) -> int:
        """The k to draft this step: any k on dynamic-shape platforms."""
        return wanted_k

    def warmup(self) -> None:
        """Compile or capture every shape serving may meet, for every runner this platform made
        (static-shape platforms, CUDA graphs)."""
