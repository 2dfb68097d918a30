"""What one rank holds and does: its shards of the target (and draft) model, their KV pools and
runners, and the handling of every executor message.

The driver (rank 0) runs the very same `RankWorker.handle` on each message it broadcasts, so the
driver's shard and the workers' shards do the same work in the same order by construction; the
collectives inside the model (all-reduce, all-gather) keep them in step.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from specinfer.attention.kv_cache import allocate_kv_caches
from specinfer.loader.model_loading import load_any
from specinfer.models.model_runner import ModelRunner
from specinfer.attention.kv_cache import apply_kv_copies
from specinfer.executor import messages as m
from specinfer.executor.device_move import to_device
from specinfer.executor.head_handle import LocalHead
from specinfer.models.tensor_parallel import TensorParallelGroup, shard_model


class RankWorker:
    def __init__(self, world, platform):
        self.world = world  # process_group.DistributedWorld
        self.rank = world.rank
        self.world_size = world.world_size
        self.platform = platform
        self.device = platform.device
        self.loaded: dict[str, object] = {}  # role -> LoadedModel (this rank's shard); absent: not in its group
        self.groups: dict[str, TensorParallelGroup] = {}  # role -> its group as seen from this rank
        self.kv_caches: dict[str, list[torch.Tensor]] = {}
        self.runners: dict[str, ModelRunner] = {}
        self.head: LocalHead | None = None  # this rank's shard of a draft head (LoadHead)

    def handle(self, msg):
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"rank {self.rank}: unknown executor message {type(msg).__name__}")
        out = handler(self, msg)
        if self.world_size > 1 and type(msg) in _SYNCED:  # no collective inside: fail here, not later
            import torch.distributed as dist

            # after loading: the startup timeout (slow disks); after a method: the step timeout
            dist.barrier(group=self.world.compute_group if isinstance(msg, m.CallMethod) else None)
        return out

    # ------------------------------------------------------------------ messages
    def load_model(self, msg: m.LoadModel):
        """Every rank joins the role's process group (a collective); members load their shard."""
        import torch.distributed as dist

        size = msg.tp_size
        group = None
        if self.world_size > 1 and size > 1:
            group = (self.world.compute_group if size == self.world_size else
                     dist.new_group(ranks=list(range(size)), timeout=timedelta(seconds=self.world.timeout_s)))
        if self.rank >= size:
            return None
        self.groups[msg.role] = tp = TensorParallelGroup(self.rank, size, group)
        loaded = load_any(msg.path, dtype=msg.dtype, device=self.device, quantization=msg.quantization)
        shard_model(loaded.model, tp)  # dense shards first, then the platform's packing
        self.platform.prepare_model(loaded.model)
        self.loaded[msg.role] = loaded
        return loaded

    def load_head(self, msg: m.LoadHead):
        """Load the draft head over this rank's target shard, then keep this rank's shard of it."""
        from specinfer.spec_decode.head_quantization import apply_quantization
        from specinfer.spec_decode.registry import proposer_class

        target = self.loaded["target"]
        head = proposer_class(msg.method).load_head(msg.path, target, dtype=msg.dtype, device=self.device)
        head.shard(self.groups["target"])
        apply_quantization(head, msg.quantization)  # this rank's shard, quantized
        self.head = LocalHead(head)
        return self.head

    def bind_kv(self, msg: m.BindKv):
        """Allocate this rank's KV pools (its KV heads only) and an eager runner per model; an
        EAGLE head's own pool (role "head") too."""
        backend = self.platform.make_attention_backend(msg.attention_backend, msg.limits)
        for role, loaded in self.loaded.items():
            caches = allocate_kv_caches(loaded.model, msg.num_blocks, msg.block_size, msg.dtype, self.device)
            self.kv_caches[role] = caches
            self.runners[role] = ModelRunner(loaded.model, caches, backend)
        if self.head is not None and hasattr(self.head, "kv_cache_shape"):
            caches = allocate_kv_caches(self.head, msg.num_blocks, msg.block_size, msg.dtype, self.device)
            self.kv_caches["head"] = caches
            self.head.bind(caches, backend)
        return dict(self.kv_caches)

    @torch.inference_mode()
    def head_call(self, msg: m.HeadCall):
        return self.head.call(msg.name, to_device(msg.args, self.device))

    def execute_model(self, msg: m.ExecuteModel):
        batch = to_device(msg.batch, self.device)
        runner = self.runners["target"]
        hidden, _ = runner.forward(batch.input_ids, batch.positions, batch.attn)
        return hidden, runner.logits(hidden[batch.logits_indices])

    def run_forward(self, msg: m.RunForward):
        runner = self.runners.get(msg.role)
        if runner is None:  # not in the role's group
            return None
        ids, pos, attn = to_device((msg.input_ids, msg.positions, msg.attn), self.device)
        return runner.forward(ids, pos, attn, **msg.model_kwargs)

    def run_logits(self, msg: m.RunLogits):
        runner = self.runners.get(msg.role)
        if runner is None:
            return None
        return runner.logits(to_device(msg.hidden, self.device))

    @torch.inference_mode()
    def apply_kv_copies(self, msg: m.ApplyKvCopies):
        """K and V of slots src -> slots dst, in every layer of every pool this rank holds."""
        apply_kv_copies(list(self.kv_caches.values()), msg.src, msg.dst)

    def call_method(self, msg: m.CallMethod):
        return getattr(self, msg.name)(*msg.args)

    # methods reachable through collective_rpc
    def ping(self) -> int:
        return self.rank

    def total_payload_bytes(self, blob: bytes) -> int:  # tests: every rank got the whole message
        import torch.distributed as dist

        n = torch.tensor([len(blob)], dtype=torch.int64)
        dist.all_reduce(n, group=self.world.compute_group)
        return int(n.item())

    def raise_error(self, text: str):  # tests: a worker exception must reach the user
        if self.rank > 0:
            raise RuntimeError(text)


_SYNCED = (m.LoadModel, m.LoadHead, m.BindKv, m.CallMethod)
_HANDLERS = {
    m.LoadModel: RankWorker.load_model,
    m.LoadHead: RankWorker.load_head,
    m.HeadCall: RankWorker.head_call,
    m.BindKv: RankWorker.bind_kv,
    m.ExecuteModel: RankWorker.execute_model,
    m.RunForward: RankWorker.run_forward,
    m.RunLogits: RankWorker.run_logits,
    m.ApplyKvCopies: RankWorker.apply_kv_copies,
    m.CallMethod: RankWorker.call_method,
}
