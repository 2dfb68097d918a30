"""CUDA graphs for decode and verification batches, with eager fallback.

A batch of S sequences whose longest query run has at most q tokens, for a planned query length q
(1 for decodes and batch-expanded verification, 1 + k for mqa verification runs), is padded to
the smallest planned batch size B >= S and replayed from the graph captured for (B, q): plain
decodes, verification runs, and mixes of both or of runs of different lengths (the goodput
policy gives each request its own number of drafts, so most verification batches are not
uniform). Everything else (prefill chunks, batches larger than the plan, buckets whose capture
failed) runs eagerly through the same backend.

Padding inside a captured batch is inert: the kernels' launch grid depends only on (B, q); the
B - S padded sequences have no query tokens (query_start_loc repeats T, seq_lens 0, so the Triton
programs of those sequences exit at once), a real sequence's programs past its own query length
exit likewise, and the padded tokens (rows T .. B*q, owned by no sequence) write their K/V to slot
-1, which the Triton KV store skips; rows past T are dropped from the output. With a token tree
in the engine every graph is captured with tree-mask buffers (tree_mask 0 is an ordinary causal
token, so plain rows and tree rows share the graphs); without one, a batch carrying tree masks
runs eagerly. The graph's inputs live in static buffers; a replay copies the batch into them, so
the metadata the graph was captured with is exactly the padded metadata an eager run of the same
buffers would see. `mode="eager_static"` runs the model eagerly over those same buffers: that is
how the padding is tested on CPU (Triton interpreter), where no graph can be captured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specinfer.attention import ForwardContext
from specinfer.attention.metadata import AttentionMetadata
from specinfer.attention.triton_backend import TritonPrepared
from specinfer.models.model_runner import ModelRunner

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # sequences; larger decode batches are compute-bound, graphs gain little


@dataclass(frozen=True)
class GraphPlan:
    batch_sizes: tuple[int, ...]  # padded sequence counts captured, increasing
    query_lens: tuple[int, ...]  # query tokens per sequence: 1, and 1 + k for mqa verification
    max_blocks_per_seq: int  # W of the static block table: ceil(max_model_len / block_size)
    tree: bool = False  # capture with token-tree mask buffers (the engine verifies token trees)

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch, query length) to capture, largest first (smaller graphs then reuse the pool)."""
        return sorted(((b, q) for q in self.query_lens for b in self.batch_sizes), reverse=True)

    def key_for(self, num_seqs: int, num_tokens: int, max_query_len: int) -> tuple[int, int] | None:
        """The captured (batch, query length) a batch replays, or None (eager): the smallest planned
        q >= its longest query run and the smallest planned batch >= its sequences; None when the
        runs are longer than every planned q (prefill chunks) or the sequences more than planned.
        Every run has 1..max_query_len tokens, so num_tokens <= B * q follows."""
        m = int(max_query_len)
        if num_seqs == 0 or num_tokens == 0:
            return None
        q = next((q for q in sorted(self.query_lens) if q >= m), None)
        b = next((b for b in self.batch_sizes if b >= num_seqs), None)
        return None if q is None or b is None else (b, q)


