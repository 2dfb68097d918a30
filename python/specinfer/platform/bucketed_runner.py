"""The static-shape runner of the HPU platforms: every forward padded to a warmed bucket.

The Rust packer already pads the target's batches to a token bucket (`set_token_padding`);
forwards built in Python (a draft model's catch-up and drafting steps) are padded here the same
way: padded tokens have id 0, position 0, no query sequence, and write their K/V into the null
block (the last block of the cache, outside the pool). Logits rows are padded to a token bucket
too. Each forward's shape key is (tokens, attention shapes) from the backend's `signature`;
`warmup()` runs every key of the backend's `shape_plan()` once with all-padding metadata, and
afterwards every key met while serving is either warmed or recorded in `cold_shapes` (on a
Gaudi, a recompile).

The forward runs through a device object: `GaudiDevice` (HPU graph per key + mark_step, in
specinfer.kernels.hpu.device) on a Gaudi, `EmulatedDevice` (a plain call, mark_steps counted)
for `device="hpu-emulated"`: the same path, minus the device calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specinfer.attention import ForwardContext
from specinfer.attention.metadata import AttentionMetadata
from specinfer.models.model_runner import ModelRunner


class EmulatedDevice:
    """Answers GaudiDevice's calls on CPU: runs the function eagerly, counts mark_steps."""

    def __init__(self):
        self.num_mark_steps = 0

    def run(self, kind: str, key, fn, *args):
        return fn(*args)

    def mark_step(self) -> None:
        self.num_mark_steps += 1


@dataclass
class ShapeLog:
    """Shape keys by origin: warmed up, then met while serving (warmed or cold)."""

    warmed: set = field(default_factory=set)
    served: dict = field(default_factory=dict)  # key -> forwards run with it
    cold: set = field(default_factory=set)  # served keys that were never warmed (a recompile on a Gaudi)
    warming: bool = False
    real_tokens: int = 0
    padded_tokens: int = 0

    def note(self, key) -> None:
        if self.warming:
            self.warmed.add(key)
            return
        self.served[key] = self.served.get(key, 0) + 1
        if key not in self.warmed:
            self.cold.add(key)


class BucketedModelRunner(ModelRunner):
    def __init__(self, model, kv_caches: list[torch.Tensor], backend, planner, device_ops):
        super().__init__(model, kv_caches, backend)
        self.planner = planner
        self.device_ops = device_ops
        self.block_size = int(kv_caches[0].shape[2])
        self.null_block = int(kv_caches[0].shape[1]) - 1  # allocated past the pool (num_null_blocks = 1)
        self.shapes = ShapeLog()

    def _null_slots(self, n: int, device) -> torch.Tensor:  # int64[n]
        return self.null_block * self.block_size + torch.arange(n, dtype=torch.int64, device=device) % self.block_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                prepared=None, num_real_tokens: int | None = None):
        T = int(input_ids.shape[0])
        Tp = self.planner.pad(T, "tokens")
        if Tp != T:  # a forward the packer did not pad (draft model steps): pad it here
            pad = Tp - T
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
            attn = replace(attn, slot_mapping=torch.cat([attn.slot_mapping.to(torch.int64),
                                                         self._null_slots(pad, attn.slot_mapping.device)]))
            prepared = None
        if prepared is None:
            prepared = self.backend.prepare(attn)
        real = int(attn.query_start_loc[-1]) if num_real_tokens is None else num_real_tokens
        self.shapes.real_tokens += real
        self.shapes.padded_tokens += Tp - real
        hidden = self._run(("forward", *self.backend.signature(prepared)), input_ids, positions, prepared)
        return hidden[:T], prepared

    def _run(self, key, input_ids, positions, prepared):
        self.shapes.note(key)
        ctx = ForwardContext(self.backend, prepared, self.kv_caches)
        hidden = self.device_ops.run("forward", key, self.model, input_ids, positions, ctx)
        self.device_ops.mark_step()
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [L, hidden] -> float32[L, vocab]
        L = int(hidden.shape[0])
        Lp = self.planner.pad(max(L, 1), "tokens")
        if Lp != L:
            hidden = torch.cat([hidden, hidden.new_zeros(Lp - L, hidden.shape[1])])
        key = ("logits", Lp)
        self.shapes.note(key)
        out = self.device_ops.run("logits", key, self.model.compute_logits, hidden)
        self.device_ops.mark_step()
        return out[:L]

    @torch.inference_mode()
    def warmup(self) -> int:
        """Run every planned shape once (all-padding inputs: only the null block is written).
        Returns the number of shapes warmed."""
        device = self.kv_caches[0].device
        embed = self.model.embed_tokens  # [vocab, hidden]
        self.shapes.warming = True
        try:
            for t, flat, dense in self.backend.shape_plan():
                ids = torch.zeros(t, dtype=torch.int64, device=device)
                prepared = self.backend.dummy_prepared(t, flat, dense, self._null_slots(t, device),
                                                       self.block_size, device)
                self._run(("forward", *self.backend.signature(prepared)), ids, ids.clone(), prepared)
            for t in self.planner.config.token_buckets:
                self.logits(torch.zeros(t, embed.shape[1], device=device, dtype=embed.dtype))
        finally:
            self.shapes.warming = False
        return len(self.shapes.warmed)

    def padding_waste(self) -> float:
        """Padded tokens per real token over every forward served so far."""
        return self.shapes.padded_tokens / max(1, self.shapes.real_tokens)
