"""Joining the torch.distributed world: rendezvous, the two process groups, worker error reports.

- the default group (gloo on CPU, NCCL on CUDA, HCCL on Gaudi: `Platform.distributed_backend`)
  meets at rendezvous and after loading (barriers), under STARTUP_TIMEOUT: starting processes
  and loading weights may legitimately take minutes;
- the compute group (same backend, same ranks) carries the model's collectives under the
  executor's timeout: a rank that stops answering turns a step into an error within `timeout_s`;
- a gloo "control" group carries the driver's messages (broadcasts from rank 0); its
  timeout is long, since workers wait on it while the engine is idle;
- the rendezvous store carries worker error reports (`report_error` / `read_errors`).

Rendezvous: `tcp://` at an address and port the driver chose (workers it spawned), or `env://`
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE: torchrun, one or many machines).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

CONTROL_TIMEOUT = timedelta(days=7)  # workers idle on the control group between steps
STARTUP_TIMEOUT_S = 900.0  # rendezvous and model loading (at least the executor's timeout)
ERROR_KEY = "specinfer_tp/error/{rank}"
READY_KEY = "specinfer_tp/ready/{rank}"  # a spawned worker reached the store


@dataclass
class DistributedWorld:
    rank: int
    world_size: int
    backend: str
    control_group: object  # gloo group for the driver's messages
    compute_group: object  # the model's collectives, under the executor's timeout
    timeout_s: float
    store: object  # the rendezvous store (error reports)


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a torchrun / env:// launch (RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def env_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the environment torchrun sets."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def init_world(backend: str, rank: int, world_size: int, timeout_s: float, *, store=None) -> DistributedWorld:
    """Join the world through `store` (a TCPStore the spawning driver made) or env:// (torchrun)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                           "engine per process (close the previous Generator first)")
    if backend == "hccl":  # pragma: no cover - needs Gaudi
        from specinfer.kernels.hpu.device import register_hccl

        register_hccl()
    timeout = timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    # a gloo group's timeout is each rank's own: workers wait for messages as long as the engine
    # idles, while the driver's sends give up on a silent worker after timeout_s
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if rank == 0 else CONTROL_TIMEOUT)
    compute = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistributedWorld(rank, world_size, backend, control, compute, timeout_s, store)


def report_error(store, rank: int, text: str) -> None:
    """A worker's last words: read by the driver when a collective fails."""
    try:
        store.set(ERROR_KEY.format(rank=rank), text.encode())
    except Exception:  # noqa: BLE001 - the store (on the driver) may be gone already
        pass


def read_errors(store, world_size: int, wait_s: float = 2.0) -> dict[int, str]:
    """Error reports of ranks 1..N-1, waiting up to wait_s for one to arrive."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        for r in range(1, world_size):
            key = ERROR_KEY.format(rank=r)
            try:
                if store.check([key]):
                    found[r] = store.get(key).decode(errors="replace")
            except Exception:  # noqa: BLE001 - a broken store has nothing more to tell
                return found
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def destroy_world() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - tearing down after a failure
            pass
