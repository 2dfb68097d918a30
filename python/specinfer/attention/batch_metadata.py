"""The Rust scheduler's flat arrays, seen as torch tensors (zero-copy on CPU)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specinfer.attention.metadata import AttentionMetadata


@dataclass
class ModelBatch:
    input_ids: torch.Tensor  # int64[T]
    positions: torch.Tensor  # int64[T]
    logits_indices: torch.Tensor  # int64[L]
    attn: AttentionMetadata


def as_device(a: np.ndarray, device) -> torch.Tensor:
    """A host array as a tensor on `device`: a view on CPU; elsewhere an asynchronous copy (a
    blocking host-to-device copy would first wait for every kernel queued on the stream: on the
    critical path of an overlapped step, that is the step the host should be ahead of)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


_t = as_device


def model_batch_from_schedule(out, block_size: int, device: torch.device) -> ModelBatch:
    """A SchedulerOutput as the forward's batch (on the critical path of every step: one pass, no
    helper calls on CPU, where the tensors view the core's arrays)."""
    tree_mask = getattr(out, "tree_mask", None)
    tree = tree_mask is not None and len(tree_mask) > 0  # the batch holds a token tree (docs/trees.md)
    if device.type == "cpu":
        t = torch.from_numpy
        attn = AttentionMetadata(t(out.slot_mapping), t(out.query_start_loc), t(out.seq_lens), t(out.block_table),
                                 block_size, int(out.max_query_len), int(out.max_seq_len),
                                 t(tree_mask) if tree else None, t(out.tree_start) if tree else None)
        return ModelBatch(t(out.input_ids), t(out.positions), t(out.logits_indices), attn)
    attn = AttentionMetadata(
        slot_mapping=_t(out.slot_mapping, device),
        query_start_loc=_t(out.query_start_loc, device),
        seq_lens=_t(out.seq_lens, device),
        block_table=_t(out.block_table, device),
        block_size=block_size,
        max_query_len=int(out.max_query_len),
        max_seq_len=int(out.max_seq_len),
        tree_mask=_t(tree_mask, device) if tree else None,
        tree_start=_t(out.tree_start, device) if tree else None,
    )
    return ModelBatch(_t(out.input_ids, device), _t(out.positions, device), _t(out.logits_indices, device), attn)


def attention_metadata_for_runs(block_table: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                                block_size: int, device: torch.device) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for query runs that begin at position starts[i] and have lens[i] tokens.

    block_table int32[S, W], starts int64[S], lens int64[S] (>= 1). Returns the metadata and the
    positions int64[T] of every query token (runs laid out one after another).
    """
    lens = lens.astype(np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    T = int(cu[-1])
    run_of_token = np.repeat(np.arange(len(lens)), lens)
    positions = starts.astype(np.int64)[run_of_token] + (np.arange(T) - cu[:-1][run_of_token])
    blocks = block_table[run_of_token, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    seq_lens = (starts + lens).astype(np.int32)
    attn = AttentionMetadata(
        slot_mapping=_t(slots, device), query_start_loc=_t(cu, device), seq_lens=_t(seq_lens, device),
        block_table=_t(np.ascontiguousarray(block_table, dtype=np.int32), device), block_size=block_size,
        max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()))
    return attn, positions


def attention_metadata_for_decode_steps(block_table: np.ndarray, first_pos: np.ndarray, steps: int,
                                        block_size: int, device: torch.device) -> list[tuple[AttentionMetadata, torch.Tensor]]:
    """attention_metadata_for_runs of `steps` back-to-back one-token runs per sequence (a draft
    model's forwards: sequence s feeds position first_pos[s] + i at step i), built in one pass;
    the block table and query starts are shared. -> [(metadata, positions int64[S] on device)]."""
    S = len(first_pos)
    pos = first_pos.astype(np.int64)[None, :] + np.arange(steps, dtype=np.int64)[:, None]  # [steps, S]
    slots = block_table[np.arange(S)[None, :], pos // block_size].astype(np.int64) * block_size + pos % block_size
    seq_lens = (pos + 1).astype(np.int32)
    cu = _t(np.arange(S + 1, dtype=np.int32), device)
    table = _t(np.ascontiguousarray(block_table, dtype=np.int32), device)
    out = []
    for i in range(steps):
        attn = AttentionMetadata(slot_mapping=_t(slots[i], device), query_start_loc=cu, seq_lens=_t(seq_lens[i], device),
                                 block_table=table, block_size=block_size, max_query_len=1,
                                 max_seq_len=int(seq_lens[i].max(initial=0)))
        out.append((attn, _t(pos[i], device)))
    return out


def attention_metadata_for_tree_nodes(block_table: np.ndarray, tree_starts: np.ndarray, node_counts: np.ndarray,
                                      node_slots: np.ndarray, node_depths: np.ndarray, node_masks: np.ndarray,
                                      block_size: int, device: torch.device) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for query runs made of token-tree nodes (a proposer drafting a tree depth by depth).

    Sequence s (block_table int32[S, W] row s) has node_counts[s] query tokens (int64[S], >= 1), all
    nodes of one tree whose root sits at KV position tree_starts[s] (int64[S]; its KV is written).
    Query token t (T = sum of node_counts, sequences one after another) is written at KV slot
    position ``tree_starts[s] + 1 + node_slots[t]`` (int64[T], node_slots[t] < 63), has RoPE position
    ``tree_starts[s] + node_depths[t]`` (int64[T], depth 1 = a child of the root) and sees the
    prefix before the root plus the slots whose bits are set in node_masks[t] (int64[T]; bit 0 =
    the root, bit j + 1 = slot position tree_starts[s] + 1 + j; it must include the token's own
    bit). Slots need not be contiguous. Returns the metadata and the RoPE positions int64[T].
    """
    node_counts = node_counts.astype(np.int64)
    cu = np.zeros(len(node_counts) + 1, dtype=np.int32)
    np.cumsum(node_counts, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(node_counts)), node_counts)
    starts = tree_starts.astype(np.int64)
    slot_pos = starts[seq_of_token] + 1 + node_slots.astype(np.int64)  # [T]
    assert (node_masks.astype(np.int64) >> (node_slots.astype(np.int64) + 1) & 1).all(), "a node must see itself"
    blocks = block_table[seq_of_token, slot_pos // block_size].astype(np.int64)
    slots = blocks * block_size + slot_pos % block_size
    seq_lens = np.zeros(len(node_counts), dtype=np.int32)
    np.maximum.at(seq_lens, seq_of_token, (slot_pos + 1).astype(np.int32))
    positions = starts[seq_of_token] + node_depths.astype(np.int64)
    attn = AttentionMetadata(
        slot_mapping=_t(slots, device), query_start_loc=_t(cu, device), seq_lens=_t(seq_lens, device),
        block_table=_t(np.ascontiguousarray(block_table, dtype=np.int32), device), block_size=block_size,
        max_query_len=int(node_counts.max()), max_seq_len=int(seq_lens.max()),
        tree_mask=_t(node_masks.astype(np.int64), device), tree_start=_t(starts.astype(np.int32), device))
    return attn, positions
