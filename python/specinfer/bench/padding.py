"""Padding waste of the Gaudi bucket plan on realistic request mixes (model-free).

Drives the Rust core exactly as the engine does on `device="hpu-emulated"` (token padding in the
packer, speculation with random acceptance), prepares every batch's flat attention metadata
with the platform's planner, and reports padded / real for the two padded axes:

- tokens: rows the model's GEMMs run on (the packer pads T to a token bucket);
- blocks: KV blocks the flat attention reads (padded to a block bucket).

No model runs, so it measures the shape policy alone and takes a second:

    python -m specinfer.bench.padding            # a table for the built-in mixes
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np
from specinfer._core import SchedulerCore
from specinfer.kernels.hpu.buckets import BucketConfig, BucketPlanner
from specinfer.platform.base import EngineLimits
from specinfer.platform.hpu import bucket_config_for


@dataclass(frozen=True)
class Mix:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]  # uniform range [lo, hi]
    output_len: tuple[int, int]
    k: int  # speculation length (0: none)
    acceptance: float  # per-draft-token acceptance probability


MIXES = (
    Mix("chat", 64, (20, 400), (50, 300), 4, 0.7),
    Mix("summarization", 32, (500, 1500), (50, 150), 4, 0.6),
    Mix("code-completion", 48, (100, 800), (20, 120), 3, 0.8),
    Mix("decode-only", 64, (8, 32), (200, 400), 0, 0.0),
)


def padding_waste(mix: Mix, *, max_num_seqs: int = 32, max_num_batched_tokens: int = 512, block_size: int = 16,
                  max_model_len: int = 2048, scorer: str = "mqa", bucket_config: BucketConfig | None = None,
                  seed: int = 0) -> dict:
    """Run the mix to completion through the core; returns waste ratios and step counts."""
    rng = np.random.default_rng(seed)
    limits = EngineLimits(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, mix.k, scorer)
    cfg = bucket_config or bucket_config_for(limits)
    planner = BucketPlanner(cfg)
    num_blocks = 8192
    core = SchedulerCore(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, False,
                         mix.k, scorer == "batch_expansion")
    core.set_token_padding(list(cfg.token_buckets), num_blocks)
    for i in range(mix.num_requests):
        p = int(rng.integers(mix.prompt_len[0], mix.prompt_len[1] + 1))
        out = int(rng.integers(mix.output_len[0], mix.output_len[1] + 1))
        core.add_request(i, rng.integers(3, 1000, p), out, 0, -1, True, [])
    real = padded = real_blocks = padded_blocks = steps = 0
    while core.has_unfinished_requests():
        sched = core.schedule()
        R = len(sched.req_ids)
        if R == 0:
            continue
        steps += 1
        T = int(sched.total_num_scheduled_tokens)
        real += T
        padded += len(sched.input_ids) - T
        used = _flat_blocks(sched, block_size)  # what HpuFlatBackend's all-flat path lists, counted
        real_blocks += used
        padded_blocks += planner.pad(used, "blocks") - used
        cu_logits = np.asarray(sched.cu_num_logits)
        drafts = np.asarray(sched.num_draft_tokens)
        emitted, cu = [], [0]
        for r in range(R):
            if cu_logits[r + 1] == cu_logits[r]:
                cu.append(cu[-1])
                continue
            accepted = 0
            while accepted < drafts[r] and rng.random() < mix.acceptance:
                accepted += 1
            emitted += [5] * (accepted + 1)
            cu.append(len(emitted))
        upd = core.update(np.asarray(emitted, np.int64), np.asarray(cu, np.int32))
        if mix.k:
            live = [int(i) for i in upd.req_ids.tolist() if i not in set(upd.finished_req_ids.tolist())]
            if live:
                k = planner.speculation_length(mix.k, len(live), scorer)
                if k:
                    core.set_draft_tokens(np.asarray(live, np.uint64), np.arange(len(live) + 1, dtype=np.int32) * k,
                                          np.full(len(live) * k, 5, np.int64))
    return {"mix": mix.name, "steps": steps, "real_tokens": real, "padded_tokens": padded,
            "token_waste": padded / max(real, 1), "real_blocks": real_blocks, "padded_blocks": padded_blocks,
            "block_waste": padded_blocks / max(real_blocks, 1), "token_buckets": list(cfg.token_buckets),
            "warmup_shapes": _warmup_shapes(planner)}


def _warmup_shapes(planner) -> int:
    """Graphs the all-flat warm-up compiles: every (tokens, blocks) forward plus logits per token bucket."""
    from specinfer.attention.hpu_backend import HpuFlatBackend

    return len(HpuFlatBackend(planner, "flat").shape_plan()) + len(planner.config.token_buckets)


def _flat_blocks(sched, block_size: int) -> int:
    """Blocks the all-flat attention lists: every query token reads its causal context."""
    qsl = np.asarray(sched.query_start_loc, dtype=np.int64)
    q_lens = np.diff(qsl)
    seq_lens = np.asarray(sched.seq_lens, dtype=np.int64)
    seq_of = np.repeat(np.arange(len(q_lens)), q_lens)
    lens = seq_lens[seq_of] - q_lens[seq_of] + (np.arange(int(qsl[-1])) - qsl[seq_of]) + 1
    return int(((lens + block_size - 1) // block_size).sum())


def main(argv=None) -> int:
    rows = [padding_waste(m) for m in MIXES]
    if argv and "--json" in argv:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'mix':<16} {'steps':>6} {'tokens padded/real':>19} {'blocks padded/real':>19} {'warm-up graphs':>15}")
    for r in rows:
        print(f"{r['mix']:<16} {r['steps']:>6} {r['token_waste']:>19.3f} {r['block_waste']:>19.3f} "
              f"{r['warmup_shapes']:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
