"""Per-forward attention metadata: what every backend needs to run one mixed batch.

A batch is T query tokens grouped into S query sequences. Sequence s owns token rows
query_start_loc[s] .. query_start_loc[s+1]; its context (KV already cached plus this query)
has seq_lens[s] tokens, so its query tokens sit at positions seq_lens[s] - query_len .. seq_lens[s]-1
and attend causally to every earlier position of the same sequence. A prefill chunk, a single
decode token and a 1 + k verification run are all just query sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64[T]   flat KV slot (block_id * block_size + offset) per token
    query_start_loc: torch.Tensor  # int32[S + 1]
    seq_lens: torch.Tensor  # int32[S]     context length including this query
    block_table: torch.Tensor  # int32[S, W] block ids of each sequence, padded
    block_size: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class ForwardContext:
    """Everything an attention layer needs for one forward pass; passed down explicitly."""

    backend: "AttentionBackend"  # noqa: F821 - see specinfer.attention.backend
    metadata: object  # the backend's prepared metadata (backend.prepare(AttentionMetadata))
    kv_caches: list  # per layer: Tensor[2, num_blocks, block_size, num_kv_heads, head_dim]
