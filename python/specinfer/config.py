"""Engine configuration: frozen dataclasses validated at construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from the memory budget
    kv_cache_memory_fraction: float = 0.25  # of available memory, when num_kv_blocks is None
    kv_cache_max_bytes: int = 4 << 30  # host platforms only
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's total memory the engine may use

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1 (got {self.block_size!r})")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an integer >= 1 or None (got {self.num_kv_blocks!r})")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1] (got {self.kv_cache_memory_fraction!r})")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {u!r})")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self):
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1 (got {self.max_num_seqs!r})")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1 (got {self.max_num_batched_tokens!r})")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 or None (got {self.max_model_len!r})")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (executor/): the target over tensor_parallel_size ranks, a draft model
    over ranks 0 .. draft_tensor_parallel_size - 1."""

    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None  # speculative.draft_tensor_parallel_size; None: the target's
    timeout_s: float = 120.0  # a collective waiting this long on a silent worker fails the engine

    def __post_init__(self):
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1 (got {n!r})")
        d = self.draft_tensor_parallel_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1 or n % d):
            divisors = [i for i in range(1, n + 1) if n % i == 0]
            raise ValueError(f"speculative.draft_tensor_parallel_size must divide tensor_parallel_size={n} "
                             f"(one of {divisors}; got {d!r})")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"distributed_timeout_s must be a number > 0 (got {t!r})")

    @property
    def draft_size(self) -> int:
        return self.tensor_parallel_size if self.draft_tensor_parallel_size is None else self.draft_tensor_parallel_size
