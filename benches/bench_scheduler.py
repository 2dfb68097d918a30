"""Per-step cost of the Rust core seen from Python: one `schedule()` + one `update()`
(including building every numpy array and crossing the PyO3 boundary) with many
long-running requests and chunked prefill of refills.

    pytest benches/bench_scheduler.py --benchmark-only
"""
from __future__ import annotations

import numpy as np
import pytest

from specinfer._core import SchedulerCore

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096


class Workload:
    """`num_running` requests with mixed prompt lengths (16..1024) and long outputs;
    a finished request is replaced at once, so prefill chunks keep mixing in."""

    def __init__(self, num_running: int, max_num_batched_tokens: int, num_drafts: int = 0, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.core = SchedulerCore(
            num_blocks=num_running * MAX_MODEL_LEN // BLOCK_SIZE + 64,
            block_size=BLOCK_SIZE,
            max_num_seqs=num_running,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            num_lookahead_tokens=num_drafts,
        )
        self.num_drafts = num_drafts
        self.next_id = 0
        for _ in range(num_running):
            self.add()
        # warm up until every request is past its first prefill
        while self.step().num_prefill_requests or self.core.num_waiting():
            pass

    def add(self) -> None:
        prompt_len = int(self.rng.integers(16, 1024))
        prompt = self.rng.integers(0, 32000, prompt_len)
        max_tokens = int(self.rng.integers(500, MAX_MODEL_LEN - prompt_len))
        self.core.add_request(self.next_id, prompt, max_tokens=max_tokens)
        self.next_id += 1

    def step(self):
        out = self.core.schedule()
        cu_logits = out.cu_num_logits
        # every logits row emits a token: all drafts accepted + bonus, or one decode token
        tokens = np.full(int(cu_logits[-1]), 11, dtype=np.int64)
        up = self.core.update(tokens, cu_logits)
        for _ in range(len(up.finished_req_ids)):
            self.add()
        if self.num_drafts:
            ids = out.req_ids
            k = self.num_drafts
            cu = np.arange(0, (len(ids) + 1) * k, k, dtype=np.int32)
            self.core.set_draft_tokens(ids, cu, np.full(len(ids) * k, 11, dtype=np.int64))
        return out


@pytest.mark.parametrize(
    "num_running, budget, num_drafts",
    [(256, 2048, 0), (1024, 8192, 0), (256, 2048, 3)],
    ids=["256req-decode", "1024req-decode", "256req-spec3"],
)
def test_schedule_update_step(benchmark, num_running, budget, num_drafts):
    w = Workload(num_running, budget, num_drafts)
    out = benchmark(w.step)
    assert len(out.req_ids) == num_running  # every request is scheduled each step
    w.core.check_invariants()
    benchmark.extra_info["running"] = num_running
    benchmark.extra_info["stats"] = w.core.stats()
