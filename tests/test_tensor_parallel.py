"""Tensor parallelism (executor/): the target sharded over 2 ranks (gloo on CPU, a spawned worker
process) gives the tokens of the unsharded engine, greedy and seeded sampling, with chunked
prefill and preemption, for no speculation, ngram and a draft model sharded over 2 or 1 ranks; a
worker's exception reaches the user, a killed or stopped worker fails the Generator within a
bounded time, and no worker process outlives its Generator."""
from __future__ import annotations

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from spec_cases import prompts
from specinfer import Generator, SamplingParams
from specinfer.executor.multiproc import TensorParallelError

# chunked prefill (a 24-token budget under prompts of up to ~90 tokens) and preemption (36
# blocks of 4 tokens for 8 requests)
SETTINGS = dict(block_size=4, max_num_batched_tokens=24, num_kv_blocks=36, max_model_len=128)
N_PROMPTS = 6
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1000 + i) for i in range(N_PROMPTS)]


def _children() -> list[int]:
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


def _run(target, tp: int, spec=None, vocab: int = 256, drop: bool = False, **kw) -> dict:
    """Greedy and seeded outputs of one Generator (closed afterwards, or with drop=True only
    dropped: its finalizer must stop the workers), plus what it did."""
    before = set(_children())
    gen = Generator(str(target), tensor_parallel_size=tp, speculative=spec, distributed_timeout_s=60,
                    **{**SETTINGS, **kw})
    core = None
    try:
        if tp > 1:
            assert len(set(_children()) - before) == tp - 1  # the worker processes
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
    assert set(_children()) - before == set(), "a worker process outlived its Generator"
    return stats


def _check_same(tp1: dict, tp2: dict) -> None:
    assert tp2["greedy"] == tp1["greedy"]
    assert tp2["seeded"] == tp1["seeded"]
    assert tp2["preempted"] > 0, "no request was preempted"
    assert tp2["greedy"] != tp2["seeded"]  # the seeded run really sampled


def test_tp2_equals_tp1_without_speculation(tiny_dir):
    target, _ = tiny_dir("llama", False)
    _check_same(_run(target, 1), _run(target, 2, drop=True))


def test_tp2_ngram_int8_with_replicated_kv_heads_bias_padded_vocab(tiny_dir):
    """qwen2 (q/k/v bias) with one KV head (replicated on both ranks), tied embeddings, a
    vocabulary of 251 rows (the vocab-parallel shards are padded), int8 weights (sliced with their
    scales)."""
    target, _ = tiny_dir("qwen2", True, kv_heads=1, vocab=251)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    tp1 = _run(target, 1, spec, vocab=251, quantization="int8")
    tp2 = _run(target, 2, spec, vocab=251, quantization="int8")
    _check_same(tp1, tp2)
    assert tp2["metrics"]["num_draft_tokens"] > 0


_TP1_DRAFT_RUNS: dict = {}


@pytest.mark.parametrize("draft_tp", [2, 1])
def test_tp2_draft_model(target_and_draft, draft_tp):
    """A draft model sharded over both ranks, or kept whole on the driver (draft TP 1)."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp}
    tp2 = _run(target, 2, spec)
    key = (str(target), str(draft))
    if key not in _TP1_DRAFT_RUNS:  # the same TP=1 reference for both draft TPs
        _TP1_DRAFT_RUNS[key] = _run(target, 1, {**spec, "draft_tensor_parallel_size": None})
    tp1 = _TP1_DRAFT_RUNS[key]
    _check_same(tp1, tp2)
    assert tp2["metrics"]["num_accepted_tokens"] > 0
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert tp2["metrics"][key] == tp1["metrics"][key]


def test_tp2_draft_model_token_tree(target_and_draft):
    """A static token tree drafted by a draft model sharded over both ranks: tree masks through
    the sharded attention, and the core's KV copy list (the accepted path's compaction) applied
    on every rank's KV heads; greedy and seeded equal TP=1."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "token_tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    copies = []
    from specinfer.executor.multiproc import MultiprocExecutor

    apply = MultiprocExecutor.apply_kv_copies

    def counted(self, src, dst):
        copies.append(len(src))
        return apply(self, src, dst)

    MultiprocExecutor.apply_kv_copies = counted
    try:
        tp2 = _run(target, 2, spec)
    finally:
        MultiprocExecutor.apply_kv_copies = apply
    _check_same(_run(target, 1, spec), tp2)
    assert tp2["metrics"]["num_accepted_tokens"] > 0
    assert sum(copies) > 0, "no accepted tree path needed compaction"


