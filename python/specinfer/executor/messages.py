"""What the driver sends every rank: one typed message per call, pickled once and broadcast whole.

There is no per-field broadcast: a rank receives the very object the driver built, so a field
the driver has is a field every worker has (the class of bug behind vLLM's
``KeyError: 'num_seq_groups'`` cannot happen). Tensors travel as numpy arrays (WireTensor: cheap
to pickle); each rank turns them into tensors on its own device (executor/device_move.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class LoadModel:
    """Ranks of `role`'s group load `path` and keep their shard of it."""

    role: str  # "target" | "draft"
    path: str
    tp_size: int  # the role's tensor-parallel group: ranks 0 .. tp_size - 1
    dtype: torch.dtype
    quantization: str | None = None


@dataclass(frozen=True)
class LoadHead:
    """Every rank of the target's group loads the draft head of `method` at `path` (over its own
    shard of the target) and keeps its shard of the head (executor/head_handle.py)."""

    method: str  # "medusa" | "mlp_speculator" | "eagle" | "eagle3"
    path: str
    dtype: torch.dtype
    quantization: str | None = None  # "int8": the shard's GEMM weights quantized after sharding


@dataclass(frozen=True)
class HeadCall:
    """One call on the head's shard of every rank (head_handle.RANK_CALLS), e.g. a Medusa stage or
    an EAGLE draft-layer forward."""

    name: str
    args: tuple  # tensors as WireTensor


@dataclass(frozen=True)
class BindKv:
    """Allocate each loaded model's KV pool (this rank's KV heads only) and build its runner."""

    num_blocks: int  # pool blocks, null blocks included
    block_size: int
    dtype: torch.dtype  # of the KV cache
    attention_backend: str
    limits: object  # platform.EngineLimits


@dataclass(frozen=True)
class ExecuteModel:
    """One step of the target: forward over the whole mixed batch, logits at batch.logits_indices."""

    batch: object  # attention.batch_metadata.ModelBatch (tensors as WireTensor)


@dataclass(frozen=True)
class RunForward:
    """A proposer's forward through `role`'s model (a draft model's catch-up or draft step)."""

    role: str
    input_ids: torch.Tensor  # int64[T]
    positions: torch.Tensor  # int64[T]
    attn: object  # AttentionMetadata (tensors as WireTensor)
    model_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunLogits:
    role: str
    hidden: torch.Tensor  # [L, hidden] rows of the role's latest hidden states


@dataclass(frozen=True)
class ApplyKvCopies:
    """Copy K and V from slots src to slots dst in every KV pool (tree compaction)."""

    src: np.ndarray  # int64[C] flat slots (block * block_size + offset)
    dst: np.ndarray  # int64[C]


@dataclass(frozen=True)
class CallMethod:
    """Run RankWorker.<name>(*args) on every rank (collective_rpc)."""

    name: str
    args: tuple = ()


@dataclass(frozen=True)
class Shutdown:
    pass
