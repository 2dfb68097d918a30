"""The target forward as an asynchronous launch: ``launch(fn, batch)`` returns at once, and the
result is readable only through ``PendingForward.wait()``, as a CUDA launch and its sync behave.

On CUDA a launch is asynchronous by itself (the kernels queue on the stream and the host returns);
the engine's overlapped loop (engine/llm_engine.py) uses that time for the previous step's output
work. Where a forward runs on the calling thread (CPU, the emulated Gaudi path, the driver rank
of a tensor-parallel group), one worker thread stands in for the device: the forward runs there
while the engine's thread works, and torch's kernels and ours release the GIL while they compute.

``wait()`` re-raises whatever the forward raised (KeyboardInterrupt injected there too);
``settle()`` waits for the forward to end whatever it did, so a step cancelled by an error on the
engine's thread (Ctrl-C during the wait) never leaves a forward writing KV into blocks that the
next schedule may hand to another request.
"""
from __future__ import annotations

import queue
import threading
import time
from functools import partial

import torch


class PendingForward:
    """One launched forward: its result (or exception) once the worker has run it."""

    __slots__ = ("_done", "_result", "_error", "device_s")

    def __init__(self):
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self.device_s = 0.0  # seconds the forward took where it ran

    @classmethod
    def completed(cls, fn, *args) -> "PendingForward":
        """A launch that ran on the caller's thread (its result is ready, or it raised)."""
        p = cls()
        t = time.perf_counter()
        try:
            p._result = fn(*args)
        finally:
            p.device_s = time.perf_counter() - t
            p._done.set()
        return p

    def _run(self, fn, args) -> None:
        t = time.perf_counter()
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, KeyboardInterrupt too
            self._error = e
        finally:
            self.device_s = time.perf_counter() - t
            self._done.set()

    def wait(self):
        """Block until the forward ended; its result, or its exception re-raised here."""
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result

    def done_result(self):
        """The result of a forward that has run (a later forward on the same thread reads it, as a
        later kernel on a stream reads an earlier one's output); RuntimeError if it failed or has not
        run."""
        if not self._done.is_set() or self._error is not None:
            raise RuntimeError("the step this one was scheduled ahead of did not complete")
        return self._result

    def settle(self) -> None:
        """Wait for the forward to end, ignoring its outcome (the step is being cancelled);
        a Ctrl-C meanwhile is held until it ended."""
        interrupted = False
        while True:
            try:
                self._done.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
        if interrupted:
            raise KeyboardInterrupt


class ForwardThread:
    """One daemon worker running launched forwards in order (one or two in flight in the engine).
    Started on first use; closed with the executor. The queue is a SimpleQueue (C; a launch is a
    put, ~1 us, where a Condition costs ~20 us on the engine's critical path)."""

    _STOP = object()

    def __init__(self, name: str = "specinfer-forward"):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def launch(self, fn, *args) -> PendingForward:
        p = PendingForward()
        with self._lock:  # (uncontended: ~0.2 us) no job may follow close()'s stop mark
            if self._closed:
                raise RuntimeError("the forward thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((p, fn, args))
        return p

    def _loop(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is self._STOP:
                return
            p, fn, args = job
            p._run(fn, args)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(self._STOP)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class LaunchesForwards:
    """The executors' launch side: ``launch_model(batch)`` runs ``execute_model`` on the forward
    thread when one is set (``run_forwards_on_thread(True)``), else on the caller's thread."""

    forward_thread: ForwardThread | None = None

    def run_forwards_on_thread(self, on: bool) -> None:
        if on and self.forward_thread is None:
            self.forward_thread = ForwardThread()
        elif not on and self.forward_thread is not None:
            self.forward_thread.close()
            self.forward_thread = None

    def launch_model(self, batch, then=None, before=None) -> PendingForward:
        """batch: attention.batch_metadata.ModelBatch -> a PendingForward of (hidden [T, hidden],
        logits [L, vocab]), or of (hidden, logits, then(logits)) when `then` is given: work queued
        behind the forward where it runs (the step's sampling, on the forward thread). `before(batch)`
        runs where the forward runs, just before it (a step scheduled ahead takes the previous
        step's tokens into its input ids there: fill_ahead_inputs)."""
        fn = self.execute_model if then is None else partial(_forward_then, self.execute_model, then)
        if before is not None:
            fn = partial(_before_forward, before, fn)
        if self.forward_thread is None:
            return PendingForward.completed(fn, batch)
        return self.forward_thread.launch(fn, batch)


    def launch_job(self, fn, forward_tokens=()) -> PendingForward:
        """Device work other than the target's forward — a draft model's proposal, its forwards back
        to back — queued where the forwards run, in order with them: on the forward thread when one
        is set, else on the caller's thread (where CUDA queues its kernels and returns). `fn()` ->
        the PendingForward's result. `forward_tokens`: the token counts of the model forwards it
        runs (what a modeled device reads: benches/overlap_standin.py)."""
        if self.forward_thread is None:
            return PendingForward.completed(fn)
        return self.forward_thread.launch(fn)


def _forward_then(execute, then, batch):
    hidden, logits = execute(batch)
    return hidden, logits, then(logits)


def _before_forward(before, fn, batch):
    before(batch)
    return fn(batch)


def fill_ahead_inputs(previous: PendingForward, input_pos, src, batch) -> None:
    """A step scheduled ahead (SchedulerCore.schedule_ahead): its input ids at `input_pos` are the
    previous step's emitted tokens `src`, read where the forwards run, in order, after that step's
    sampling ran — on the forward thread from its host tokens, or where launches are asynchronous
    (CUDA) as device ops queued behind the previous step's sampling. The previous step's failure
    fails this one."""
    from specinfer.attention.batch_metadata import as_device

    emitted = previous.done_result()[2]
    device = batch.input_ids.device
    if hasattr(emitted, "tokens"):  # sampled on the device (engine/device_sampling.py): a device-side gather
        tokens = emitted.tokens[as_device(src, emitted.tokens.device)]
    else:
        tokens = torch.from_numpy(emitted.token_ids[src])
    batch.input_ids[as_device(input_pos, device)] = tokens.to(device, non_blocking=True)