def _started(target, timeout_s: float = 60, spec=None):
    before = set(_children())
    gen = Generator(str(target), tensor_parallel_size=2, distributed_timeout_s=timeout_s, speculative=spec,
                    **SETTINGS)
    workers = sorted(set(_children()) - before)
    assert len(workers) == 1
    return gen, workers[0], before


def test_ctrl_c_cancels_the_step_then_a_worker_exception_reaches_user(tiny_dir):
    """With layer_skip drafting through the sharded target's first layer (greedy: the target's
    tokens): Ctrl-C in the driver mid-generation gives KeyboardInterrupt at a step boundary, every
    rank still in step (the next generate gives the reference tokens). Then a worker's exception:
    its message in the driver's error, every worker gone, further calls refused."""
    target = tiny_dir("llama", False)[0]
    ps = prompts(4)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in Generator(str(target), **SETTINGS).generate(ps, long, use_tqdm=False)]
    gen, _, before = _started(target, spec={"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3})
    rank0 = gen.engine.executor.rank
    handle, calls = rank0.handle, []

    def ctrl_c_in_the_fifth_step(msg):  # SIGINT lands while every rank is inside the step
        calls.append(msg)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return handle(msg)

    rank0.handle = ctrl_c_in_the_fifth_step
    with pytest.raises(KeyboardInterrupt):
        gen.generate(ps, long, use_tqdm=False)
    rank0.handle = handle
    assert len(calls) == 5
    assert [o.token_ids for o in gen.generate(ps, long, use_tqdm=False)] == want
    assert gen.spec_metrics()["num_accepted_tokens"] > 0
    # messages past the control channel's fixed broadcast take a second one; every rank gets all
    ex = gen.engine.executor
    assert ex.collective_rpc("total_payload_bytes", bytes(100)) == 2 * 100
    assert ex.collective_rpc("total_payload_bytes", bytes(100_000)) == 2 * 100_000
    with pytest.raises(TensorParallelError, match=r"worker rank 1 failed: RuntimeError: boom on the worker"):
        gen.engine.executor.collective_rpc("raise_error", "boom on the worker")
    assert set(_children()) - before == set()
    with pytest.raises(TensorParallelError, match="shut down"):
        gen.generate(prompts(1), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("how", ["between_steps", "mid_generation"])
def test_worker_killed_gives_an_error_not_a_hang(tiny_dir, how):
    gen, worker, before = _started(tiny_dir("llama", False)[0])
    many = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)] * 4
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1|collective"):
        if how == "between_steps":
            stream = gen.stream(prompts(4), many)
            next(stream)
            os.kill(worker, signal.SIGKILL)
            for _ in stream:
                pass
        else:
            threading.Timer(1.0, os.kill, (worker, signal.SIGKILL)).start()
            gen.generate(prompts(4) * 4, many * 4, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert set(_children()) - before == set()
    # the failed step was cancelled in the core; the executor refuses further work with a clear error
    gen.engine.core.check_invariants()
    with pytest.raises(TensorParallelError, match="shut down"):
        gen.generate(prompts(1), GREEDY, use_tqdm=False)


def test_stopped_worker_times_out(tiny_dir):
    """A worker that stops answering (SIGSTOP) fails the step after distributed_timeout_s."""
    gen, worker, before = _started(tiny_dir("llama", False)[0], timeout_s=4)
    gen.generate(prompts(1), GREEDY, use_tqdm=False)
    os.kill(worker, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match=r"timed out|collective"):
            gen.generate(prompts(2), GREEDY, use_tqdm=False)
    finally:
        try:
            os.kill(worker, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert time.monotonic() - t0 < 25
    assert set(_children()) - before == set()


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, distributed_timeout_s=0), "distributed_timeout_s"),
    (dict(tensor_parallel_size=2, speculative={"method": "draft_model", "model": "x",
                                               "draft_tensor_parallel_size": 3}), "draft_tensor_parallel_size"),
    (dict(speculative={"method": "ngram", "draft_tensor_parallel_size": 1}), "draft_tensor_parallel_size"),
    (dict(tensor_parallel_size=2, speculative={"method": "medusa", "model": "x"}), "speculative.method"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
])
def test_bad_parallel_settings_name_the_field(tiny_dir, kwargs, field):
    before = set(_children())
    with pytest.raises(ValueError, match=field):
        Generator(str(tiny_dir("llama", False)[0]), **kwargs)
    assert set(_children()) - before == set()


def test_unshardable_heads_name_the_field():
    from specinfer.models.tensor_parallel import check_shardable, kv_heads_of_rank

    class Cfg:
        num_heads, num_kv_heads, intermediate_size = 4, 2, 128

    check_shardable(Cfg, 2)
    check_shardable(Cfg, 4)  # two KV heads, each replicated on two ranks
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        check_shardable(Cfg, 3)
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads_of_rank(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]