def graph_plan(limits) -> GraphPlan:
    """vLLM's capture sizes (1, 2, 4, then multiples of 8) up to the largest batch the engine can
    form, each size's tokens within the step's token budget."""
    k = limits.num_speculative_tokens
    expand = limits.scorer == "batch_expansion"
    query_lens = (1,) if k == 0 or expand else (1, 1 + k)
    most = min(limits.max_num_seqs * (1 + k if expand else 1), MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4) if b < most] + list(range(8, most, 8)) + [most]
    sizes = sorted({b for b in sizes if b * min(query_lens) <= limits.max_num_batched_tokens})
    return GraphPlan(tuple(sizes), query_lens, -(-limits.max_model_len // limits.block_size), limits.token_tree)


class _StaticBatch:
    """The graph's input and output buffers for one (B, q)."""

    def __init__(self, B: int, q: int, W: int, device, tree: bool = False):
        T = B * q
        self.B, self.q = B, q
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.prepared = TritonPrepared(
            slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(B + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(B, dtype=torch.int32, device=device),
            block_table=torch.zeros(B, W, dtype=torch.int32, device=device),
            max_query_len=q,
            tree_mask=torch.zeros(T, dtype=torch.int64, device=device) if tree else None,
            tree_start=torch.zeros(B, dtype=torch.int32, device=device) if tree else None)
        self.hidden: torch.Tensor | None = None  # the captured output, [T, hidden]

    def fill(self, input_ids, positions, attn: AttentionMetadata) -> int:
        """Copy one real batch in; returns its token count. Padded rows: slot -1, no sequence."""
        T, S = int(input_ids.shape[0]), int(attn.seq_lens.shape[0])
        p = self.prepared
        self.input_ids[:T].copy_(input_ids)
        self.input_ids[T:].zero_()
        self.positions[:T].copy_(positions)
        self.positions[T:].zero_()
        p.slot_mapping[:T].copy_(attn.slot_mapping)
        p.slot_mapping[T:].fill_(-1)
        p.query_start_loc[: S + 1].copy_(attn.query_start_loc)
        p.query_start_loc[S + 1:].fill_(T)
        p.seq_lens[:S].copy_(attn.seq_lens)
        p.seq_lens[S:].zero_()
        w = int(attn.block_table.shape[1])
        p.block_table[:S, :w].copy_(attn.block_table)
        p.block_table[:S, w:].zero_()
        p.block_table[S:].zero_()
        if p.tree_mask is not None:  # 0: an ordinary causal token (every row of a batch without a tree)
            if attn.has_tree:
                p.tree_mask[:T].copy_(attn.tree_mask)
                p.tree_mask[T:].zero_()
                p.tree_start[:S].copy_(attn.tree_start)
                p.tree_start[S:].zero_()
            else:
                p.tree_mask.zero_()
                p.tree_start.zero_()
        return T


class CudaGraphRunner(ModelRunner):
    """A ModelRunner that replays captured graphs for uniform batches and runs the rest eagerly.

    mode: "graph" (capture on CUDA) or "eager_static" (the same static, padded buffers run eagerly;
    for tests without a GPU)."""

    def __init__(self, model, kv_caches, backend, plan: GraphPlan, mode: str = "graph"):
        super().__init__(model, kv_caches, backend)
        if mode not in ("graph", "eager_static"):
            raise ValueError(f"mode={mode!r}; use 'graph' or 'eager_static'")
        self.plan = plan
        self.mode = mode
        self.device = kv_caches[0].device
        self._batches: dict[tuple[int, int], _StaticBatch] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._failed: set[tuple[int, int]] = set()  # capture failed: these keys run eagerly
        self._pool = None
        self.num_replays = 0
        self.num_eager = 0

    def _batch(self, key) -> _StaticBatch:
        b = self._batches.get(key)
        if b is None:
            b = self._batches[key] = _StaticBatch(*key, self.plan.max_blocks_per_seq, self.device, self.plan.tree)
        return b

    def _model(self, b: _StaticBatch) -> torch.Tensor:
        return self.model(b.input_ids, b.positions, ForwardContext(self.backend, b.prepared, self.kv_caches))

    @torch.inference_mode()
    def capture_all(self) -> int:  # pragma: no cover - needs CUDA
        """Capture every planned key; a key whose capture raises runs eagerly from then on."""
        if self.mode != "graph" or self._graphs or self._failed:
            return len(self._graphs)  # not capturing here, or captured already
        for key in self.plan.keys():
            b = self._batch(key)  # all padding: no sequence, every slot -1
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # JIT-compile the Triton kernels and settle allocations first
                        self._model(b)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    b.hidden = self._model(b)
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[key] = graph
            except Exception as e:  # eager fallback for this bucket
                log.warning("CUDA graph capture failed for batch %s, query length %s; running it eagerly: %s",
                            key[0], key[1], e)
                self._failed.add(key)
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

    @torch.inference_mode()
    def forward(self, input_ids, positions, attn: AttentionMetadata, prepared=None):
        key = self.plan.key_for(int(attn.seq_lens.shape[0]), int(input_ids.shape[0]), attn.max_query_len)
        usable = key is not None and key not in self._failed \
            and int(attn.block_table.shape[1]) <= self.plan.max_blocks_per_seq \
            and (self.plan.tree or not attn.has_tree)  # tree masks need graphs captured with them
        if self.mode == "graph":
            usable = usable and key in self._graphs
        if not usable:
            self.num_eager += 1
            return super().forward(input_ids, positions, attn, prepared)
        b = self._batch(key)
        T = b.fill(input_ids, positions, attn)
        if self.mode == "graph":
            self._graphs[key].replay()
            hidden = b.hidden
        else:
            hidden = self._model(b)
        self.num_replays += 1
        return hidden[:T].clone(), b.prepared
