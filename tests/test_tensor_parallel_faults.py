"""Tensor-parallel failures: a worker's exception reaches the user, a killed or stopped worker
fails the Generator within a bounded time, Ctrl-C cancels the step with every rank in step, a
killed driver leaves no worker, and no process outlives its Generator."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from spec_cases import prompts
from specinfer import Generator, SamplingParams
from specinfer.executor.multiproc import TensorParallelError
from tp_cases import GREEDY, SETTINGS, alive, children, started

def test_ctrl_c_cancels_the_step_then_a_worker_exception_reaches_user(tiny_dir):
    """With layer_skip drafting through the sharded target's first layer (greedy: the target's
    tokens): Ctrl-C in the driver mid-generation gives KeyboardInterrupt at a step boundary, every
    rank still in step (the next generate gives the reference tokens). Then a worker's exception:
    its message in the driver's error, every worker gone, further calls refused."""
    target = tiny_dir("llama", False)[0]
    ps = prompts(4)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in Generator(str(target), **SETTINGS).generate(ps, long, use_tqdm=False)]
    gen, _, before = started(target, spec={"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3})
    rank0 = gen.engine.executor.rank
    handle, calls = rank0.handle, []

    def ctrl_c_in_the_fifth_step(msg):  # SIGINT lands while every rank is inside the step
        calls.append(msg)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return handle(msg)

    rank0.handle = ctrl_c_in_the_fifth_step
    # Python's own Ctrl-C handler, as in a program that installed none (a full suite run once saw
    # another one here: then SIGINT never became a KeyboardInterrupt). What was there is put back.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            gen.generate(ps, long, use_tqdm=False)
    except BaseException:
        gen.close()  # no engine left holding torch.distributed for the next test
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
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
    assert set(children()) - before == set()
    with pytest.raises(TensorParallelError, match="shut down"):
        gen.generate(prompts(1), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("how", ["between_steps", "mid_generation"])
def test_worker_killed_gives_an_error_not_a_hang(tiny_dir, how):
    gen, worker, before = started(tiny_dir("llama", False)[0])
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
    assert set(children()) - before == set()
    # the failed step was cancelled in the core; the executor refuses further work with a clear error
    gen.engine.core.check_invariants()
    with pytest.raises(TensorParallelError, match="shut down"):
        gen.generate(prompts(1), GREEDY, use_tqdm=False)


def test_stopped_worker_times_out(tiny_dir):
    """A worker that stops answering (SIGSTOP) fails the step after distributed_timeout_s."""
    gen, worker, before = started(tiny_dir("llama", False)[0], timeout_s=4)
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
    assert set(children()) - before == set()


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
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a worker outlived its killed driver"
