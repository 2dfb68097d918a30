"""The multiprocess executor: the target sharded over N ranks, a draft model over ranks
0..d-1, through torch.distributed. This process (the driver) is rank 0: it owns the Rust
scheduler, sampling and proposing, computes its own shard, and sends every call to the other
ranks as ONE pickled message (broadcast on a gloo control group: executor/control_channel.py),
then handles the same message itself (executor/rank_worker.py): no per-field broadcast exists to forget a field in.

Failure is bounded: every collective runs under `timeout_s`; a worker that exits is noticed
before the next call (its exit code) or by the collective it abandons; its exception text (sent
through the rendezvous store) becomes the driver's error; then every worker is shut down and the
executor refuses further calls. Ctrl-C in the driver is held until the running call completes
(bounded by the timeout), so the step it interrupts is cancelled cleanly; workers ignore Ctrl-C
and never outlive the driver.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from specinfer.executor.interrupts import deferred_keyboard_interrupt
from specinfer.executor import messages as m
from specinfer.executor.control_channel import ControlChannel
from specinfer.executor.device_move import to_wire
from specinfer.executor.forward_thread import LaunchesForwards
from specinfer.executor.head_handle import RanksHead
from specinfer.executor.process_group import (READY_KEY, STARTUP_TIMEOUT_S, destroy_world, env_rank, init_world,
                                              launched_by_torchrun, read_errors)
from specinfer.executor.rank_worker import RankWorker
from specinfer.executor.worker import serve, spawned_worker_main

class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed, exited or stopped answering; the executor is shut down."""


