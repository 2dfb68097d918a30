"""Per-forward attention metadata: what every backend needs to run one mixed batch.

A batch is T query tokens grouped into S query sequences. Sequence s owns token rows
query_start_loc[s] .. query_start_loc[s+1]; its context (KV already cached plus this query)
has seq_lens[s] tokens, so its query tokens sit at KV positions seq_lens[s] - query_len .. seq_lens[s]-1
and attend causally to every earlier position of the same sequence. A prefill chunk, a single
decode token and a 1 + k verification run are all just query sequences.

Token trees: a tree run's nodes sit at consecutive KV positions starting at tree_start[s] (the
root, the last confirmed token), node i at tree_start[s] + i, but a node may see only the cached
prefix (positions < tree_start[s]), its ancestors and itself. tree_mask[t] != 0 marks such a
token: key position p is visible iff p < tree_start[s], or p - tree_start[s] < 64 and bit
(p - tree_start[s]) of tree_mask[t] is set (so a tree holds at most 64 nodes, root included).
tree_mask[t] == 0 is an ordinary causal token. With batch expansion a tree node is its own
single-token sequence whose context ends at its own position; the same rule applies. The RoPE
position of a node (root + depth) is the model's business, not the attention's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_SLOTS = 64  # root + nodes of one tree run: one bit each in tree_mask


def tree_visibility(
    tree_mask: torch.Tensor,  # int64[...] per query token (0: causal token)
    tree_start: torch.Tensor,  # int64[...] the token's sequence's tree root position
    key_pos: torch.Tensor,  # int64[..., K] key positions (broadcast against the two above + [K])
) -> torch.Tensor:  # bool[..., K]: visible under the tree rule (meaningless where tree_mask == 0)
    rel = key_pos - tree_start.unsqueeze(-1)
    in_tree = (rel >= 0) & (rel < MAX_TREE_SLOTS)
    bit = (tree_mask.unsqueeze(-1) >> rel.clamp(0, MAX_TREE_SLOTS - 1)) & 1
    return (rel < 0) | (in_tree & (bit == 1))


def tree_depth(tree_mask: torch.Tensor) -> torch.Tensor:
    """int64[...] depth of each tree token (popcount of its mask - 1: its ancestors, the root
    included); its logical position is tree_start + depth (what a sliding window measures)."""
    bits = torch.arange(MAX_TREE_SLOTS, device=tree_mask.device)
    return ((tree_mask.to(torch.int64).unsqueeze(-1) >> bits) & 1).sum(-1) - 1


def window_hidden(query_pos: torch.Tensor, tree_from: torch.Tensor, key_pos: torch.Tensor,
                  window: int) -> torch.Tensor:
    """bool: keys at key_pos outside the sliding window of queries at (logical) query_pos —
    p - j >= W — except in-tree keys of a tree token (key_pos >= its tree_from; ordinary tokens
    pass a tree_from beyond every key). Shapes broadcast (callers align them)."""
    return (query_pos - key_pos >= window) & (key_pos < tree_from)


NO_TREE = 1 << 62  # tree_from of an ordinary token: no key is in its tree


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64[T]   flat KV slot (block_id * block_size + offset) per token
    query_start_loc: torch.Tensor  # int32[S + 1]
    seq_lens: torch.Tensor  # int32[S]     context length including this query
    block_table: torch.Tensor  # int32[S, W] block ids of each sequence, padded
    block_size: int
    max_query_len: int
    max_seq_len: int
    tree_mask: torch.Tensor | None = None  # int64[T] see above; None: no tree token in the batch
    tree_start: torch.Tensor | None = None  # int32[S] KV position of each sequence's tree root

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def has_tree(self) -> bool:
        return self.tree_mask is not None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class ForwardContext:
    """Everything an attention layer needs for one forward pass; passed down explicitly."""

    backend: "AttentionBackend"  # noqa: F821 - see specinfer.attention.backend
    metadata: object  # the backend's prepared metadata (backend.prepare(AttentionMetadata))
    kv_caches: list  # per layer: Tensor[2, num_blocks, block_size, num_kv_heads, head_dim]
