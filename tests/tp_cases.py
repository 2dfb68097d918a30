"""Shared by the tensor-parallel tests: engine settings that force chunked prefill and
preemption, one Generator's run, and the process census (no worker may outlive its Generator)."""
from __future__ import annotations

import gc
import os

from spec_cases import prompts
from specinfer import Generator, SamplingParams

# chunked prefill (a 24-token budget under prompts of up to ~90 tokens) and preemption (36
# blocks of 4 tokens for 8 requests)
SETTINGS = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=36, max_model_len=128)
N_PROMPTS = 6
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1000 + i) for i in range(N_PROMPTS)]


def children() -> list[int]:
    """Live descendants of this process (from /proc; zombies count as gone), but for
    multiprocessing's resource tracker and fork server (one each per process, they end with it;
    the workers are the fork server's children and are counted)."""
    stat = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            helper = int(fields[1]) == os.getpid() and (b"resource_tracker" in cmd or b"forkserver" in cmd)
            stat[int(pid)] = (int(fields[1]), fields[0], helper)
    out, parents = [], {os.getpid()}
    while parents:
        kids = {pid for pid, (ppid, _, _) in stat.items() if ppid in parents}
        out += [pid for pid in kids if stat[pid][1] != "Z" and not stat[pid][2]]
        parents = kids
    return out


def run(target, tp: int, spec=None, vocab: int = 256, drop: bool = False, **kw) -> dict:
    """Greedy and seeded outputs of one Generator (closed afterwards, or with drop=True only
    dropped: its finalizer must stop the workers), plus what it did."""
    before = set(children())
    gen = Generator(str(target), tensor_parallel_size=tp, speculative=spec, distributed_timeout_s=60,
                    **{**SETTINGS, **kw})
    core = None
    try:
        if tp > 1:
            assert len(set(children()) - before) == tp - 1  # the worker processes
        ps = [[t % vocab for t in p] for p in prompts(N_PROMPTS)]
        greedy = [o.token_ids for o in gen.generate(ps, GREEDY, use_tqdm=False)]
        seeded = [o.token_ids for o in gen.generate(ps, SEEDED, use_tqdm=False)]
        core = gen.engine.core
        assert core.num_free_blocks() == core.num_total_blocks()
        stats = dict(greedy=greedy, seeded=seeded, preempted=core.stats()["num_preemptions"],
                     metrics=gen.spec_metrics())
    finally:
        if drop:
            gen = core = None  # noqa: F841 - the last references
            gc.collect()
        else:
            gen.close()
    assert set(children()) - before == set(), "a worker process outlived its Generator"
    return stats


def check_same(tp1: dict, tp2: dict) -> None:
    assert tp2["greedy"] == tp1["greedy"]
    assert tp2["seeded"] == tp1["seeded"]
    assert tp2["preempted"] > 0, "no request was preempted"
    assert tp2["greedy"] != tp2["seeded"]  # the seeded run really sampled


def started(target, timeout_s: float = 60, spec=None):
    before = set(children())
    gen = Generator(str(target), tensor_parallel_size=2, distributed_timeout_s=timeout_s, speculative=spec,
                    **SETTINGS)
    workers = sorted(set(children()) - before)
    assert len(workers) == 1
    return gen, workers[0], before


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
