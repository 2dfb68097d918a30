"""The Gaudi platforms: static shapes through buckets, flat block-list attention, HPU graphs.

`HpuPlatform` runs on a Gaudi; `HpuEmulatedPlatform` (`device="hpu-emulated"`) runs the same
path on CPU with the device calls answered by `EmulatedDevice`: the Rust packer pads every batch
to a token bucket, padded rows write only the null block, attention runs through the flat
block-list backend padded to (tokens, blocks) buckets, every planned shape is warmed up before
serving, and the speculation length comes from the warmed lengths only. The shape policy (which
buckets, which k) lives here; habana_frameworks is reached only through
specinfer.kernels.hpu.device, imported when a Gaudi is actually used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specinfer.platform.base import EngineLimits, Platform
from specinfer.platform.cpu import host_available_bytes

if TYPE_CHECKING:  # the kernels package is imported only when an HPU platform plans its buckets
    from specinfer.kernels.hpu.buckets import BucketConfig, BucketPlanner


def bucket_config_for(limits: EngineLimits, spec_lengths: tuple[int, ...] | None = None) -> BucketConfig:
    """Buckets covering every shape an engine with these limits can produce, each topped by the
    axis' exact maximum. Tokens: powers of two up to an eighth of the budget, then steps of an
    eighth (vllm-hpu's ramp), so a full step wastes at most 1/8 while small steps keep small
    graphs; at most ~12 token buckets. KV blocks: two buckets per doubling (padding < 41 %, ~20 %
    measured by specinfer.bench.padding; one per doubling wasted ~40 %), which keeps the
    (tokens x blocks) warm-up plan of the all-flat layout at a few hundred graphs. Other axes
    grow by powers of two."""
    from specinfer.kernels.hpu.buckets import BucketConfig, bucket_range, geometric_range

    T = limits.max_num_batched_tokens
    ctx_blocks = -(-limits.max_model_len // limits.block_size)
    k = limits.num_speculative_tokens
    rows = limits.max_num_seqs * (1 + k if limits.scorer == "batch_expansion" else 1)
    most_blocks = (max(T, rows) + limits.max_num_seqs) * ctx_blocks
    if spec_lengths is None:
        spec_lengths = tuple(range(k + 1))
    tokens = bucket_range(min(8, T), max(8, T // 8), T)
    if k:  # a draft model's catch-up forward: a step's tokens plus each request's bonus/recovered one
        tokens = (*tokens, T + limits.max_num_seqs)
    return BucketConfig(
        token_buckets=tokens,
        batch_buckets=geometric_range(1, rows),
        prefill_query_buckets=geometric_range(min(16, T), T),
        block_buckets=geometric_range(min(8, most_blocks), most_blocks, per_octave=2),
        context_block_buckets=geometric_range(1, ctx_blocks),
        spec_lengths=tuple(sorted({0, *spec_lengths})),
    )


class HpuPlatform(Platform):
    name = "hpu"
    default_attention_backend = "hpu_flat"
    distributed_backend = "hccl"
    device_name = "hpu"
    supported_attention_backends = ("hpu_flat",)
    launches_are_async = True  # lazy mode: graphs run on the device after mark_step
    samples_on_device = False  # (dynamic index shapes each step: unmeasured recompiles)
    num_null_blocks = 1  # padded rows write their K/V into one block past the pool

    def __init__(self, device: torch.device | None = None, *, bucket_config: BucketConfig | None = None,
                 spec_lengths: tuple[int, ...] | None = None, multi_token_path: str = "flat",
                 default_dtype: torch.dtype = torch.bfloat16):
        super().__init__(device if device is not None else torch.device("hpu"), default_dtype)
        self._bucket_config = bucket_config
        self._spec_lengths = spec_lengths
        self.multi_token_path = multi_token_path
        self.planner: BucketPlanner | None = None
        self.runners: list = []

    def _planner(self, limits: EngineLimits) -> BucketPlanner:
        if self.planner is None:
            from specinfer.kernels.hpu.buckets import BucketPlanner

            cfg = self._bucket_config or bucket_config_for(limits, self._spec_lengths)
            self.planner = BucketPlanner(cfg)
            self._limits = limits
        elif limits != self._limits:
            raise ValueError("this HPU platform object already serves an engine with other limits; "
                             "give each engine its own platform (its buckets are planned per engine)")
        return self.planner

    def make_attention_backend(self, name: str, limits: EngineLimits):
        from specinfer.attention.hpu_backend import HpuFlatBackend

        return HpuFlatBackend(self._planner(limits), self.multi_token_path)

    def device_ops(self):  # pragma: no cover - needs Gaudi
        from specinfer.kernels.hpu.device import GaudiDevice

        return GaudiDevice()

    def make_runner(self, model, kv_caches, backend, limits: EngineLimits):
        from specinfer.platform.bucketed_runner import BucketedModelRunner

        runner = BucketedModelRunner(model, kv_caches, backend, self._planner(limits), self.device_ops())
        self.runners.append(runner)
        return runner

    def available_memory_bytes(self) -> int:  # pragma: no cover - needs Gaudi
        from specinfer.kernels.hpu.device import mem_get_info

        return mem_get_info()[0]

    def token_buckets(self, limits: EngineLimits) -> tuple[int, ...]:
        return self._planner(limits).config.token_buckets

    def speculation_length(self, wanted_k: int, num_seqs: int, scorer: str) -> int:
        """The largest warmed k <= wanted_k whose verification batch fits the warmed buckets."""
        if self.planner is None:
            return wanted_k
        return self.planner.speculation_length(wanted_k, num_seqs, scorer)

    def warmup(self) -> None:
        """Run every planned shape once on every runner made here (target and draft model)."""
        for r in self.runners:
            if not r.shapes.warmed:
                r.warmup()


class HpuEmulatedPlatform(HpuPlatform):
    """The Gaudi path on CPU (fp32 by default, so outputs can be compared exactly with torch_ref)."""

    name = "hpu-emulated"
    distributed_backend = "gloo"
    launches_are_async = False  # the "device" is this CPU
    device_name = "hpu-emulated"

    def __init__(self, *, bucket_config: BucketConfig | None = None, spec_lengths: tuple[int, ...] | None = None,
                 multi_token_path: str = "flat", default_dtype: torch.dtype = torch.float32):
        super().__init__(torch.device("cpu"), bucket_config=bucket_config, spec_lengths=spec_lengths,
                         multi_token_path=multi_token_path, default_dtype=default_dtype)

    def device_ops(self):
        from specinfer.platform.bucketed_runner import EmulatedDevice

        return EmulatedDevice()

    def available_memory_bytes(self) -> int:
        return host_available_bytes()