class MultiprocExecutor(LaunchesForwards):
    def __init__(self, parallel, platform):
        self.parallel = parallel
        self.platform = platform
        self.tensor_parallel_size = N = parallel.tensor_parallel_size
        self.timeout_s = parallel.distributed_timeout_s
        backend = getattr(platform, "distributed_backend", "gloo")
        self.procs = []
        self._failure: str | None = None
        self._closed = False
        if launched_by_torchrun():
            rank, world_size, _ = env_rank()
            if world_size != N:
                raise ValueError(f"tensor_parallel_size={N} but torchrun started WORLD_SIZE={world_size} ranks; "
                                 "launch one rank per shard")
            self.world = init_world(backend, rank, N, self.timeout_s)
        else:
            store = dist.TCPStore("127.0.0.1", 0, N, True, timeout=timedelta(seconds=max(self.timeout_s,
                                                                                         STARTUP_TIMEOUT_S)),
                                  wait_for_workers=False)
            ctx = _worker_context()
            for r in range(1, N):
                p = ctx.Process(target=spawned_worker_main, name=f"specinfer-tp-rank{r}", daemon=True,
                                args=(r, N, "127.0.0.1", store.port, _worker_device(platform, r), backend,
                                      self.timeout_s))
                p.start()
                self.procs.append(p)
            try:
                self._await_workers(store)
                self.world = init_world(backend, 0, N, self.timeout_s, store=store)
            except BaseException:
                self._kill_workers()
                raise
        self.rank = RankWorker(self.world, platform)
        self.channel = ControlChannel(self.world.control_group)
        self._roles: dict[int, str] = {}  # id(model) -> role
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ the executor interface
    def load_model(self, path, role: str = "target", *, dtype, quantization=None):
        size = self.tensor_parallel_size if role == "target" else self.parallel.draft_size
        loaded = self._call(m.LoadModel(role, str(path), size, dtype, quantization))
        self._roles[id(loaded.model)] = role
        return loaded

    def load_head(self, method: str, path, target, *, dtype, quantization=None):
        """A draft head sharded over the target's ranks: every rank loads it over its target shard
        and keeps its shard; the proposer gets a handle that runs each call on every rank."""
        local = self._call(m.LoadHead(method, str(path), dtype, quantization))
        handle = RanksHead(self, local)
        self._roles[id(handle)] = "head"
        return handle

    def head_call(self, name: str, args: tuple):
        return self._call(m.HeadCall(name, to_wire(args)))

    def allocate_kv_caches(self, models, num_blocks: int, block_size: int, dtype, attention_backend: str,
                           limits) -> list[list[torch.Tensor]]:
        by_role = self._call(m.BindKv(num_blocks, block_size, dtype, attention_backend, limits))
        return [by_role[self._roles[id(model)]] for model in models]

    def make_runner(self, model, kv_caches, backend, limits, aux_layers: tuple = ()):
        """The target's runner; with aux_layers (EAGLE-3) the driver's shard keeps those layers'
        inputs: the residual stream is whole on every rank (after each row-parallel all-reduce)."""
        runner = self.make_eager_runner(model, kv_caches, backend)
        if aux_layers:
            self.rank.runners[self._roles[id(model)]].aux_layers = tuple(aux_layers)
        return runner

    def make_eager_runner(self, model, kv_caches, backend):
        """The model's runner on every rank of its group (layer_skip: the target's, exit_layer
        passed through to each shard)."""
        role = self._roles[id(model)]
        local = self.rank.runners[role]
        return ShardedRunner(self, role, local) if self.rank.groups[role].size > 1 else local

    def execute_model(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward + logits over one step's ModelBatch on every rank; rank 0's full hidden
        states [T, hidden] and gathered float32 logits [L, vocab] come back."""
        return self._call(m.ExecuteModel(to_wire(batch)))

    def apply_kv_copies(self, src, dst) -> None:
        """The core's copy list (int64[C] flat slots) applied on every rank's pools."""
        if len(src):
            self._call(m.ApplyKvCopies(np.asarray(src, np.int64), np.asarray(dst, np.int64)))

    def collective_rpc(self, name: str, *args):
        """RankWorker.<name>(*args) on every rank; rank 0's result."""
        return self._call(m.CallMethod(name, args))

    def shutdown(self) -> None:
        """Stop every worker (Shutdown message, then kill what lingers) and leave the world."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.run_forwards_on_thread(False)
        if self._failure is None:
            try:
                self.channel.send(m.Shutdown())
                self.channel.flush()
            except Exception:  # noqa: BLE001 - a worker already gone; kill the rest below
                pass
        self._kill_workers(grace_s=5.0 if self._failure is None else 0.0)
        destroy_world()

    # ------------------------------------------------------------------ one call, every rank
    def _call(self, msg):
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor is shut down"
                                      + (f" after: {self._failure}" if self._failure else ""))
        self._check_workers()
        with deferred_keyboard_interrupt():
            try:
                self.channel.send(msg)  # asynchronous: overlaps with this rank's own handling
                out = self.rank.handle(msg)
                self.channel.flush()
                return out
            except BaseException as e:  # noqa: BLE001 - every rank must stop: the ranks are out of step
                self._fail(e)

    def _check_workers(self) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        if dead:
            self._fail(None, ", ".join(f"worker rank {r} exited with code {c}" for r, c in dead))

    def _fail(self, error: BaseException | None, what: str | None = None):
        if error is not None and not _is_collective_error(error):
            # the driver's own error (a bad setting the workers met too, Ctrl-C outside the main
            # thread): as it is, once every worker is stopped
            self._failure = f"{type(error).__name__}: {error}"
            self.shutdown()
            raise error
        reports = read_errors(self.world.store, self.tensor_parallel_size, wait_s=2.0)
        if reports:
            what = "; ".join(f"worker rank {r} failed: {text.strip()}" for r, text in sorted(reports.items()))
        elif what is None and error is not None and _is_collective_error(error):
            what = (f"a collective failed or timed out (timeout {self.timeout_s:g} s): a worker died or stopped "
                    f"answering ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
        self._failure = what or f"{type(error).__name__}: {error}"
        self.shutdown()
        raise TensorParallelError(f"tensor-parallel executor stopped: {self._failure}") from error

    def _await_workers(self, store) -> None:
        """Until every spawned worker has reached the store: one that exits first is an error now,
        not a rendezvous timeout later."""
        keys = [READY_KEY.format(rank=r) for r in range(1, self.tensor_parallel_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not store.check(keys):
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                what = (", ".join(f"worker rank {r} exited with code {c} while starting" for r, c in dead)
                        or f"workers did not start within {STARTUP_TIMEOUT_S:g} s")
                raise TensorParallelError(f"tensor-parallel executor did not start: {what} (its traceback, if any, "
                                          "is on stderr)")
            time.sleep(0.05)

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        for p in self.procs:
            if grace_s:
                p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)


class ShardedRunner:
    """The driver's runner for a model sharded over several ranks: each call goes to every rank as
    one message and runs on the driver's shard too (same interface as ModelRunner)."""

    def __init__(self, executor: MultiprocExecutor, role: str, local):
        self.executor = executor
        self.role = role
        self.local = local
        self.model, self.kv_caches, self.backend = local.model, local.kv_caches, local.backend

    @property
    def last_aux(self):
        return self.local.last_aux

    def forward(self, input_ids, positions, attn, prepared=None, **model_kwargs):
        return self.executor._call(m.RunForward(self.role, to_wire(input_ids), to_wire(positions),
                                                to_wire(attn), model_kwargs))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.executor._call(m.RunLogits(self.role, to_wire(hidden)))


def run_torchrun_worker(parallel, platform) -> None:
    """A torchrun rank > 0: serve the driver until it shuts down, then exit the process."""
    import signal

    rank, world_size, local_rank = env_rank()
    if world_size != parallel.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size} but torchrun started "
                         f"WORLD_SIZE={world_size} ranks; launch one rank per shard")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from specinfer.platform import resolve_platform

    device = _worker_device(platform, local_rank, base_index=0)
    platform = resolve_platform(device) if device != str(platform.device) else platform
    world = init_world(getattr(platform, "distributed_backend", "gloo"), rank, world_size, parallel.distributed_timeout_s)
    code = 0
    try:
        serve(world, platform)
    except BaseException:  # noqa: BLE001 - reported to the driver by serve()
        code = 1
    finally:
        destroy_world()
    sys.stdout.flush()
    os._exit(code)


def _worker_context():
    """How workers start: "forkserver" (default: one clean server process, started once per driver
    with torch and specinfer imported, forks each worker in milliseconds; nothing of the driver's
    state, CUDA included, is inherited) or "spawn" (a fresh interpreter per worker), chosen by
    SPECINFER_TP_START_METHOD."""
    method = os.environ.get("SPECINFER_TP_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"SPECINFER_TP_START_METHOD={method!r}: use 'forkserver' or 'spawn'")
    ctx = torch.multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["specinfer.executor.worker"])
    return ctx


def _worker_device(platform, rank: int, base_index: int | None = None) -> str:
    """The device string a worker resolves its platform from: CUDA ranks take consecutive devices
    after the driver's; other platforms name themselves."""
    dev = platform.device
    if dev.type == "cuda":
        base = (dev.index or 0) if base_index is None else base_index
        return f"cuda:{base + rank}"
    return getattr(platform, "device_name", None) or str(dev)


def _is_collective_error(e: BaseException) -> bool:
    return isinstance(e, (RuntimeError, getattr(dist, "DistError", RuntimeError))) and \
        not isinstance(e, TensorParallelError)