def test_in_process_kv_copies_move_k_and_v_of_every_pool():
    from specinfer.executor import InProcessExecutor
    from specinfer.platform import resolve_platform

    ex = InProcessExecutor(resolve_platform("cpu"))
    pools = [[torch.randn(2, 3, 4, 2, 8) for _ in range(2)], [torch.randn(2, 3, 4, 1, 8)]]
    ex._kv_caches = pools
    want = [[c.clone() for c in pool] for pool in pools]
    src, dst = np.array([5, 6]), np.array([1, 11])
    ex.apply_kv_copies(src, dst)
    for pool, ref in zip(pools, want):
        for c, r in zip(pool, ref):
            flat, rflat = c.view(2, 12, *c.shape[3:]), r.view(2, 12, *r.shape[3:])
            assert torch.equal(flat[:, [1, 11]], rflat[:, [5, 6]])
            rflat[:, [1, 11]] = rflat[:, [5, 6]]
            assert torch.equal(c, r)  # nothing else changed


TORCHRUN_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from specinfer import Generator, SamplingParams
gen = Generator(sys.argv[1], tensor_parallel_size=2, distributed_timeout_s=60, **json.loads(sys.argv[2]))
outs = gen.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
gen.close()
"""


def test_torchrun_env_rendezvous(tiny_dir, tmp_path):
    """The multi-machine path (torchrun, env:// rendezvous, every rank runs the script and rank 1
    turns into a worker inside Generator(...)) with both ranks on this machine."""
    import json
    import socket
    import subprocess
    import sys

    target, _ = tiny_dir("llama", False)
    ps = prompts(3)
    want = Generator(str(target), **SETTINGS).generate(ps, SamplingParams(max_tokens=12, temperature=0.0),
                                                       use_tqdm=False)
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(__import__("specinfer").__path__[0].rsplit("/", 1)[0]),
                                                     os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}", str(script), str(target), json.dumps(SETTINGS),
           json.dumps(ps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1, done.stdout  # only the driver (rank 0) returns from Generator(...)
    assert json.loads(lines[0][len("TOKENS "):]) == [o.token_ids for o in want]


def test_cli_flags_reach_the_engine(tiny_dir):
    import argparse

    from specinfer.cli import options
    from specinfer.cli.errors import CliError

    target, _ = tiny_dir("llama", False)
    p = argparse.ArgumentParser()
    options.add_speculative_arguments(p)
    options.add_engine_arguments(p)
    args = p.parse_args(["--tensor-parallel-size", "2", "--draft", str(target), "--draft-tensor-parallel-size", "1"])
    assert options.engine_kwargs(args)["tensor_parallel_size"] == 2
    assert options.speculative_config(args).draft_tensor_parallel_size == 1
    with pytest.raises(CliError, match="--tensor-parallel-size must be >= 1"):
        options.engine_kwargs(p.parse_args(["--tensor-parallel-size", "0"]))
    with pytest.raises(CliError, match="--draft-tensor-parallel-size is only used by --method draft_model"):
        options.speculative_config(p.parse_args(["--method", "ngram", "--draft-tensor-parallel-size", "1"]))


@pytest.mark.slow
def test_tp4_with_draft_tp2(target_and_draft):
    """Four ranks (each of the two KV heads replicated on two), the draft over ranks 0-1: a
    draft group that is neither 1 nor N."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": 2}
    tp4 = _run(target, 4, spec)
    _check_same(_run(target, 1, {**spec, "draft_tensor_parallel_size": None}), tp4)
    assert tp4["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_tp2_on_the_emulated_gaudi_path(tiny_dir):
    """hpu-emulated: the Rust packer pads to buckets, flat block-list attention, eager shards."""
    target, _ = tiny_dir("llama", False)
    _check_same(_run(target, 1), _run(target, 2, device="hpu-emulated"))


DRIVER_SCRIPT = """
import json, sys, time
import torch
torch.set_num_threads(1)
from specinfer import Generator, SamplingParams
if __name__ == "__main__":  # workers re-import this module: the guard keeps them from running it
    gen = Generator(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2]))
    gen.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    print("WORKERS", json.dumps([p.pid for p in gen.engine.executor.procs]), flush=True)
    time.sleep(600)
"""


def test_killed_driver_leaves_no_worker(tiny_dir, tmp_path):
    """The driver process SIGKILLed (no atexit, no close): its workers end by themselves."""
    import json
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_dir("llama", False)[0]), json.dumps(SETTINGS)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("WORKERS "), line
        workers = json.loads(line[len("WORKERS "):])
        assert len(workers) == 1 and os.path.exists(f"/proc/{workers[0]}")
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its killed driver"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
