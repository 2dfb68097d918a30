"""Ranks 1..N-1: receive each message the driver broadcasts, handle it on this rank's shards, until
Shutdown. Started by the driver (spawned processes) or by torchrun (every rank runs the user's
script; on ranks > 0 `Generator(...)` lands here and exits the process when the driver is done).

A worker ignores Ctrl-C (the driver decides; it shuts the workers down), writes any exception to
the rendezvous store for the driver to report, and exits; a spawned worker whose driver vanished
exits too, so no process outlives its driver.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

from specinfer.executor import messages as m
from specinfer.executor.control_channel import ControlChannel
from specinfer.executor.process_group import READY_KEY, STARTUP_TIMEOUT_S, destroy_world, init_world, report_error
from specinfer.executor.rank_worker import RankWorker


def serve(world, platform) -> None:
    """The worker loop; returns on Shutdown, raises on failure (after reporting it)."""
    worker = RankWorker(world, platform)
    channel = ControlChannel(world.control_group)
    try:
        while True:
            msg = channel.recv()
            if isinstance(msg, m.Shutdown):
                return
            with torch.inference_mode():
                worker.handle(msg)
    except BaseException as e:
        text = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        report_error(world.store, world.rank, text)
        raise


def spawned_worker_main(rank: int, world_size: int, host: str, port: int, device: str, backend: str,
                        timeout_s: float) -> None:
    """Entry point of a worker process the driver spawned (torch.multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C
    torch.set_num_threads(int(os.environ.get("SPECINFER_WORKER_THREADS", torch.get_num_threads())))
    _exit_with_parent()
    from specinfer.platform import resolve_platform

    code = 0
    try:
        store = dist.TCPStore(host, port, world_size, False, timeout=_td(max(timeout_s, STARTUP_TIMEOUT_S)))
        store.set(READY_KEY.format(rank=rank), b"1")
        world = init_world(backend, rank, world_size, timeout_s, store=store)
        serve(world, resolve_platform(device))
    except BaseException:  # noqa: BLE001 - reported through the store by serve(); exit non-zero
        code = 1
    finally:
        destroy_world()
    os._exit(code)  # skip interpreter teardown: nothing left to flush, and it cannot hang


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:  # the driver died (re-parented to init)
                os._exit(3)

    threading.Thread(target=watch, name="specinfer-parent-watch", daemon=True).start()


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
